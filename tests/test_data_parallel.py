"""Data-parallel engines behind one frontend: routing by load and prefix affinity, aborts that reach the right
engine, aggregate health and load, and a dead engine whose requests go on on another."""

import argparse
import asyncio
import os
import signal
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_grpc import LONG, ServerThread, callers_id, collect, tiny_config
from test_lora_api import save_adapter
from test_observability import counted_all, scrape, watch
from waiting import wait_until

from spindle.frontend.cli import add_commands, engine_from_args
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine
from spindle.frontend.engine.connection import start_backend
from spindle.frontend.engine.data_parallel import DataParallelClient, device_groups, prefix_hashes
from spindle.frontend.grpc.args import ServerConfig
from spindle.frontend.grpc.server import GrpcServer
from spindle.shared import SamplingParams
from spindle.shared.block_hash import block_hash, root_hash
from spindle.shared.protocol import ImageInput, ListLoras
from spindle.v1 import spindle_pb2

TINY_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "4MiB"]


def serve_args(*flags: str) -> argparse.Namespace:
    """``spindle serve FLAGS`` as the command parses them."""
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


class DataParallelServer(ServerThread):
    """A GrpcServer over the engine that ``spindle serve FLAGS`` builds, on an event loop of its own."""

    def __init__(self, *flags: str) -> None:  # noqa: D107 - the class says it
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> int:
            # Built on the loop's thread, which outlives the backends it starts (their parent-death signal).
            self.engine = engine_from_args(serve_args(*flags))
            self.server = GrpcServer(self.engine, ServerConfig(port=0, metrics_port=0))
            return await self.server.start()

        self.port = self.run(start())
        self.address = f"127.0.0.1:{self.port}"

    def stats(self, index: int):
        """The latest stats of backend ``index``."""
        return self.run(self.engine.client.clients[index].get_stats())


@pytest.fixture(scope="module")
def remote_server(tiny_llm_dir):
    """Two backends of their own, served as ``spindle serve --backend-address A,B``."""
    backends = [start_backend(tiny_config(tiny_llm_dir)) for _ in range(2)]
    server = DataParallelServer("--backend-address", ",".join(address for _, address in backends))
    server.backend_addresses = [address for _, address in backends]
    yield server
    server.close()
    for process, _ in backends:
        process.terminate()
        process.wait(30)


@pytest.fixture(scope="module")
def owned_server(tiny_llm_dir, tmp_path_factory):
    """``spindle serve --data-parallel-size 2``: the server starts both backends, which load adapters at run time
    from a directory holding one, ``sql``."""
    lora_dir = tmp_path_factory.mktemp("adapters")
    save_adapter(tiny_llm_dir, lora_dir / "sql", seed=1)
    lora_flags = ["--allow-runtime-lora", "--lora-dir", str(lora_dir)]
    # Two "GPUs" for the engines to split (torch finds no CUDA here: they still run on the CPU).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
        server = DataParallelServer("--data-parallel-size", "2", "--model", str(tiny_llm_dir), *TINY_FLAGS, *lora_flags)
    yield server
    server.close()


def visible_devices(client) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` that a backend client's process runs with."""
    environ = Path(f"/proc/{client.connection.process.pid}/environ").read_bytes().split(b"\0")
    return next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"CUDA_VISIBLE_DEVICES="))


@pytest.mark.parametrize("fixture", ["remote_server", "owned_server"])
def test_the_engines_serve_as_one(request, fixture):
    server = request.getfixturevalue(fixture)
    engine = server.engine
    assert isinstance(engine.client, DataParallelClient) and len(engine.client.clients) == 2
    with server.client(timeout=30) as client:
        assert client.health() == "SERVING"
        wait_until(lambda: counted_all(server), "the server has what the engines counted")  # after a restart too
        before = scrape(server)
        choices, _ = collect(client.generate([5, 6, 7, 8, 9], temperature=0, max_tokens=4, ignore_eos=True))
        assert len(choices[0]["token_ids"]) == 4

        def moved(name: str, **labels: str) -> float:
            key = (name, tuple(sorted(labels.items())))
            return scrape(server).get(key, 0.0) - before.get(key, 0.0)

        # The engine's counts come with its next stats, a step or a heartbeat after the response.
        wait_until(lambda: moved("spindle:prefix_cache_queries_total") == 5, "the prompt's lookup is counted")
        assert moved("spindle:generation_tokens_total") == 4
        assert moved("spindle:request_success_total", finished_reason="length") == 1
        info = client.server_info()
        assert info.num_total_kv_blocks == sum(c.info.num_kv_blocks for c in engine.client.clients) > 0
        reports = watch(client, seconds=30)
        assert next(reports).kv_cache_usage == 0.0
        reports.cancel()
        embeddings = client.embed(["one", "two", "three"], "batch").embeddings
        assert len(embeddings) == 3 and not any(c.requests for c in engine.client.clients)  # let go once ended


def test_prefix_hashes_cover_full_blocks_each_with_all_before_it():
    prompt = list(range(40))  # two full blocks of 16, and 8 tokens that make no block
    changed = [*prompt[:20], 99, *prompt[21:]]  # the second block differs
    assert len(prefix_hashes(prompt, 16)) == 2
    assert prefix_hashes(prompt, 16)[0] == prefix_hashes(changed, 16)[0]
    assert prefix_hashes(prompt, 16)[1] != prefix_hashes(changed, 16)[1]
    assert prefix_hashes(prompt[:32] + [7], 16) == prefix_hashes(prompt, 16)
    # The digests the backend's prefix cache keys the same blocks by, salt included.
    first = block_hash(root_hash("s"), prompt[:16])
    assert prefix_hashes(prompt, 16, "s") == [first, block_hash(first, prompt[16:32])]
    unsalted = set(prefix_hashes(prompt, 16))
    for other in (prefix_hashes(prompt, 16, "s"), prefix_hashes(prompt, 16, lora_name="sql")):
        assert not set(other) & unsalted  # another cache salt or adapter: another cache
    assert not set(prefix_hashes(prompt, 16, lora_name="sql")) & set(prefix_hashes(prompt, 16, lora_name="chat"))
    # An image whose tokens start in the second block: the first is shared, the second differs with the image.
    pixels = np.zeros((3, 2, 2), dtype=np.float32)
    image, other = ImageInput.from_pixels(pixels, 20, 12), ImageInput.from_pixels(pixels + 1, 20, 12)
    with_image, with_other = prefix_hashes(prompt, 16, images=[image]), prefix_hashes(prompt, 16, images=[other])
    assert with_image[0] == with_other[0] == prefix_hashes(prompt, 16)[0]
    assert len({with_image[1], with_other[1], prefix_hashes(prompt, 16)[1]}) == 3
    assert prefix_hashes(prompt, 16, images=[ImageInput.from_pixels(pixels, 20, 12)]) == with_image
    assert with_image[1] == block_hash(with_image[0], prompt[16:32], image.content_hash)


def test_each_engine_gets_its_own_gpus_or_they_share_too_few(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert device_groups(2, 2) == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert device_groups(3, 2) == [{}, {}, {}]


def test_a_size_other_than_the_number_of_addresses_is_refused():
    with pytest.raises(ValueError, match="one address per engine"):
        engine_from_args(serve_args("--backend-address", "tcp://a:1,tcp://b:1", "--data-parallel-size", "3"))


def test_64_concurrent_streams_equal_a_single_engines_greedy_output(remote_server):
    engine = remote_server.engine
    prompts = [f"Story {i}: once upon a time" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12)

    async def final_text(target, prompt: str) -> str:
        async for output in target.generate(prompt, params):
            last = output
        return last.outputs[0].text

    async def scenario():
        single = AsyncLLMEngine.from_args(backend_address=remote_server.backend_addresses[0])
        try:
            expected = [await final_text(single, prompt) for prompt in prompts]
        finally:
            single.shutdown()
        clients = engine.client.clients
        before = [(await c.get_stats()).num_prefix_cache_queries for c in clients]
        texts = await asyncio.gather(*(final_text(engine, prompts[i % 8]) for i in range(64)))
        after = [(await c.get_stats()).num_prefix_cache_queries for c in clients]
        return expected, texts, before, after

    expected, texts, before, after = remote_server.run(scenario())
    assert texts == [expected[i % 8] for i in range(64)]
    assert all(later > earlier for earlier, later in zip(before, after, strict=True))  # both engines served


def test_requests_sharing_a_long_prefix_land_on_one_engine(remote_server):
    prefix = [3 + (7 * i) % 250 for i in range(64)]  # four full blocks of 16 tokens
    before = [remote_server.stats(i).num_prefix_cache_hits for i in range(2)]
    with remote_server.client(timeout=30) as client:
        for k in range(4):
            collect(client.generate(prefix + [5 + k, 9 + k], temperature=0, max_tokens=2))
    grown = sorted(remote_server.stats(i).num_prefix_cache_hits - before[i] for i in range(2))
    assert grown[0] == 0 and grown[1] >= 3 * 64


def engine_id(engine: AsyncLLMEngine, request_id: str) -> str:
    """The engine's id of the request in flight a client named ``request_id`` (scoped to the client's connection)."""
    [scoped] = [rid for rid in engine.queues if callers_id(rid) == request_id]
    return scoped


@pytest.mark.parametrize("how", ["abort", "cancel"])
def test_abort_and_cancel_reach_the_engine_that_runs_the_request(remote_server, how):
    engine = remote_server.engine
    # Routing goes by load: what an earlier test left running (its stream cancelled as its channel closed) must end.
    wait_until(lambda: not any(c.load() for c in engine.client.clients), "both engines are idle")
    with remote_server.client(timeout=30) as client:
        streams = []
        for name in ("a", "b"):  # one after the other: the second is routed once the first counts as load
            streams.append(client.generate(f"run {name}", request_id=f"{how}-{name}", **LONG))
            next(streams[-1])
        clients = engine.client.clients
        ending, going_on = (
            clients.index(engine.client.client_of(engine_id(engine, f"{how}-{name}"))) for name in ("a", "b")
        )
        assert ending != going_on  # the least loaded engine took the second one
        if how == "abort":
            assert client.abort(f"{how}-a")
            choices, _ = collect(streams[0])
            assert choices[0]["finish"] == [(spindle_pb2.FINISH_REASON_ABORT, None)]
        else:
            streams[0].cancel()
            with pytest.raises(grpc.RpcError) as error:
                list(streams[0])
            assert error.value.code() == grpc.StatusCode.CANCELLED

        def freed() -> bool:
            stats = remote_server.stats(ending)
            return stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks

        wait_until(freed, "the aborted request's blocks are freed")
        # The other engine's request runs on to its length (checked at its end: it may already be done by now).
        choices, _ = collect(streams[1])
        assert choices[0]["finish"] == [(spindle_pb2.FINISH_REASON_LENGTH, None)]


def adapter_names(server: DataParallelServer, index: int) -> list[str]:
    return [adapter.name for adapter in server.run(server.engine.client.clients[index].call(ListLoras()))]


def test_a_dead_engines_streams_go_on_on_another_and_it_comes_back_with_the_adapters(owned_server):
    engine = owned_server.engine
    with owned_server.client(timeout=30) as client:
        client.load_lora_adapter("sql", "sql")
        assert adapter_names(owned_server, 0) == adapter_names(owned_server, 1) == ["sql"]
        doomed = client.generate("doomed", request_id="doomed", **LONG)
        spared = client.generate("spared", request_id="spared", **LONG)
        next(doomed), next(spared)
        victim = engine.client.client_of(engine_id(engine, "doomed"))
        assert victim is not engine.client.client_of(engine_id(engine, "spared"))
        assert sorted(visible_devices(c) for c in engine.client.clients) == ["0", "1"]  # a GPU each
        devices = visible_devices(victim)
        os.kill(victim.connection.process.pid, signal.SIGKILL)
        wait_until(lambda: victim.is_dead, "the engine's death is seen")  # a restart takes seconds
        assert client.health() == "SERVING"
        choices, _ = collect(client.generate("while one is down", temperature=0, max_tokens=4))
        assert len(choices[0]["token_ids"]) == 4
        for stream in (doomed, spared):  # to its end: the doomed one resumed on the other engine (test_resume)
            choices, _ = collect(stream)
            assert choices[0]["finish"] == [(spindle_pb2.FINISH_REASON_LENGTH, None)]
        assert engine.num_resumed_requests == 1
        wait_until(lambda: not victim.is_dead, "the dead engine's backend is restarted")
        assert client.health() == "SERVING" and engine.num_backend_restarts == 1
        assert visible_devices(victim) == devices  # the new backend runs on the dead one's GPU
        # The new backend got the adapter loaded at run time again, and requests naming it run anywhere.
        wait_until(lambda: "sql" in adapter_names(owned_server, engine.client.clients.index(victim)), "it is reloaded")
        collect(client.generate("with the adapter", lora_name="sql", temperature=0, max_tokens=2))
        client.unload_lora_adapter("sql")
        assert adapter_names(owned_server, 0) == adapter_names(owned_server, 1) == []
