"""Observability: Prometheus metrics over HTTP, a trace span per request, WatchLoad, and the counts behind them."""

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from google.protobuf import duration_pb2
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families
from test_grpc import ServerThread, assert_invalid, backend, collect, refusal  # noqa: F401 - backend is a fixture
from waiting import SLACK, wait_until

from spindle import SamplingParams
from spindle.backend.block_manager import BlockManager
from spindle.backend.sequence import Sequence
from spindle.frontend.grpc.metrics import METRICS, LoadTracker
from spindle.frontend.grpc.tracing import RequestTracer
from spindle.shared.protocol import EngineStats
from spindle.v1 import spindle_pb2, spindle_pb2_grpc

HISTOGRAMS = [spec.name for spec in METRICS if spec.kind == "histogram"]
DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "deploy" / "grafana-dashboard.json"


@pytest.fixture(scope="module")
def server(backend):  # noqa: F811 - the fixture imported above
    server = ServerThread(backend, metrics_port=0)
    server.spans = InMemorySpanExporter()
    server.server.servicer.tracer = RequestTracer(server.spans, batch=False)
    yield server
    server.close()


@pytest.fixture
def client(server):
    with server.client(timeout=60) as client:
        yield client


def scrape(server: ServerThread) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics``, by name and labels (the model_name label, and vLLM's engine, left out)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics.port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(("spindle:", "vllm:")) and "model_name" in sample.labels:
                assert sample.labels.pop("model_name") == server.engine.info.model_name, sample
            if sample.name.startswith("vllm:"):
                assert sample.labels.pop("engine", "0") == "0", sample
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def counted_all(server: ServerThread) -> bool:
    """Whether the server's load tracker has the latest stats of every backend, so that a baseline of its metrics
    holds what they counted for requests that ended (another frontend's, say): those come a heartbeat later, or a
    second after a restart."""
    return server.server.servicer.load.stats == server.run(server.engine.get_stats())


def test_metrics_move_by_exactly_what_two_requests_did(server, client):
    wait_until(lambda: counted_all(server), "the server has what the backend counted")
    before = scrape(server)
    # Every metric has samples, but the per-adapter ones, which have none without a request with an adapter.
    names = {spec.sample_name + ("_count" if spec.kind == "histogram" else "") for spec in METRICS}
    names -= {spec.name for spec in METRICS if "lora_name" in spec.labels}
    assert names - {name for name, _ in before} == set()
    # B starts with A's first two blocks (16 tokens each): its lookup finds them in the prefix cache.
    a = [7 + (13 * i) % 240 for i in range(40)]
    b = a[:32] + [3, 4, 5, 6, 9]
    for prompt, max_tokens in ((a, 5), (b, 7)):
        choices, _ = collect(client.generate(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True))
        assert len(choices[0]["token_ids"]) == max_tokens

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # The backend's counts come with its next stats, which may trail the last response by a step or a heartbeat.
    queries = ("spindle:prefix_cache_queries_total", ())

    def counted() -> dict | None:
        samples = scrape(server)
        return samples if samples[queries] - before[queries] >= 40 + 37 else None

    after = wait_until(counted, "both prompts' lookups are counted")
    assert moved("spindle:prefix_cache_queries_total") == 40 + 37
    assert moved("spindle:prefix_cache_hits_total") == 32
    assert moved("spindle:prompt_tokens_total") == 40 + 37
    assert moved("spindle:generation_tokens_total") == 5 + 7
    assert moved("vllm:prompt_tokens_total") == 40 + 37 and moved("vllm:generation_tokens_total") == 5 + 7
    assert moved("vllm:prefix_cache_hits_total") == 32
    assert moved("spindle:request_success_total", finished_reason="length") == 2
    assert moved("spindle:request_success_total", finished_reason="stop") == 0
    assert moved("spindle:request_success_total", finished_reason="abort") == 0
    for name in HISTOGRAMS:
        expected = (5 - 1) + (7 - 1) if name.endswith(":inter_token_latency_seconds") else 2  # one per later step
        assert moved(f"{name}_count") == expected, name
    assert moved("spindle:request_prompt_tokens_sum") == 40 + 37
    assert moved("spindle:request_generation_tokens_sum") == 5 + 7
    assert moved("spindle:request_params_max_tokens_sum") == 5 + 7
    assert moved("spindle:request_prompt_tokens_bucket", le="50.0") == 2
    assert moved("spindle:request_prompt_tokens_bucket", le="20.0") == 0
    assert moved("spindle:num_preemptions_total") == 0
    assert after["spindle:engine_restarts_total", ()] == 0
    assert after["spindle:num_requests_running", ()] == 0 and after["spindle:num_requests_waiting", ()] == 0
    assert 0 <= after["spindle:kv_cache_usage_perc", ()] <= 1
    assert after["process_resident_memory_bytes", ()] > 0


def test_a_request_span_is_a_child_of_the_callers_trace(server, client):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    client.metadata = (("traceparent", f"00-{trace_id}-{parent_id}-01"),)
    server.spans.clear()
    params = {"temperature": 0.5, "top_p": 0.9, "n": 2, "max_tokens": 4, "ignore_eos": True}
    choices, messages = collect(client.generate("trace me", request_id="traced", **params))
    assert refusal(lambda: client.generate("bad", request_id="refused", temperature=-1)).code() == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    spans = {span.attributes["gen_ai.request.id"]: span for span in server.spans.get_finished_spans()}
    span = spans["traced"]
    assert span.name == "llm_request" and span.kind == SpanKind.SERVER
    assert span.context.trace_id == int(trace_id, 16) and span.parent.span_id == int(parent_id, 16)
    attributes = span.attributes
    assert attributes["gen_ai.response.model"] == server.engine.info.model_name
    assert attributes["gen_ai.request.max_tokens"] == 4 and attributes["gen_ai.request.n"] == 2
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attributes["gen_ai.usage.prompt_tokens"] == messages[-1].usage.prompt_tokens > 0
    assert attributes["gen_ai.usage.completion_tokens"] == 8
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == ("length", "length")
    assert attributes["rpc.method"] == "Generate" and attributes["rpc.grpc.status_code"] == 0
    latencies = ["time_in_queue", "time_to_first_token", "e2e", "time_in_model_prefill", "time_in_model_decode"]
    assert all(attributes[f"gen_ai.latency.{name}"] >= 0 for name in latencies)
    assert attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]
    events = {event.name: event.timestamp for event in span.events}
    assert list(events) == ["queued", "first_scheduled", "first_token", "finished"]
    assert span.start_time <= events["queued"] <= events["first_token"] <= events["finished"] <= span.end_time
    assert span.status.status_code == StatusCode.UNSET
    # A refused request has its span too, with the call's status; a caller's mistake is no server error.
    refused = spans["refused"]
    assert refused.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert refused.status.status_code == StatusCode.UNSET and refused.parent.span_id == int(parent_id, 16)


def test_serving_without_the_tracing_flag_never_imports_opentelemetry(backend):  # noqa: F811
    script = f"""
import asyncio, sys
import spindle.frontend.grpc.server
from spindle.client import SpindleClient
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine
from spindle.frontend.grpc.args import ServerConfig

async def main():
    engine = AsyncLLMEngine.from_args(backend_address={backend!r})
    server = spindle.frontend.grpc.server.GrpcServer(engine, ServerConfig(port=0, metrics_port=0))
    port = await server.start()
    with SpindleClient(f"127.0.0.1:{{port}}", timeout=30) as client:
        await asyncio.to_thread(lambda: list(client.generate("hi", max_tokens=2)))
    await server.stop()
    engine.shutdown()

asyncio.run(main())
print(sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry"))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPINDLE_")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def watch(client, **interval):
    stub = spindle_pb2_grpc.SpindleServiceStub(client.channel)
    request = spindle_pb2.WatchLoadRequest(interval=duration_pb2.Duration(**interval) if interval else None)
    return stub.WatchLoad(request, timeout=60)


def test_watch_load_reports_when_a_request_starts_and_ends(server, client):
    interval = 30  # seconds: longer than the test, so that every report after the first is one of a change
    reports = watch(client, seconds=interval)
    first = next(reports)
    assert first.num_requests_running == 0 and abs(first.timestamp.ToMilliseconds() / 1000 - time.time()) < SLACK
    stream = client.generate("watched", temperature=0, max_tokens=200, ignore_eos=True)
    running = [next(reports)]
    while running[-1].num_requests_running == 0:
        running.append(next(reports))
    assert running[-1].num_requests_running == 1
    assert running[-1].timestamp.ToMilliseconds() - first.timestamp.ToMilliseconds() < interval * 1000
    choices, _ = collect(stream)
    assert len(choices[0]["token_ids"]) == 200
    ended = next(reports)
    while ended.num_requests_running:
        ended = next(reports)
    assert ended.num_requests_waiting == 0 and ended.generation_tokens_per_second > 0
    assert 0 <= ended.kv_cache_usage <= 1 and 0 <= ended.prefix_cache_hit_rate <= 1
    reports.cancel()
    info = client.server_info()
    assert info.generation_tokens_per_second > 0 and 0 <= info.kv_cache_usage <= 1


@pytest.mark.parametrize("interval", [{"nanos": 10_000_000}, {"seconds": 3600}, {"seconds": -1}])
def test_watch_load_refuses_an_interval_out_of_bounds(client, interval):
    assert_invalid(refusal(lambda: watch(client, **interval)), ["interval"], "is outside [0.05s, 60s]")


def test_watch_load_reports_at_least_every_interval(client, monkeypatch):
    # The default interval longer than the call's deadline: reports can only come at the requested one (0.1 s).
    monkeypatch.setattr("spindle.frontend.grpc.servicer.WATCH_INTERVAL", 3600.0)
    reports = watch(client, nanos=100_000_000)
    stamps = [next(reports).timestamp.ToMilliseconds() for _ in range(4)]
    reports.cancel()
    assert all(0 < later - earlier < (0.1 + SLACK) * 1000 for earlier, later in zip(stamps, stamps[1:], strict=False))


def stats(preemptions: int, queries: int, hits: int) -> EngineStats:
    return EngineStats(1, 0, 10, 20, preemptions, num_prefix_cache_queries=queries, num_prefix_cache_hits=hits)


def test_load_totals_keep_growing_across_backend_restarts():
    load = LoadTracker(SimpleNamespace())
    load.update(stats(3, 100, 40))  # what the backend counted before this server
    load.update(stats(5, 150, 60))
    # A new backend (its first restart): counting from zero, already past the old one's counts.
    load.update(stats(7, 200, 100), num_restarts=1)
    load.update(stats(8, 210, 100), num_restarts=1)
    load.update(stats(1, 10, 0), num_restarts=1)  # a restart the engine did not count (a count went down)
    assert load.totals["num_preemptions"] == 3 + 2 + 7 + 1 + 1
    assert (load.totals["num_prefix_cache_queries"], load.totals["num_prefix_cache_hits"]) == (370, 160)
    figures = load.load()
    assert figures.kv_cache_usage == 0.5 and figures.num_requests_running == 1
    # The window holds what grew while this server watched, not what the backend counted before it.
    assert figures.prefix_cache_hit_rate == pytest.approx((20 + 100) / (50 + 200 + 10 + 10))


def test_a_prefix_lookup_counts_once_when_its_sequence_is_admitted():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = Sequence("a", 0, list(range(10)), SamplingParams(), 0.0)
    bm.match_prefix(first)
    bm.allocate(first, 10)
    second = Sequence("b", 0, list(range(10)), SamplingParams(), 0.0)
    bm.match_prefix(second)
    bm.free_blocks(second)  # the scheduler could not admit it: it looks it up again at its next try
    second.num_computed_tokens = 0
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (10, 0)
    bm.match_prefix(second)
    bm.allocate(second, 2)
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (20, 8)


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = set()
    for spec in METRICS:
        suffixes = ("_bucket", "_sum", "_count") if spec.kind == "histogram" else ("",)
        exported |= {spec.sample_name + suffix for suffix in suffixes}
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    queried = set()
    for panel in panels:
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"spindle:[a-z0-9_]+", target["expr"]))
            assert 'model_name=~"$model_name"' in target["expr"], target["expr"]
    assert queried - exported == set()
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
