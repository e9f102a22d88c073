"""The metrics the inference gateways read: vLLM's names and labels on ``spindle serve --metrics-port``, under load.

The Kubernetes inference gateway's endpoint picker scrapes five series from each model server (its model-server
protocol): ``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:lora_requests_info`` and ``vllm:cache_config_info``. Here a real ``spindle serve`` with two adapters and room
for two sequences runs two streams (one with an adapter) while two more (one with the other adapter) wait.
"""

import os
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_grpc import REPO
from test_lora_api import adapters, model_dir  # noqa: F401 - fixtures
from waiting import wait_until

from spindle.client import SpindleClient

BLOCK_SIZE = 32
"""Not the default, so that ``vllm:cache_config_info`` shows it read the engine's."""

MAX_LORAS = 3
"""Not the default either, for ``max_lora``."""

Samples = dict[str, list[tuple[dict[str, str], float]]]


def free_port() -> int:
    """A TCP port nothing listens on now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def serve(model_dir: Path, adapters: Path) -> Iterator[tuple[SpindleClient, int]]:  # noqa: F811 - fixtures
    """``spindle serve`` with the ``sql`` and ``chat`` adapters (more load from ``adapters/``) and room for two
    sequences: its client, metrics port."""
    metrics_port = free_port()
    lora = adapters / "adapters"
    command = [str(REPO / ".venv" / "bin" / "spindle"), "serve", "--model", str(model_dir), "--dtype", "float32"]
    command += ["--kv-cache-memory", "4MiB", "--port", "0", "--metrics-port", str(metrics_port)]
    command += ["--block-size", str(BLOCK_SIZE), "--max-num-seqs", "2", "--max-loras", str(MAX_LORAS)]
    command += ["--lora-modules", f"sql={lora / 'sql'}", f"chat={lora / 'chat'}"]
    command += ["--allow-runtime-lora", "--lora-dir", str(lora)]
    environment = {key: value for key, value in os.environ.items() if not key.startswith("SPINDLE_")}
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline().rsplit(":", 1)[1])
        with SpindleClient(f"127.0.0.1:{port}", timeout=120) as client:
            yield client, metrics_port
    finally:
        process.kill()
        process.wait(30)


def scrape(metrics_port: int) -> Samples:
    """The samples of ``/metrics``, by name: each sample's labels and value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def only(samples: Samples, name: str) -> tuple[dict[str, str], float]:
    """The one sample of ``name``."""
    assert len(samples[name]) == 1, samples[name]
    return samples[name][0]


def test_the_gateway_series_under_load(serve):
    client, metrics_port = serve
    info = client.server_info()
    model_name = client.model_info().model_name
    # Running, with their first tokens: one with the sql adapter, one with the base model.
    running = [client.generate("run", lora_name="sql", max_tokens=500, ignore_eos=True)]
    running.append(client.generate("run", max_tokens=500, ignore_eos=True))
    for stream in running:
        next(stream)
    # No room left: these two wait, one of them with the chat adapter.
    waiting = [client.generate("wait", lora_name=name, max_tokens=4, ignore_eos=True) for name in ("chat", "")]

    def loaded() -> Samples | None:
        samples = scrape(metrics_port)
        counts = only(samples, "vllm:num_requests_running")[1], only(samples, "vllm:num_requests_waiting")[1]
        lora = only(samples, "vllm:lora_requests_info")[0]
        return samples if counts == (2, 2) and lora["waiting_lora_adapters"] else None

    samples = wait_until(loaded, "the scrape shows two running and two waiting requests")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert only(samples, name)[0] == {"model_name": model_name, "engine": "0"}
    assert 0 < only(samples, "vllm:kv_cache_usage_perc")[1] <= 1
    assert only(samples, "vllm:cache_config_info") == (
        {"block_size": str(BLOCK_SIZE), "num_gpu_blocks": str(info.num_total_kv_blocks), "engine": "0"},
        1.0,
    )
    labels, updated = only(samples, "vllm:lora_requests_info")
    assert labels == {"max_lora": str(MAX_LORAS), "running_lora_adapters": "sql", "waiting_lora_adapters": "chat"}
    assert updated > info.uptime_seconds  # a time (seconds since the epoch), not a count
    per_adapter = {
        (name, labels["lora_name"]): value
        for name in ("spindle:lora_requests_running", "spindle:lora_requests_waiting")
        for labels, value in samples[name]
    }
    assert per_adapter == {("spindle:lora_requests_running", "sql"): 1, ("spindle:lora_requests_waiting", "chat"): 1}

    for stream in running:
        stream.cancel()
    for stream in waiting:
        list(stream)

    def idle() -> Samples | None:
        samples = scrape(metrics_port)
        counts = only(samples, "vllm:num_requests_running")[1], only(samples, "vllm:num_requests_waiting")[1]
        return samples if counts == (0, 0) else None

    samples = wait_until(idle, "the scrape shows no request")
    assert only(samples, "vllm:lora_requests_info")[0] == {
        "max_lora": str(MAX_LORAS),
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert "spindle:lora_requests_running" not in samples and "spindle:lora_requests_waiting" not in samples
    # The request metrics under both names moved alike (the streams cancelled count as aborts).
    success = {
        (name, labels["finished_reason"]): value
        for name in ("spindle:request_success_total", "vllm:request_success_total")
        for labels, value in samples[name]
    }
    for reason in ("stop", "length", "abort"):
        assert success["vllm:request_success_total", reason] == success["spindle:request_success_total", reason]
    assert success["vllm:request_success_total", "abort"] == 2
    assert success["vllm:request_success_total", "length"] == 2


def test_each_loaded_adapter_is_resident_until_unloaded(serve):
    client, metrics_port = serve

    def resident() -> set[str]:
        samples = scrape(metrics_port).get("spindle:lora_adapter_resident", [])
        assert all(value == 1 for _, value in samples)
        return {labels["lora_name"] for labels, _ in samples}

    assert wait_until(lambda: resident() >= {"sql", "chat"} or None, "the start-up adapters are resident")
    client.load_lora_adapter("extra", "sql")
    wait_until(lambda: "extra" in resident(), "the adapter loaded at run time is resident")
    client.unload_lora_adapter("extra")
    wait_until(lambda: "extra" not in resident(), "the unloaded adapter is no longer resident")
    assert resident() >= {"sql", "chat"}
