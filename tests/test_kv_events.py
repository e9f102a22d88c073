"""VllmEngine's KV cache events (SubscribeKvEvents), FlushCache, Embed and GetModelInfo over a real backend.

The server here starts its own backend, as ``spindle serve`` does, so that a test can kill it and watch a new one take
over. Subscribers use the generated stubs of ``smg-grpc-proto``, as a gateway does.
"""

import asyncio
import os
import random
import signal
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from test_data_parallel import DataParallelServer
from test_grpc import ServerThread, tiny_config
from test_lora_api import save_adapter
from waiting import wait_until

from spindle import LoRARequest, SamplingParams
from spindle.frontend.engine.connection import start_backend
from spindle.frontend.engine.kv_events import KvEventHub, KvSubscriberTooSlowError
from spindle.frontend.grpc.vllm_servicer import KV_EPOCH_METADATA
from spindle.shared.protocol import KvBlockRemoved, KvBlockStored, KvCacheCleared
from spindle.v1 import spindle_pb2, spindle_pb2_grpc

BLOCK = 16  # the default block size
VOCAB = 256  # the tiny model's
RECOVERY = 45.0  # a restart waits 1 s, then the tiny model loads in a few seconds


@pytest.fixture(scope="module")
def server(tiny_llm_dir) -> Iterator[ServerThread]:
    """A server whose engine started its own backend child, with room for three event subscribers."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            "spindle.frontend.engine.async_llm_engine.EngineConfig",
            # 128 blocks: a few dozen prompts fill it.
            SimpleNamespace(of=lambda **kwargs: tiny_config(tiny_llm_dir, **kwargs, kv_cache_memory="1MiB")),
        )
        server = ServerThread(None, max_watchers=3)
    yield server
    server.close()


@pytest.fixture(scope="module")
def vllm(server) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


class Subscriber:
    """A ``SubscribeKvEvents`` stream read in a thread: its batches as they come, and the blocks they leave live."""

    def __init__(self, vllm, start: int = 0, loads_first: bool = False) -> None:
        request = common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start, load_records_before_first_batch=loads_first
        )
        self.stream = vllm.SubscribeKvEvents(request, timeout=300)
        self.epoch = dict(self.stream.initial_metadata()).get(KV_EPOCH_METADATA)
        self.batches: list[common_pb2.KvEventBatch] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for batch in self.stream:
                self.batches.append(batch)
        except grpc.RpcError as error:
            self.error = error

    def event_batches(self) -> list[common_pb2.KvEventBatch]:
        """The batches that are not ``load_only`` records."""
        return [batch for batch in list(self.batches) if not batch.load.load_only]

    def events(self, since: int = 0) -> list[common_pb2.KvCacheEvent]:
        return [event for batch in self.event_batches() if batch.sequence_number > since for event in batch.events]

    def last(self) -> int:
        return max((batch.sequence_number for batch in self.event_batches()), default=0)

    def live(self) -> dict[int, common_pb2.KvBlock]:
        """The blocks stored and not removed since the last clear, by hash."""
        live: dict[int, common_pb2.KvBlock] = {}
        for event in self.events():
            match event.WhichOneof("data"):
                case "stored":
                    live.update((block.block_hash, block) for block in event.stored.blocks)
                case "removed":
                    for block_hash in event.removed.block_hashes:
                        live.pop(block_hash, None)
                case "cleared":
                    live.clear()
        return live

    def close(self) -> None:
        self.stream.cancel()
        self.thread.join(10)


@pytest.fixture
def subscriber(vllm) -> Iterator[Subscriber]:
    subscriber = Subscriber(vllm)
    yield subscriber
    subscriber.close()


def generate(vllm, prompt: list[int]) -> pb.GenerateComplete:
    """One greedy token after ``prompt``: the completion message (its ``cached_tokens``)."""
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=1)
    request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=prompt), sampling_params=sampling)
    (response,) = list(vllm.Generate(request, timeout=60))
    return response.complete


def prompt(seed: int, blocks: int) -> list[int]:
    """``blocks`` full blocks of tokens drawn with ``seed``, and one token more (the last is always computed)."""
    return random.Random(seed).choices(range(VOCAB), k=blocks * BLOCK + 1)


StoredBlock = tuple[common_pb2.KvBlocksStored, common_pb2.KvBlock]


def stored_blocks(events: list[common_pb2.KvCacheEvent]) -> list[StoredBlock]:
    return [(event.stored, block) for event in events if event.HasField("stored") for block in event.stored.blocks]


def wait_stored(
    subscriber: Subscriber, tokens: list[int]
) -> list[tuple[common_pb2.KvBlocksStored, common_pb2.KvBlock]]:
    """The stored events of the full blocks of ``tokens``, once the subscriber has them all."""
    chunks = [tokens[start : start + BLOCK] for start in range(0, len(tokens) - BLOCK + 1, BLOCK)]

    def stored() -> list | None:
        blocks = [(s, b) for s, b in stored_blocks(subscriber.events()) if list(b.token_ids) in chunks]
        return blocks if len(blocks) == len(chunks) else None

    return wait_until(stored, "the prompt's blocks are stored")


def test_a_prompt_stores_its_blocks_chained_with_its_tokens(vllm, subscriber, server):
    tokens = prompt(1000, 3)
    generate(vllm, tokens)
    blocks = wait_stored(subscriber, tokens)
    assert [list(block.token_ids) for _, block in blocks] == [tokens[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]
    parents = [stored.parent_block_hash if stored.HasField("parent_block_hash") else None for stored, _ in blocks]
    assert parents == [None, blocks[0][1].block_hash, blocks[1][1].block_hash]
    for stored, block in blocks:
        assert block.block_size == BLOCK and not block.HasField("lora_id") and not stored.HasField("lora_name")
        assert (stored.tier, stored.medium) == (common_pb2.KV_CACHE_TIER_DEVICE, server.engine.info.kv_medium)
        assert stored.locality == common_pb2.KV_CACHE_LOCALITY_LOCAL
    batches = subscriber.event_batches()
    assert all(batch.dp_rank == 0 and batch.HasField("load") for batch in batches)
    numbers = [batch.sequence_number for batch in batches if not batch.HasField("snapshot")]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    ids = [event.event_id for batch in batches if not batch.HasField("snapshot") for event in batch.events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids) and 0 not in ids


def test_an_adapters_blocks_name_it(server, subscriber, tiny_llm_dir, tmp_path):
    save_adapter(tiny_llm_dir, tmp_path / "sql", seed=1)
    tokens = prompt(1500, 2)
    params = SamplingParams(temperature=0, max_tokens=1)

    async def run() -> None:
        async for _ in server.engine.generate({"prompt_token_ids": tokens}, params, lora_request=adapter):
            pass

    adapter = LoRARequest("sql", 1, str(tmp_path / "sql"))
    server.run(run())
    blocks = wait_stored(subscriber, tokens)
    assert {(stored.lora_name, block.HasField("lora_id")) for stored, block in blocks} == {("sql", True)}
    assert len({block.lora_id for _, block in blocks}) == 1


def test_eviction_removes_exactly_the_reused_blocks(vllm, subscriber, server):
    first = prompt(2000, 2)
    generate(vllm, first)
    hashes = {block.block_hash for _, block in wait_stored(subscriber, first)}
    total = server.engine.info.num_kv_blocks
    for seed in range(3000, 3000 + 2 * total // 8):  # twice the cache in 8-block prompts: every old block is reused
        generate(vllm, prompt(seed, 8))
    removed = wait_until(
        lambda: (gone := {h for e in subscriber.events() for h in e.removed.block_hashes}) >= hashes and gone,
        "the first prompt's blocks are removed",
    )
    stored = {block.block_hash for _, block in stored_blocks(subscriber.events())}
    assert removed <= stored  # every removed hash was stored before
    assert len(subscriber.live()) <= total
    assert generate(vllm, first).cached_tokens == 0  # they really are gone


def test_flush_cache_clears_and_the_next_prompt_finds_nothing(vllm, subscriber):
    tokens = prompt(5000, 2)
    generate(vllm, tokens)
    assert generate(vllm, tokens).cached_tokens == 2 * BLOCK
    busy = vllm.Generate(
        pb.GenerateRequest(
            tokenized=pb.TokenizedInput(input_ids=tokens),
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
            stream=True,
        ),
        timeout=60,
    )
    next(busy)
    refused = vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0), timeout=30)
    assert not refused.success and "in flight" in refused.message
    busy.cancel()
    flushed = vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=30)
    assert flushed.success, flushed.message
    wait_until(lambda: subscriber.events() and subscriber.events()[-1].HasField("cleared"), "a clear is streamed")
    assert subscriber.live() == {}
    assert generate(vllm, tokens).cached_tokens == 0


def test_a_resumed_subscription_has_no_gap_and_no_duplicate(vllm, subscriber):
    generate(vllm, prompt(6000, 2))
    wait_until(lambda: subscriber.last() > 0, "a batch")
    first = Subscriber(vllm, start=subscriber.last())
    cursor = subscriber.last()
    first.close()
    generate(vllm, prompt(6100, 2))
    generate(vllm, prompt(6200, 2))
    wait_until(lambda: subscriber.last() >= cursor + 2, "two more batches")
    resumed = Subscriber(vllm, start=cursor)
    try:
        wait_until(lambda: resumed.last() >= subscriber.last(), "the resumed stream catches up")
        numbers = [batch.sequence_number for batch in resumed.event_batches()]
        assert numbers == list(range(cursor + 1, resumed.last() + 1))  # no gap, no duplicate, nothing before
        assert not any(batch.HasField("snapshot") for batch in resumed.event_batches())
        assert resumed.events() == subscriber.events(since=cursor)[: len(resumed.events())]
    finally:
        resumed.close()


def test_a_subscription_from_zero_gets_a_snapshot_of_the_live_blocks(vllm, subscriber):
    for start in (7000, 7100):
        generate(vllm, prompt(start, 3))
    wait_until(lambda: len(subscriber.live()) >= 6, "the blocks are stored")
    late = Subscriber(vllm)
    try:
        wait_until(lambda: late.event_batches(), "the snapshot")
        snapshot = [batch for batch in late.event_batches() if batch.HasField("snapshot")]
        assert [chunk.snapshot.index for chunk in snapshot] == [0] and snapshot[0].snapshot.count == 1
        events = snapshot[0].events
        assert events[0].HasField("cleared") and all(event.event_id == 0 for event in events)
        seen = set()
        for stored, block in stored_blocks(events[1:]):
            if stored.HasField("parent_block_hash") and stored.parent_block_hash in late.live():
                assert stored.parent_block_hash in seen  # parents before children
            seen.add(block.block_hash)
        assert snapshot[0].snapshot.blocks == len(seen)
        wait_until(lambda: late.last() >= subscriber.last(), "the late stream catches up")
        assert late.live() == subscriber.live()
    finally:
        late.close()


def test_load_records_come_on_the_stream_and_while_idle(vllm, server):
    early = Subscriber(vllm, loads_first=True)
    try:
        records = wait_until(lambda: [b for b in list(early.batches) if b.load.load_only][:2] or None, "heartbeats")
        assert all(batch.HasField("load") and not batch.events for batch in records)
        generate(vllm, prompt(8000, 1))
        wait_until(lambda: early.event_batches(), "a batch with events")
        batch = early.event_batches()[-1]
        assert batch.HasField("load") and not batch.load.load_only and 0 <= batch.load.token_usage <= 1
        idle = wait_until(
            lambda: [b for b in list(early.batches) if b.load.load_only and b.sequence_number >= early.last()] or None,
            "a heartbeat after the batch",
        )
        assert idle[-1].sequence_number == early.last()  # a load record repeats the last number
        samples = [b.load.sample for b in list(early.batches)]
        assert samples == sorted(samples) and len(set(samples)) == len(samples)
        assert idle[-1].load.max_total_num_tokens == server.engine.info.num_kv_blocks * BLOCK
    finally:
        early.close()


def test_a_load_change_without_events_is_pushed_at_once(vllm, monkeypatch):
    monkeypatch.setattr("spindle.frontend.grpc.vllm_servicer.KV_LOAD_INTERVAL", 1000.0)  # no heartbeat in this test
    subscriber = Subscriber(vllm, loads_first=True)
    try:
        wait_until(lambda: subscriber.batches or None, "the first record")
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        request = pb.GenerateRequest(
            tokenized=pb.TokenizedInput(input_ids=prompt(11_000, 1)), sampling_params=sampling, stream=True
        )
        busy = vllm.Generate(request, timeout=60)
        next(busy)
        wait_until(lambda: any(b.load.running_requests == 1 for b in list(subscriber.batches)) or None, "running")
        seen = len(subscriber.batches)
        busy.cancel()  # its blocks stay cached: no event tells of it
        ended = wait_until(
            lambda: (
                [b for b in list(subscriber.batches)[seen:] if b.load.load_only and not b.load.running_requests] or None
            ),
            "a load record without the request",
            timeout=10,
        )
        assert ended[0].sequence_number == subscriber.last() and not ended[0].events
    finally:
        subscriber.close()


def test_subscribers_are_bounded_by_max_watchers(vllm):
    subscribers = [Subscriber(vllm) for _ in range(3)]
    try:
        extra = Subscriber(vllm)
        extra.thread.join(10)
        assert extra.error is not None and extra.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for subscriber in subscribers:
            subscriber.close()


def test_embed_equals_spindle_embed(vllm, server):
    tokens = [5, 17, 99, 3, 42, 8]
    response = vllm.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=tokens)), timeout=60)
    with grpc.insecure_channel(server.address) as channel:
        spindle = spindle_pb2_grpc.SpindleServiceStub(channel)
        prompt_message = spindle_pb2.Prompt(token_ids=spindle_pb2.TokenIds(ids=tokens))
        expected = spindle.Embed(spindle_pb2.EmbedRequest(inputs=[prompt_message]), timeout=60).embeddings[0]
    assert list(response.embedding) == pytest.approx(list(expected.values), abs=1e-6)
    assert (response.prompt_tokens, response.embedding_dim) == (len(tokens), len(expected.values))
    with pytest.raises(grpc.RpcError) as empty:
        vllm.Embed(pb.EmbedRequest(), timeout=10)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_info_names_the_architectures(vllm, tiny_llm_dir):
    import json

    architectures = json.loads((tiny_llm_dir / "config.json").read_text())["architectures"]
    assert list(vllm.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).architectures) == architectures


def test_a_backend_restart_clears_and_changes_the_epoch(vllm, server, subscriber):
    generate(vllm, prompt(9000, 2))
    wait_until(lambda: subscriber.live(), "blocks are stored")
    cursor = subscriber.last()
    engine = server.engine
    old = engine.client.connection.process.pid
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: engine.num_backend_restarts == 1 and not engine.is_dead, "a new backend", timeout=RECOVERY)
    cleared = wait_until(
        lambda: [
            b for b in subscriber.event_batches() if b.sequence_number > cursor and b.events[0].HasField("cleared")
        ],
        "a clear for the rank",
    )
    assert cleared[0].dp_rank == 0 and subscriber.error is None  # the stream goes on
    wait_until(lambda: not subscriber.live() or None, "nothing live after the restart")
    after = Subscriber(vllm, start=subscriber.last())
    try:
        assert after.epoch != subscriber.epoch
    finally:
        after.close()
    generate(vllm, prompt(9100, 1))
    wait_until(lambda: len(subscriber.live()) == 1, "the new backend's blocks stream on")


def test_data_parallel_backends_send_their_events_under_their_rank(tiny_llm_dir):
    backends = [start_backend(tiny_config(tiny_llm_dir)) for _ in range(2)]
    server = DataParallelServer("--backend-address", ",".join(address for _, address in backends))
    try:
        with grpc.insecure_channel(server.address) as channel:
            vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            subscriber = Subscriber(vllm)
            # Each backend's subscription starts with a clear, under its rank.
            wait_until(lambda: {batch.dp_rank for batch in subscriber.event_batches()} == {0, 1} or None, "both")
            tokens = prompt(10_000, 2)
            generate(vllm, tokens)
            hashes = {block.block_hash for _, block in wait_stored(subscriber, tokens)}
            ranks = {
                batch.dp_rank
                for batch in subscriber.event_batches()
                for _, block in stored_blocks(list(batch.events))
                if block.block_hash in hashes
            }
            assert len(ranks) == 1  # the engine that ran the prompt
            cursor = subscriber.last()
            assert vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=30).success
            cleared = wait_until(
                lambda: (
                    {
                        batch.dp_rank
                        for batch in subscriber.event_batches()
                        if batch.sequence_number > cursor and batch.events[0].HasField("cleared")
                    }
                    == {0, 1}
                    or None
                ),
                "a clear from each engine",
            )
            assert cleared
            subscriber.close()
    finally:
        server.close()
        for process, _ in backends:
            process.terminate()
            process.wait(30)


class FakeClient:
    """What the hub needs of an engine client: a subscription to switch, and each rank's boot id."""

    def __init__(self) -> None:
        self.listener = None

    def subscribe_kv_events(self, listener) -> None:
        self.listener = listener

    def rank_stats(self) -> list:
        return [SimpleNamespace(boot_id="b0")]


def test_the_hub_numbers_keeps_history_and_drops_a_slow_subscriber():
    asyncio.run(hub_scenario())


async def hub_scenario() -> None:
    client = FakeClient()
    hub = KvEventHub(client, history=2, buffer=2)
    subscription, missed = hub.subscribe(0)
    assert missed is None and client.listener == hub.publish  # the backends are subscribed with the first one
    hub.publish(0, [KvBlockStored(1, None, [1, 2])])
    hub.publish(1, [KvBlockStored(2, None, [3, 4]), KvBlockStored(3, 2, [5, 6])])
    assert [batch.sequence for batch in await subscription.next(1)] == [1, 2]
    assert hub.snapshot() == {
        0: [KvBlockStored(1, None, [1, 2])],
        1: [KvBlockStored(2, None, [3, 4]), KvBlockStored(3, 2, [5, 6])],
    }
    hub.publish(1, [KvBlockRemoved(2), KvCacheCleared()])
    assert hub.live[1] == {}
    resumed, missed = hub.subscribe(2)
    assert [batch.sequence for batch in missed] == [3] and missed[0].first_event_id == 4
    for _ in range(3):
        hub.publish(0, [])
    _, too_old = hub.subscribe(3)  # the history of two no longer reaches back to batch 4
    assert too_old is None and hub.subscribe(4)[1] == list(hub.history)
    with pytest.raises(KvSubscriberTooSlowError):
        await resumed.next(1)
    assert resumed not in hub.subscriptions
    for remaining in list(hub.subscriptions):
        hub.unsubscribe(remaining)
    assert client.listener is None  # the last one gone, the backends stop
