"""The frontend and the backend in two processes over ZeroMQ: parity, cancellation, faults, lifecycle."""

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from conftest import LLAVA_IMAGE_SIZE
from waiting import DEADLINE, SLACK, wait_until, wait_until_async

from spindle import LLM, FinishReason, LLMEngine, RequestOutputKind, SamplingParams
from spindle.backend.engine_process import prepare_address
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine
from spindle.frontend.engine.connection import (
    BackendConnection,
    BackendProcess,
    EngineDeadError,
    ping_backend,
    start_backend,
)
from spindle.shared.config import EngineConfig
from spindle.shared.errors import EngineUnavailableError, InvalidRequestError
from spindle.shared.protocol import (
    FRONTEND_TIMEOUT,
    HEARTBEAT_TIMEOUT,
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    BackendMessage,
    EngineRequest,
    EngineStats,
    Hello,
    Ready,
    StepOutputs,
)
from spindle.shared.transport import load_keys, secure_client

NUM_STREAMS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def tiny_config(model_dir: Path, **kwargs) -> EngineConfig:
    return EngineConfig.of(**{"model": str(model_dir), "dtype": "float32", "kv_cache_memory": "4MiB", **kwargs})


def prompts_for(n: int) -> list[dict]:
    return [{"prompt_token_ids": [3 + (7 * i + j) % 250 for j in range(1 + i % 40)]} for i in range(n)]


@pytest.fixture(scope="module")
def backend(tiny_llm_dir: Path):
    """A backend process on a private ipc socket, shared by the tests that do not kill it."""
    process, address = start_backend(tiny_config(tiny_llm_dir))
    yield address
    process.terminate()
    assert process.wait(30) == 0


def run_engine(address: str, coroutine_fn, **engine_args) -> object:
    """Connect an AsyncLLMEngine to ``address`` (with ``engine_args``), run ``coroutine_fn(engine)`` and disconnect."""
    engine = AsyncLLMEngine.from_args(backend_address=address, **engine_args)
    try:
        return asyncio.run(coroutine_fn(engine))
    finally:
        engine.shutdown()


async def collect(engine: AsyncLLMEngine, inputs: dict, params: SamplingParams, request_id: str) -> list[int]:
    final = None
    async for output in engine.generate(inputs, params, request_id):
        final = output
    return final.outputs[0].token_ids


async def settled_stats(engine: AsyncLLMEngine, timeout: float = DEADLINE) -> EngineStats:
    """The backend's stats once nothing runs or waits there (each look awaits its next stats)."""

    async def settled() -> EngineStats | None:
        stats = await engine.get_stats()
        return None if stats.num_running or stats.num_waiting else stats

    return await wait_until_async(settled, "nothing runs or waits in the backend", timeout, interval=0)


def test_concurrent_streams_equal_the_in_process_engine(backend, tiny_llm_dir):
    prompts = prompts_for(NUM_STREAMS)
    in_process = LLM(**tiny_config(tiny_llm_dir).settings())
    expected = [o.outputs[0].token_ids for o in in_process.generate(prompts, GREEDY, use_tqdm=False)]

    async def split(engine):
        return await asyncio.gather(*(collect(engine, p, GREEDY, f"r{i}") for i, p in enumerate(prompts)))

    assert run_engine(backend, split) == expected
    multiprocess = LLMEngine(tiny_config(tiny_llm_dir), backend_address=backend)
    try:
        for i, p in enumerate(prompts[:4]):
            multiprocess.add_request(str(i), p, GREEDY)
        finals = {}
        while multiprocess.has_unfinished_requests():
            finals.update({o.request_id: o.outputs[0].token_ids for o in multiprocess.step() if o.finished})
        assert [finals[str(i)] for i in range(4)] == expected[:4]
    finally:
        multiprocess.shutdown()


def test_cancelling_half_the_streams_frees_every_block(backend):
    prompts = prompts_for(NUM_STREAMS)

    async def scenario(engine):
        started = asyncio.Event()
        counts = [0] * NUM_STREAMS

        async def stream(i):
            async for _ in engine.generate(prompts[i], LONG if i % 2 else GREEDY, f"c{i}"):
                counts[i] += 1
                if counts[i] == 3 and i == 1:
                    started.set()

        tasks = [asyncio.create_task(stream(i)) for i in range(NUM_STREAMS)]
        await started.wait()
        for task in tasks[1::2]:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results[1::2])
        assert all(r is None for r in results[::2]) and all(c == GREEDY.max_tokens for c in counts[::2])
        assert all(c < LONG.max_tokens for c in counts[1::2])
        return await settled_stats(engine)

    stats = run_engine(backend, scenario)
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_closing_a_stream_or_matching_a_stop_string_frees_the_backend(backend):
    async def scenario(engine):
        stream = engine.generate(prompts_for(1)[0], LONG, "closed")
        await anext(stream)
        await stream.aclose()
        full = None
        async for output in engine.generate("hello", SamplingParams(temperature=0, max_tokens=12, min_tokens=12)):
            full = output.outputs[0].text
        stop = full[5:7]
        params = SamplingParams(temperature=0, max_tokens=400, stop=[stop])
        async for output in engine.generate("hello", params, "stopped"):
            stopped = output
        assert stopped.outputs[0].text == full[: full.index(stop)] and stopped.outputs[0].stop_reason == stop
        return await settled_stats(engine)

    stats = run_engine(backend, scenario)
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_a_stream_its_reader_leaves_is_paused_keeping_its_blocks_and_resumes_where_it_was(backend):
    prompt = prompts_for(2)[1]

    async def scenario(engine):
        undisturbed = await collect(engine, prompt, LONG, "undisturbed")
        lagging = engine.generate(prompt, LONG, "lagging")
        for _ in range(3):
            await anext(lagging)

        async def paused() -> EngineStats | None:
            stats = await engine.get_stats()
            return stats if stats.num_paused_requests == 1 else None

        # The reader stops: once 4 outputs wait, the request is paused (stats come after the steps before it).
        stats = await wait_until_async(paused, "the unread stream's request is paused", interval=0)
        assert stats.num_free_blocks < stats.num_total_blocks  # it keeps its blocks
        generated = engine.output_processor.requests["lagging"].completions[0].token_ids
        stalled_at = len(generated)
        assert await collect(engine, prompts_for(1)[0], GREEDY, "other") and len(generated) == stalled_at
        assert stalled_at < LONG.max_tokens // 2
        # Reading again resumes it, and it goes on as it would have.
        final = [output async for output in lagging][-1]
        assert final.outputs[0].token_ids == undisturbed
        return await settled_stats(engine)

    stats = run_engine(backend, scenario, stream_buffer_outputs=4)
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_paused_requests == 0


def test_bad_requests_fail_alone(backend):
    async def scenario(engine):
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await anext(engine.generate({"prompt_token_ids": [1, 999]}))
        ok = await collect(engine, prompts_for(1)[0], GREEDY, "dup")
        good = engine.generate(prompts_for(1)[0], LONG, "busy")
        await anext(good)
        other = AsyncLLMEngine.from_args(backend_address=backend)
        try:
            # The first refusal comes from this frontend, the second from the backend (the id is another
            # frontend's): both are the same typed error, naming the field.
            for frontend in (engine, other):
                with pytest.raises(InvalidRequestError, match="already in use") as refused:
                    await anext(frontend.generate(prompts_for(1)[0], GREEDY, "busy"))
                assert refused.value.fields == ("request_id",)
        finally:
            other.shutdown()
        await good.aclose()
        return ok

    assert len(run_engine(backend, scenario)) == GREEDY.max_tokens


def test_a_mismatched_protocol_version_is_refused(backend, monkeypatch):
    monkeypatch.setattr("spindle.frontend.engine.connection.PROTOCOL_VERSION", 999)
    with pytest.raises(RuntimeError, match="protocol version mismatch: the frontend speaks 999"):
        BackendConnection(backend, startup_timeout=10)


def test_sigkill_of_the_backend_ends_every_stream_and_refuses_new_ones(tiny_llm_dir):
    # Without resumption (test_resume has the streams that outlive their backend).
    engine = AsyncLLMEngine.from_args(**tiny_config(tiny_llm_dir, resume_streams=False).settings())

    async def scenario():
        first = asyncio.Event()

        async def stream(i):
            async for _ in engine.generate(prompts_for(8)[i], LONG, f"k{i}"):
                first.set()

        tasks = [asyncio.create_task(stream(i)) for i in range(8)]
        await first.wait()
        os.kill(engine.client.connection.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - killed
        assert all(isinstance(r, EngineDeadError) for r in results), results
        # The exit of a backend it started is seen at once; the heartbeats' silence would tell too, a timeout later.
        assert elapsed < HEARTBEAT_TIMEOUT + SLACK
        # Refused at once, while the new backend is still starting (it takes seconds): a request does not wait for it.
        with pytest.raises(EngineDeadError, match="a new backend is starting"):
            await anext(engine.generate("late"))
        assert engine.is_dead

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


@pytest.fixture
def private_tmp(monkeypatch) -> Path:
    """Point tempfile, here and in child processes, at a new short directory (ipc paths are limited to 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="spt"))
    monkeypatch.setenv("TMPDIR", str(directory))
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def socket_dirs(tmp: Path) -> list[Path]:
    """The socket directories start_backend made under ``tmp``."""
    return sorted(tmp.glob("spindle-*"))


FRONTEND_SCRIPT = """
import asyncio, io, json, pathlib, sys
from PIL import Image
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine
from spindle.frontend.processing.image_processor import ImageProcessor
from spindle.frontend.processing.input_processor import InputProcessor
from spindle.frontend.processing.tokenizer import Tokenizer
from spindle import SamplingParams

# An image prompt for the LLaVA model, decoded and preprocessed as the frontend does it.
llava = pathlib.Path({llava!r})
files = {{name: (llava / name).read_bytes() for name in ("config.json", "preprocessor_config.json")}}
png = io.BytesIO()
Image.new("RGB", (40, 30), (200, 10, 60)).save(png, format="PNG")
tokenizer = Tokenizer.from_dir(llava)
inputs = {{"prompt": "<image>hi", "multi_modal_data": {{"image": png.getvalue()}}}}
image = InputProcessor(tokenizer, 100, tokenizer.vocab_size, ImageProcessor.from_files(files)).process(inputs, None)

engine = AsyncLLMEngine.from_args(backend_address=sys.argv[1]) if len(sys.argv) > 1 else AsyncLLMEngine.from_args(
    model={model!r}, dtype="float32", kv_cache_memory="4MiB")

async def main():
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    async for output in engine.generate("hi", params):
        if len(output.outputs[0].token_ids) == 2:
            heavy = ("torch", "triton", "transformers", "spindle.backend.engine_core")
            loaded = sorted(m for m in heavy if m in sys.modules)
            child = engine.client.connection.process.pid if engine.client.connection.process else None
            report = {{"loaded": loaded, "child": child, "image_shape": image.images[0].shape}}
            print(json.dumps(report), flush=True)
            await asyncio.sleep(3600)

asyncio.run(main())
"""


def start_frontend(tiny_llm_dir: Path, tiny_llava_dir: Path, *args: str) -> tuple[subprocess.Popen, dict]:
    """A frontend process streaming from the tiny model, having processed an image prompt of the tiny LLaVA."""
    script = textwrap.dedent(FRONTEND_SCRIPT.format(model=str(tiny_llm_dir), llava=str(tiny_llava_dir)))
    process = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    return process, json.loads(process.stdout.readline())


def test_the_frontend_process_never_imports_model_code_and_a_lost_frontend_is_cleaned_up(
    backend, tiny_llm_dir, tiny_llava_dir
):
    process, report = start_frontend(tiny_llm_dir, tiny_llava_dir, backend)
    # Streaming from a live backend, after preprocessing an image, with no torch, triton or model code.
    assert report["loaded"] == [] and report["image_shape"] == [3, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE]
    process.kill()
    process.wait()
    lost_at = time.monotonic()

    async def watch(engine):
        return await settled_stats(engine, timeout=FRONTEND_TIMEOUT + SLACK)

    stats = run_engine(backend, watch)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert time.monotonic() - lost_at < FRONTEND_TIMEOUT + SLACK


def test_a_backend_child_dies_with_its_frontend(tiny_llm_dir, tiny_llava_dir, private_tmp):
    process, report = start_frontend(tiny_llm_dir, tiny_llava_dir)
    child = report["child"]
    assert len(socket_dirs(private_tmp)) == 1
    process.kill()
    process.wait()
    try:
        wait_until(lambda: not alive(child), "the backend exits with its parent frontend")
    except AssertionError:
        os.kill(child, signal.SIGKILL)  # not left running by the failed test
        raise
    assert socket_dirs(private_tmp) == []  # the backend removed the directory its killed frontend made


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("grace_period,finish_reason", [(30.0, "length"), (0.05, "abort")])
def test_sigterm_drains_in_flight_requests_then_exits_zero(tiny_llm_dir, grace_period, finish_reason):
    process, address = start_backend(tiny_config(tiny_llm_dir), grace_period=grace_period)
    # Long enough that the streams are still running while the checks after SIGTERM happen.
    params = SamplingParams(temperature=0, max_tokens=450, ignore_eos=True)

    async def draining() -> bool:
        return (await asyncio.to_thread(ping_backend, address)).draining

    async def scenario(engine):
        streams = [engine.generate(p, params) for p in prompts_for(4)]
        firsts = [await anext(s) for s in streams]
        process.send_signal(signal.SIGTERM)
        if finish_reason == "length":
            await wait_until_async(draining, "the backend drains")
            with pytest.raises(EngineUnavailableError, match="shutting down"):
                await anext(engine.generate("late"))
        finals = []
        for first, stream in zip(firsts, streams, strict=True):
            outputs = [first] + [output async for output in stream]
            finals.append(outputs[-1].outputs[0])
        return finals

    finals = run_engine(address, scenario)
    assert [f.finish_reason for f in finals] == [finish_reason] * 4
    assert all(type(f.finish_reason) is FinishReason for f in finals)  # ABORT here comes over the wire too
    assert all(len(f.token_ids) == 450 for f in finals) == (finish_reason == "length")
    assert process.wait(30) == 0


def test_ipc_directories_are_private_and_public_binds_are_opt_in(tmp_path, monkeypatch):
    address = prepare_address(f"ipc://{tmp_path}/run/spindle/engine.sock")
    assert (tmp_path / "run" / "spindle").stat().st_mode & 0o777 == 0o700
    assert address.endswith("engine.sock")
    (tmp_path / "open").mkdir(mode=0o755)
    prepare_address(f"ipc://{tmp_path}/open/engine.sock")
    assert (tmp_path / "open").stat().st_mode & 0o777 == 0o700
    assert prepare_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    with pytest.raises(ValueError, match="every interface"):
        prepare_address("tcp://0.0.0.0:5555")
    monkeypatch.setenv("SPINDLE_ALLOW_PUBLIC_BIND", "1")
    for reachable in ("tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://backend:5555"):
        with pytest.raises(ValueError, match="from other machines: set zmq_secret_file"):
            prepare_address(reachable)
        assert prepare_address(reachable, secured=True) == reachable
    for loopback in ("tcp://localhost:5555", "tcp://127.0.0.2:5555", "tcp://[::1]:5555"):
        assert prepare_address(loopback) == loopback
    with pytest.raises(ValueError, match="not a ZeroMQ address"):
        prepare_address("http://localhost:80")


def free_tcp_address() -> str:
    """A loopback TCP address that nothing listens on (yet)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def write_secret(path: Path) -> str:
    """A new random ZeroMQ secret in ``path``; its path."""
    path.write_text(secrets.token_urlsafe(32) + "\n")
    return str(path)


def peer(address: str, secret_file: str | None) -> zmq.Socket:
    """A bare DEALER socket to ``address``, a CURVE client with the keys of ``secret_file`` (if any).

    Its sends give up after a second: a DEALER with no connection blocks on send, and a peer whose handshake the
    backend refuses is between connections most of the time.
    """
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDTIMEO, 1000)
    secure_client(dealer, load_keys(secret_file))
    dealer.connect(address)
    return dealer


@pytest.fixture(scope="module")
def secured_backend(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A backend on loopback TCP that requires a ZeroMQ secret: its address and the secret's file."""
    secret_file = write_secret(tmp_path_factory.mktemp("secret") / "zmq.secret")
    process, address = start_backend(tiny_config(tiny_llm_dir, zmq_secret_file=secret_file), free_tcp_address())
    yield address, secret_file
    process.terminate()
    assert process.wait(30) == 0


@pytest.mark.parametrize("secret", ["none", "another", "the backend's"])
def test_a_peer_aborts_only_its_own_requests_and_one_without_the_secret_nothing(secured_backend, tmp_path, secret):
    address, secret_file = secured_backend
    peer_secret = {"none": None, "another": write_secret(tmp_path / "other.secret"), "the backend's": secret_file}
    intruder = peer(address, peer_secret[secret])
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(BackendMessage)
    own = EngineRequest("intruder", [3, 4, 5], SamplingParams(max_tokens=2), time.time())
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    async def scenario(engine):
        victim = engine.generate(prompts_for(1)[0], params, "victim")
        first = await anext(victim)
        for message in (Hello(PROTOCOL_VERSION), Abort(["victim"]), AddRequest(own)):
            try:
                intruder.send(encoder.encode(message))
            except zmq.Again:  # refused before it could even be queued: not heard either way
                assert secret != "the backend's"
        return [first] + [output async for output in victim]

    engine = AsyncLLMEngine.from_args(backend_address=address, zmq_secret_file=secret_file)
    try:
        outputs = asyncio.run(scenario(engine))
    finally:
        engine.shutdown()
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == params.max_tokens  # not aborted
    if secret == "the backend's":  # heard, and served its own request
        assert isinstance(decoder.decode(intruder.recv()), Ready)
        answers = []  # heartbeats may come before the steps of its request
        while not any(isinstance(a, StepOutputs) for a in answers) and intruder.poll(SLACK * 1000):
            answers.append(decoder.decode(intruder.recv()))
        assert any(d.request_id == "intruder" for a in answers if isinstance(a, StepOutputs) for d in a.deltas), answers
    else:  # in all the victim's steps, nothing came back: not even the handshake's answer
        assert not intruder.poll(0)
    intruder.close()


def test_an_oversized_message_is_dropped_and_the_backend_serves_on(tiny_llm_dir):
    process, address = start_backend(tiny_config(tiny_llm_dir, max_message_size=1024))
    sender = peer(address, None)
    decoder = msgspec.msgpack.Decoder(BackendMessage)
    huge_prompt = [200] * 500  # two bytes a token in msgpack: over 1,024 bytes
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    async def scenario(engine):
        with pytest.raises(InvalidRequestError, match="more than the backend's max_message_size of 1024") as refused:
            await anext(engine.generate({"prompt_token_ids": huge_prompt}, SamplingParams(max_tokens=4)))
        assert refused.value.fields == ("prompt",)  # refused here: sent, it would have cut this frontend off
        stream = engine.generate(prompts_for(1)[0], params)
        outputs = [await anext(stream)]
        sender.send(msgspec.msgpack.encode(Hello(PROTOCOL_VERSION)))
        assert isinstance(decoder.decode(sender.recv()), Ready)
        oversized = AddRequest(EngineRequest("oversized", huge_prompt, SamplingParams(max_tokens=1), time.time()))
        sender.send(msgspec.msgpack.encode(oversized))
        return outputs + [output async for output in stream]

    engine = AsyncLLMEngine.from_args(backend_address=address)
    try:
        outputs = asyncio.run(scenario(engine))
        assert len(outputs[-1].outputs[0].token_ids) == params.max_tokens
        assert not sender.poll(0)  # the oversized request was dropped: no output, no refusal
        assert (
            process.poll() is None
            and len(run_engine(address, lambda e: collect(e, prompts_for(1)[0], GREEDY, "after"))) == GREEDY.max_tokens
        )
    finally:
        engine.shutdown()
        sender.close()
        process.terminate()
    assert process.wait(30) == 0


def test_n_completions_all_arrive_through_the_split(backend, tiny_llm_dir):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    expected = LLM(**tiny_config(tiny_llm_dir).settings()).generate(prompts_for(1), params, use_tqdm=False)[0]

    async def scenario(engine):
        outputs = [output async for output in engine.generate(prompts_for(1)[0], params)]
        return outputs[-1]

    final = run_engine(backend, scenario)
    assert final.finished and [c.finish_reason for c in final.outputs] == ["length"] * 3
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in expected.outputs]


def test_the_async_engine_streams_as_output_kind_asks(backend):
    """vLLM's ``output_kind``: deltas that add up to the cumulative stream's last output, or that output alone."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def scenario(engine):
        streams = []
        for kind in RequestOutputKind:
            kind_params = msgspec.structs.replace(params, output_kind=kind)
            streams.append([output async for output in engine.generate(prompts_for(1)[0], kind_params)])
        return streams

    cumulative, delta, final_only = run_engine(backend, scenario)
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5, 6]
    assert sum((o.outputs[0].token_ids for o in delta), []) == cumulative[-1].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in final_only] == [cumulative[-1].outputs[0].token_ids]


def test_finish_reasons_cross_the_split_as_finish_reason_members(backend):
    async def scenario(engine):
        prompt = prompts_for(1)[0]
        tokens = await collect(engine, prompt, GREEDY, "full")
        stop_at = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, stop_token_ids=[tokens[2]])
        finals = []
        for request_id, params in (("length", GREEDY), ("stop", stop_at)):
            async for output in engine.generate(prompt, params, request_id):
                final = output
            finals.append(final.outputs[0])
        return finals

    length, stop = run_engine(backend, scenario)
    # The backend decided both; they crossed the socket as strings and decoded as FinishReason members.
    assert type(length.finish_reason) is FinishReason and length.finish_reason is FinishReason.LENGTH
    assert type(stop.finish_reason) is FinishReason and stop.finish_reason == "stop"
    assert stop.stop_reason in (stop.token_ids[-1], None)  # the stop token, or an eos before it


def test_one_engine_serves_successive_event_loops(backend):
    engine = AsyncLLMEngine.from_args(backend_address=backend)
    try:
        first = asyncio.run(collect(engine, prompts_for(1)[0], GREEDY, "loop1"))
        second = asyncio.run(collect(engine, prompts_for(1)[0], GREEDY, "loop2"))
    finally:
        engine.shutdown()
    assert first == second and len(first) == GREEDY.max_tokens


ENGINES = {
    "LLM": lambda config: LLM(multiprocess=True, **config.settings()),
    "LLMEngine": lambda config: LLMEngine(config, multiprocess=True),
    "AsyncLLMEngine": lambda config: AsyncLLMEngine.from_args(**config.settings()),
}


def backend_process(engine) -> BackendProcess:
    return getattr(engine, "llm_engine", engine).client.connection.process


@pytest.mark.parametrize("make_engine", ENGINES.values(), ids=ENGINES.keys())
def test_stopping_an_engine_removes_its_socket_directory(tiny_llm_dir, private_tmp, make_engine):
    engine = make_engine(tiny_config(tiny_llm_dir))
    process = backend_process(engine)
    assert socket_dirs(private_tmp) == [Path(process.socket_dir)]
    assert (Path(process.socket_dir) / "engine.sock").is_socket()
    engine.shutdown()
    assert process.returncode == 0 and socket_dirs(private_tmp) == []


def test_a_killed_backend_leaves_no_socket_directory(tiny_llm_dir, private_tmp):
    engine = LLMEngine(tiny_config(tiny_llm_dir), multiprocess=True)
    try:
        engine.add_request("r", prompts_for(1)[0], LONG)
        os.kill(backend_process(engine).pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            while True:
                engine.step()
        assert socket_dirs(private_tmp) == []  # gone once the exit was seen, before any shutdown
    finally:
        engine.shutdown()
    assert socket_dirs(private_tmp) == []


EXIT_WITHOUT_SHUTDOWN = """
import json
from spindle import LLM, SamplingParams

llm = LLM({model!r}, multiprocess=True, dtype="float32", kv_cache_memory="4MiB")
llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
process = llm.llm_engine.client.connection.process
print(json.dumps({{"child": process.pid, "socket_dir": process.socket_dir}}), flush=True)
"""


def test_a_frontend_that_exits_without_shutdown_stops_its_backend_and_removes_the_directory(tiny_llm_dir, private_tmp):
    script = EXIT_WITHOUT_SHUTDOWN.format(model=str(tiny_llm_dir))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(done.stdout)
    assert Path(report["socket_dir"]).parent == private_tmp and socket_dirs(private_tmp) == []
    with pytest.raises(ProcessLookupError):  # stopped and reaped at exit, not left to die with its parent
        os.kill(report["child"], 0)


def test_a_backend_on_a_given_socket_removes_the_socket_file_but_not_the_directory(tiny_llm_dir, private_tmp):
    run_dir = private_tmp / "run"
    run_dir.mkdir(mode=0o700)
    process, address = start_backend(tiny_config(tiny_llm_dir), address=f"ipc://{run_dir}/engine.sock")
    assert process.socket_dir is None
    BackendConnection(address).close()  # the handshake: the backend is bound
    assert [p.name for p in run_dir.iterdir()] == ["engine.sock"]
    assert process.stop() == 0
    assert run_dir.is_dir() and list(run_dir.iterdir()) == [] and socket_dirs(private_tmp) == []


EVERY_PROCESS_PATH = """
import asyncio, sys
from spindle import LLM, SamplingParams
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine
from spindle.shared.sampling_params import StructuredOutput

model, tp_model = sys.argv[1:]
engine_args = dict(dtype="float32", kv_cache_memory="4MiB")
# A constrained request starts the grammar compile workers (a spawned pool, with its semaphores).
params = SamplingParams(max_tokens=4, structured_output=StructuredOutput(choice=["yes", "no"]))
for args in (dict(model=model), dict(model=model, multiprocess=True), dict(model=tp_model, tensor_parallel_size=2)):
    llm = LLM(**args, **engine_args)
    print(llm.generate("hi", params, use_tqdm=False)[0].outputs[0].text, flush=True)
    llm.shutdown()
engine = AsyncLLMEngine.from_args(model=model, **engine_args)

async def generate() -> str:
    async for output in engine.generate("hi", params, "request"):
        pass
    return output.outputs[0].text

print(asyncio.run(generate()), flush=True)
engine.shutdown()
"""


def unheld_shm(before: set[Path]) -> set[Path]:
    """The /dev/shm entries made since ``before`` that no live process maps: left behind, not in use.

    Mappings are matched by inode: glibc maps a semaphore under a temporary name that it then renames.
    """
    held: set[int] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # the process ended meanwhile
            continue
        held |= {int(line.split()[4]) for line in lines if " /dev/shm/" in line}
    left = set()
    for path in set(Path("/dev/shm").iterdir()) - before:
        try:
            if path.stat().st_ino not in held:
                left.add(path)
        except FileNotFoundError:  # removed meanwhile
            continue
    return left


def test_the_process_paths_leak_no_semaphore_or_shared_memory(tiny_llm_dir, tiny_tp_llm_dir, private_tmp):
    """In-process, multiprocess, tensor-parallel and async engines, each with grammar compile workers, run and
    shut down under ``-W error``: Python's resource tracker, which warns at exit about semaphores and shared memory
    segments left behind (the warning the seed's docs discuss), finds none, and /dev/shm keeps nothing new that no
    process holds (the other test worker's processes make and drop their own meanwhile)."""
    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.is_dir() else set()
    env = {**os.environ, "PYTHONWARNINGS": "error"}  # reaches the backend and the spawned workers too
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", EVERY_PROCESS_PATH, str(tiny_llm_dir), str(tiny_tp_llm_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=private_tmp,  # not the repository root, whose kernels/ would shadow the PyPI package of that name
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answers = [line.removesuffix("#") for line in done.stdout.split()]  # "#" is the tiny tokenizer's eos
    assert len(answers) == 4 and set(answers) <= {"yes", "no"}, done.stdout
    assert "resource_tracker" not in done.stderr and "leaked" not in done.stderr, done.stderr[-3000:]
    if shm.is_dir():
        wait_until(lambda: not unheld_shm(before), "no /dev/shm entry made meanwhile is left unheld", timeout=SLACK)
