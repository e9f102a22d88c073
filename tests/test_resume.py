"""Streams that outlive their backend: a request in flight on a backend that dies is sent again, as its prompt and
the tokens it streamed, and its stream goes on as it would have (owned, remote and data-parallel backends), up to
``max_stream_resumes`` times; with ``resume_streams`` off it fails as before. And the engine core's side: a resumed
request continues exactly where it was."""

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import msgspec
import numpy as np
import pytest
from test_grpc import LONG, ServerThread, callers_id, tiny_config
from test_observability import scrape
from test_process_split import private_tmp  # noqa: F401 - a fixture: short ipc paths, cleaned up
from waiting import wait_until, wait_until_async

from spindle import SamplingParams
from spindle.backend.engine_core import EngineCore
from spindle.frontend.engine.async_client import AsyncBackendClient
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine
from spindle.frontend.engine.connection import start_backend
from spindle.shared.errors import InvalidRequestError
from spindle.shared.pooling_params import PoolingParams
from spindle.shared.protocol import EngineRequest, ResumedCompletion
from spindle.shared.sampling_params import StructuredOutput

PROMPT = [5, 6, 7, 8, 9, 10, 11]
STREAMED = 8  # tokens each running completion streams before its backend is killed


def run_core(core: EngineCore, request: EngineRequest) -> dict[int, list[int]]:
    """Every token the engine core generates for ``request``, by completion index."""
    core.add_request(request)
    tokens: dict[int, list[int]] = {}
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens.setdefault(delta.index, []).extend(delta.new_token_ids)
    assert not core.pop_refused()
    return tokens


@pytest.fixture(scope="module")
def core(tiny_llm_dir: Path) -> EngineCore:
    return EngineCore(tiny_config(tiny_llm_dir))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1, seed=7, n=2, max_tokens=24, ignore_eos=True),
        # Penalties count the output so far, and min_tokens holds eos back until the output has that many.
        SamplingParams(temperature=1, seed=3, max_tokens=24, min_tokens=20, repetition_penalty=1.5,
                       presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=1, seed=3, max_tokens=24, structured_output=StructuredOutput(regex="[a-e]{16}")),
        SamplingParams(temperature=0, max_tokens=24, num_speculative_tokens=3, ignore_eos=True),
    ],
    ids=["greedy", "seeded-n2", "penalties-min-tokens", "grammar", "speculative"],
)  # fmt: skip
def test_the_engine_core_continues_a_resumed_request_as_it_would_have(core, params):
    whole = run_core(core, EngineRequest("whole", PROMPT, params, time.time()))
    resumed = [ResumedCompletion(index, tokens[:6]) for index, tokens in whole.items()]
    rest = run_core(core, EngineRequest("resumed", PROMPT, params, time.time(), resumed=resumed))
    assert {index: tokens[:6] + rest[index] for index, tokens in whole.items()} == whole
    assert all(len(tokens) > 6 for tokens in whole.values())  # each had more to generate


def test_a_resumed_request_runs_only_the_completions_it_lists(core):
    params = SamplingParams(temperature=1, seed=9, n=3, max_tokens=12, ignore_eos=True)
    whole = run_core(core, EngineRequest("all", PROMPT, params, time.time()))
    rest = run_core(core, EngineRequest("one", PROMPT, params, time.time(), resumed=[ResumedCompletion(2, [])]))
    assert rest == {2: whole[2]}


@pytest.mark.parametrize(
    "resumed,pooling,field,message",
    [
        ([ResumedCompletion(0, [])], PoolingParams(), "resumed", "an embedding request is sent again whole"),
        ([], None, "resumed", "each unfinished completion once, of range(2): []"),
        ([ResumedCompletion(1, []), ResumedCompletion(1, [])], None, "resumed", "range(2): [1, 1]"),
        ([ResumedCompletion(2, [])], None, "resumed", "range(2): [2]"),
        ([ResumedCompletion(0, []), ResumedCompletion(1, [9] * 4)], None, "resumed[1].token_ids", "reached max_tokens"),
    ],
    ids=["embedding", "none", "twice", "out-of-range", "nothing-left"],
)
def test_a_resumed_request_that_does_not_fit_is_refused(core, resumed, pooling, field, message):
    params = SamplingParams(n=1 if pooling else 2, max_tokens=4)
    request = EngineRequest("bad", PROMPT, params, time.time(), pooling=pooling, resumed=resumed)
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as error:
        core.add_request(request)
    assert error.value.field == field and not core.has_request("bad")


@dataclasses.dataclass
class Streamed:
    """What a stream gave so far: each completion's tokens, and which completions ended."""

    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    ended: set[int] = dataclasses.field(default_factory=set)


async def stream(engine: AsyncLLMEngine, request_id: str, params: SamplingParams, seen: Streamed) -> Streamed:
    """Stream a request to its end, gathering what it gives in ``seen`` as it comes."""
    async for output in engine.generate({"prompt_token_ids": PROMPT}, params, request_id, delta=True):
        for completion in output.outputs:
            seen.tokens.setdefault(completion.index, []).extend(completion.token_ids)
            if completion.finish_reason is not None:
                seen.ended.add(completion.index)
    return seen


def early_stop(pair: Streamed) -> int:
    """A token that ends completion 0 of ``pair`` within its first tokens, and completion 1 much later or never."""

    def first_use(token: int) -> int:
        second = pair.tokens[1]
        return second.index(token) if token in second else len(second)

    token = max(pair.tokens[0][1:5], key=first_use)
    assert first_use(token) >= 10 * STREAMED, "pick another seed for PAIR: its completions share their tokens"
    return token


GREEDY = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=300, ignore_eos=True)
PAIR = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=300, ignore_eos=True)

Kill = Callable[[AsyncBackendClient], None]


@contextlib.contextmanager
def owned_engine(model_dir: Path, tmp: Path, size: int) -> Iterator[tuple[AsyncLLMEngine, Kill]]:
    """An engine of ``size`` backends it started; killing one has it start another."""
    engine = AsyncLLMEngine.from_args(data_parallel_size=size, **tiny_config(model_dir).settings())
    try:
        yield engine, lambda client: os.kill(client.connection.process.pid, signal.SIGKILL)
    finally:
        engine.shutdown()


@contextlib.contextmanager
def remote_engine(model_dir: Path, tmp: Path) -> Iterator[tuple[AsyncLLMEngine, Kill]]:
    """An engine of a backend at an address; killing it starts another there, as its container's restart would."""
    address = f"ipc://{tmp}/run/engine.sock"
    backends = [start_backend(tiny_config(model_dir), address)[0]]

    def kill(client: AsyncBackendClient) -> None:
        backends[-1].kill()
        backends[-1].wait()
        backends.append(start_backend(tiny_config(model_dir), address)[0])

    engine = AsyncLLMEngine.from_args(backend_address=address)
    try:
        yield engine, kill
    finally:
        engine.shutdown()
        for backend in backends:
            backend.kill()
            backend.wait()


ENGINES = {
    "owned": lambda model_dir, tmp: owned_engine(model_dir, tmp, 1),
    "remote": remote_engine,
    "data-parallel": lambda model_dir, tmp: owned_engine(model_dir, tmp, 2),
}


@pytest.mark.parametrize("kind", ENGINES)
def test_streams_resume_token_for_token_when_their_backend_is_killed(tiny_llm_dir, private_tmp, kind):  # noqa: F811
    with ENGINES[kind](tiny_llm_dir, private_tmp) as (engine, kill):

        async def scenario() -> None:
            pair = await stream(engine, "pair-probe", PAIR, Streamed())
            requests = {
                "greedy": GREEDY,
                "seeded": SEEDED,
                "pair": msgspec.structs.replace(PAIR, stop_token_ids=[early_stop(pair)]),
            }
            undisturbed = {name: await stream(engine, name, params, Streamed()) for name, params in requests.items()}
            assert undisturbed["pair"].ended == {0, 1} and len(undisturbed["pair"].tokens[0]) <= 5
            seen = {name: Streamed() for name in requests}
            tasks = [
                asyncio.create_task(stream(engine, f"{name}-resumed", params, seen[name]))
                for name, params in requests.items()
            ]

            async def streaming() -> bool:
                running = [(s, i) for s in seen.values() for i in s.tokens if i not in s.ended]
                return seen["pair"].ended == {0} and all(len(s.tokens[i]) >= STREAMED for s, i in running)

            await wait_until_async(streaming, "every stream has tokens, and the pair's first completion ended")
            clients = getattr(engine.client, "clients", [engine.client])
            victim = next(c for c in clients if "greedy-resumed" in c.requests)
            lost = len(victim.requests)
            kill(victim)
            assert await asyncio.gather(*tasks) == list(undisturbed.values())
            assert engine.num_resumed_requests == lost and engine.num_resume_failures == 0
            await wait_until_async(lambda: asyncio.sleep(0, not victim.is_dead), "the killed backend is replaced")
            assert engine.num_backend_restarts == 1

        asyncio.run(scenario())


@pytest.fixture
def make_server(tiny_llm_dir, private_tmp, monkeypatch) -> Iterator[Callable[..., ServerThread]]:  # noqa: F811
    """``make_server(**recovery)``: a gRPC server with metrics over an engine that starts its own tiny backend."""
    servers = []

    def make(**recovery: object) -> ServerThread:
        monkeypatch.setattr(
            "spindle.frontend.engine.async_llm_engine.EngineConfig",
            SimpleNamespace(of=lambda **kwargs: tiny_config(tiny_llm_dir, **kwargs, **recovery)),
        )
        servers.append(ServerThread(None, metrics_port=0))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.mark.parametrize(
    "recovery,kills,resumed,failed,message",
    [
        ({"resume_streams": False}, 1, 0, 0, "backend is down (the backend process exited"),
        ({"max_stream_resumes": 1}, 2, 1, 1, "; not resumed again (max_stream_resumes=1)"),
    ],
    ids=["resumption-off", "resumes-exhausted"],
)
def test_a_stream_fails_when_resumption_is_off_or_exhausted(make_server, recovery, kills, resumed, failed, message):
    server = make_server(**recovery)
    engine = server.engine
    with server.client(timeout=60) as client:
        doomed = client.generate("doomed", request_id="doomed", **LONG)
        next(doomed)
        for kill in range(kills):
            # The second kill waits for the resumed request to run on the new backend.
            wait_until(lambda kill=kill: engine.num_resumed_requests == kill, f"the request was resumed {kill} times")
            # The server scopes the client's id to its connection: "<caller>-doomed".
            wait_until(lambda: "doomed" in map(callers_id, engine.client.requests), "the request runs in a backend")
            os.kill(engine.client.connection.process.pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as error:
            list(doomed)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and message in error.value.details()
        metrics = scrape(server)
        assert metrics["spindle:request_resumptions_total", ()] == engine.num_resumed_requests == resumed
        assert metrics["spindle:request_resume_failures_total", ()] == engine.num_resume_failures == failed


def test_an_embedding_batch_is_sent_again_whole(tiny_llm_dir, private_tmp):  # noqa: F811
    with owned_engine(tiny_llm_dir, private_tmp, 1) as (engine, kill):

        async def scenario() -> None:
            prompts = [{"prompt_token_ids": [3 + i, *PROMPT]} for i in range(4)]
            expected = await engine.embed(prompts)
            backend = engine.client.connection.process.pid
            os.kill(backend, signal.SIGSTOP)  # so that it dies with the batch in flight, whatever the machine's pace
            batch = asyncio.create_task(engine.embed(prompts, request_id="batch"))
            await wait_until_async(lambda: asyncio.sleep(0, len(engine.client.requests) == 4), "the batch is sent")
            kill(engine.client)
            outputs = await batch
            embeddings = [[o.outputs.embedding for o in batch] for batch in (outputs, expected)]
            np.testing.assert_allclose(*embeddings, rtol=1e-5, atol=1e-6)
            assert engine.num_resumed_requests == 4

        asyncio.run(scenario())
