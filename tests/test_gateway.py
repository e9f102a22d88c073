"""Spindle behind the real SMG gateway (PyPI ``smg``, a Rust binary): OpenAI clients, cache-aware routing, aborts.

Two ``spindle serve`` workers run the tiny chat model with ``--metrics-port``; one ``smg launch`` routes to the first
alone, another to both with the cache-aware policy. The gateway finds each worker as a ``vllm.grpc.engine.VllmEngine``
one, builds its tokenizer from the worker's ``GetTokenizer`` and serves the OpenAI API, which the ``openai`` SDK calls.
"""

import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from test_gateway_metrics import Samples, free_port, only, scrape
from test_grpc import REPO, collect
from test_lora_api import model_dir  # noqa: F401 - a fixture
from waiting import SLACK, wait_until

from spindle.client import SpindleClient

SMG = shutil.which("smg", path=REPO / ".venv" / "bin") or shutil.which("smg")

pytestmark = pytest.mark.skipif(SMG is None, reason="no `smg` binary: `pip install smg` (the dev extra) installs it")

PROMPT = "hello there"
GREEDY = {"temperature": 0.0, "max_tokens": 16}

CACHE_AWARE = ["--policy", "cache_aware", "--cache-threshold", "0.5", "--balance-abs-threshold", "1000"]
CACHE_AWARE += ["--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0"]
"""SMG's flags for routing by prefix alone: cache-aware, a request goes to the worker holding half its prompt or more.
The other flags switch off what would send a request elsewhere: the spill to a less loaded worker, the warm-up share
of cache misses and the diversion of cache hits to a worker whose cache is still thin (both on for 60 s after a
worker registers)."""

SHARED = ("You are a careful assistant; answer in one word. " * 6)[:256]
"""A system prompt that requests share: 256 tokens (the byte-level tokenizer), 16 full KV blocks of 16."""


@dataclass
class Worker:
    """A ``spindle serve`` process: its gRPC address and its ``--metrics-port``."""

    process: subprocess.Popen
    address: str
    metrics_port: int

    def metric(self, name: str, **labels: str) -> float:
        """The value of the worker's one sample of ``name`` with ``labels`` among its labels."""
        samples: Samples = scrape(self.metrics_port)
        return only({name: [s for s in samples[name] if s[0].items() >= labels.items()]}, name)[1]


@dataclass
class Gateway:
    """An ``smg launch`` process: its address and the model it lists."""

    process: subprocess.Popen
    url: str
    model: str = ""

    def client(self) -> openai.OpenAI:
        """An ``openai`` SDK client of the gateway, without retries (a retry would hide a failed request)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def healthy_workers(self) -> int:
        """How many workers the gateway has registered and finds healthy (its ``/workers``)."""
        with urllib.request.urlopen(f"{self.url}/workers", timeout=10) as response:
            return sum(worker["is_healthy"] for worker in json.load(response)["workers"])


def start_worker(model: Path) -> Worker:
    """Start ``spindle serve`` on a free port and return once it listens."""
    metrics_port = free_port()
    command = [str(REPO / ".venv" / "bin" / "spindle"), "serve", "--model", str(model), "--dtype", "float32"]
    command += ["--kv-cache-memory", "8MiB", "--port", "0", "--metrics-port", str(metrics_port)]
    environment = {key: value for key, value in os.environ.items() if not key.startswith("SPINDLE_")}
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, text=True)
    banner = process.stdout.readline()  # "spindle: serving MODEL on HOST:PORT" once it listens
    if not banner:
        stop(process)
        pytest.fail(f"spindle serve exited with {process.returncode} before it listened")
    return Worker(process, f"127.0.0.1:{banner.rsplit(':', 1)[1].strip()}", metrics_port)


def start_gateway(workers: list[Worker], *flags: str) -> Gateway:
    """Start ``smg launch`` in front of ``workers``; return once all are healthy in it and it lists their model."""
    port = free_port()
    command = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    command += ["--log-level", "warn", "--worker-urls", *(f"grpc://{worker.address}" for worker in workers), *flags]
    gateway = Gateway(subprocess.Popen(command, stdout=subprocess.DEVNULL), f"http://127.0.0.1:{port}")

    def ready() -> str | None:
        assert gateway.process.poll() is None, f"smg exited with {gateway.process.returncode}"
        try:
            models = gateway.client().models.list().data
            if not models or gateway.healthy_workers() != len(workers):
                return None
            # smg lists the model before it has fetched the worker's tokenizer, and answers 503 ("not registered
            # yet; retry shortly") until then: seen on a loaded machine. A one-token completion proves both.
            gateway.client().completions.create(model=models[0].id, prompt="ready?", max_tokens=1)
            return models[0].id
        except (openai.OpenAIError, OSError):
            return None

    try:
        gateway.model = wait_until(ready, "the gateway registers the workers and serves their model", timeout=120)
    except BaseException:
        stop(gateway.process)  # no fixture owns it yet
        raise
    return gateway


def stop(process: subprocess.Popen) -> None:
    """Kill a process this module started and reap it."""
    process.kill()
    process.wait(30)


@pytest.fixture(scope="module")
def long_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811 - the fixture
    """The tiny chat model with a 4,096-token context, so that a request can outlast a client's disconnect."""
    path = tmp_path_factory.mktemp("tiny-chat-long")
    for file in model_dir.iterdir():
        shutil.copy(file, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    return path


@pytest.fixture(scope="module")
def workers(long_model: Path) -> Iterator[list[Worker]]:
    """Two ``spindle serve`` workers of the tiny chat model."""
    started: list[Worker] = []
    try:
        for _ in range(2):
            started.append(start_worker(long_model))
        yield started
    finally:
        for worker in started:
            stop(worker.process)


@pytest.fixture(scope="module")
def single(workers: list[Worker]) -> Iterator[Gateway]:
    """The gateway in front of the first worker alone, with its default flags."""
    gateway = start_gateway(workers[:1])
    yield gateway
    stop(gateway.process)


@pytest.fixture(scope="module")
def pair(workers: list[Worker]) -> Iterator[Gateway]:
    """The gateway in front of both workers, routing by prefix (:data:`CACHE_AWARE`)."""
    gateway = start_gateway(workers, *CACHE_AWARE)
    yield gateway
    stop(gateway.process)


def gateway_answer(gateway: Gateway, kind: str, stream: bool) -> tuple[str, str]:
    """The text and finish reason of a greedy chat or text completion of :data:`PROMPT` through ``gateway``."""
    client = gateway.client()
    if kind == "chat":
        messages = [{"role": "user", "content": PROMPT}]
        response = client.chat.completions.create(model=gateway.model, messages=messages, stream=stream, **GREEDY)
        if not stream:
            return response.choices[0].message.content, response.choices[0].finish_reason
        chunks = [chunk.choices[0] for chunk in response if chunk.choices]
        return "".join(choice.delta.content or "" for choice in chunks), chunks[-1].finish_reason
    response = client.completions.create(model=gateway.model, prompt=PROMPT, stream=stream, **GREEDY)
    if not stream:
        return response.choices[0].text, response.choices[0].finish_reason
    chunks = [chunk.choices[0] for chunk in response if chunk.choices]
    return "".join(choice.text for choice in chunks), chunks[-1].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("front", ["single", "pair"])
def test_greedy_completions_equal_spindle_chat_and_generate(request, workers, front, kind, stream):
    with SpindleClient(workers[0].address, timeout=60) as spindle:
        if kind == "chat":
            responses = spindle.chat([{"role": "user", "content": PROMPT}], **GREEDY)
        else:
            responses = spindle.generate(PROMPT, **GREEDY)
        choices, _ = collect(responses)
    assert len(choices[0]["token_ids"]) == GREEDY["max_tokens"]
    assert gateway_answer(request.getfixturevalue(front), kind, stream) == (choices[0]["text"], "length")


def test_cache_aware_routing_keeps_a_shared_prefix_on_one_worker(pair, workers):
    def hits() -> list[float]:
        return [worker.metric("vllm:prefix_cache_hits_total") for worker in workers]

    before = hits()
    client = pair.client()
    cached = []
    for question in range(6):
        prompt = f"{SHARED}Question {question}: which colour is the sky?"
        usage = client.completions.create(model=pair.model, prompt=prompt, max_tokens=1).usage
        cached.append(usage.prompt_tokens_details.cached_tokens)
    # Each request after the first found the shared prefix cached: the gateway sent it where the first went.
    assert cached[0] == 0 and all(tokens >= len(SHARED) for tokens in cached[1:]), cached

    def gained() -> list[float] | None:
        gains = [now - then for now, then in zip(hits(), before, strict=True)]
        return gains if max(gains) == sum(cached) else None

    # The workers' metrics follow their engine's statistics a step late.
    assert sorted(wait_until(gained, "one worker's prefix cache hits count the cached tokens")) == [0, sum(cached)]


def test_a_client_that_disconnects_aborts_its_request_in_spindle(single, workers):
    worker = workers[0]
    aborted = worker.metric("vllm:request_success_total", finished_reason="abort")
    client = single.client()
    stream = client.completions.create(
        model=single.model, prompt=PROMPT, max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    assert next(iter(stream)).choices

    def state() -> tuple[float, bool, float]:
        running = worker.metric("vllm:num_requests_running")
        holds_blocks = worker.metric("vllm:kv_cache_usage_perc") > 0
        return running, holds_blocks, worker.metric("vllm:request_success_total", finished_reason="abort") - aborted

    wait_until(lambda: state() == (1, True, 0), "the worker runs the request")
    stream.close()  # smg answers the disconnect with an Abort call to the worker
    # 4,000 tokens take the tiny model several seconds; the abort frees the request's blocks at once.
    wait_until(lambda: state() == (0, False, 1), "the worker aborts the request and frees its KV blocks", SLACK)
