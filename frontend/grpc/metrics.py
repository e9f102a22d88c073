"""The gRPC server's load figures (``WatchLoad``, ``GetServerInfo``) and its Prometheus metrics (``--metrics-port``).

Everything comes from what the frontend already receives, over the one socket to the backend: the
:class:`~spindle.shared.protocol.EngineStats` that comes with every step and heartbeat (running and waiting
sequences, KV cache blocks, and counts since the backend started: preemptions, prefix cache lookups, draft tokens),
and the requests' progress as the output processor applies each step (a
:class:`~spindle.frontend.processing.output_processor.StepListener`: tokens, timings, finish reasons).

The metric names are vLLM's with the ``spindle:`` prefix, and the histograms have vLLM's buckets; every metric has
a ``model_name`` label. Those with a vLLM counterpart are also exported under vLLM's own name and labels (``vllm:``
prefix, ``model_name`` and ``engine``), with vLLM's ``vllm:cache_config_info`` and ``vllm:lora_requests_info``, so
that the gateways which read a vLLM server's metrics (the Kubernetes inference gateway's endpoint picker, say) read
Spindle's unchanged. :data:`METRICS` lists them all (the docs' table is made from it). prometheus_client is imported
only by :class:`MetricsServer`, so a server that serves no metrics does not need it.
"""

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from spindle.frontend.engine.data_parallel import sum_stats
from spindle.frontend.processing.output_processor import RequestState
from spindle.shared import FinishReason
from spindle.shared.protocol import EngineStats

if TYPE_CHECKING:
    from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """One exported metric.

    Attributes:
        name: its name; a counter's samples are scraped as ``<name>_total``.
        kind: ``"counter"``, ``"gauge"`` or ``"histogram"``.
        help: what it measures (its ``# HELP`` text).
        source: ``"engine"``: read from the engine at each scrape (its backend's latest stats, its restarts, its
            requests' adapters);
            ``"requests"``: recorded as requests progress.
        labels: its label names.
        buckets: a histogram's upper bounds; empty for the 1-2-5 series up to the model's context length
            (:func:`token_buckets`).

    """

    name: str
    kind: str
    help: str
    source: str
    labels: tuple[str, ...] = ("model_name",)
    buckets: tuple[float, ...] = ()

    @property
    def sample_name(self) -> str:
        """The name its samples are scraped under (a counter's end in ``_total``)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


# vLLM's bucket bounds, so that quantiles line up with a vLLM deployment's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TTFT_BUCKETS += (40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
INTER_TOKEN_BUCKETS += (40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
REQUEST_LATENCY_BUCKETS += (240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def token_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: the buckets of the token-count histograms, as vLLM's."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def _spec(name: str, kind: str, help: str, source: str = "requests", **extra: object) -> MetricSpec:
    return MetricSpec(f"spindle:{name}", kind, help, source, **extra)


VLLM_ENGINE_INDEX = "0"
"""The ``engine`` label of the ``vllm:`` series: vLLM's data-parallel index, and Spindle's frontend, whatever its
backends, is one engine to a gateway."""


def _vllm(spec: MetricSpec) -> MetricSpec:
    """The vLLM counterpart of a ``spindle:`` metric: vLLM's name, and its labels (``engine`` after ``model_name``)."""
    labels = ("model_name", "engine") + spec.labels[1:]
    return dataclasses.replace(spec, name=spec.name.replace("spindle:", "vllm:", 1), labels=labels)


SPINDLE_METRICS: tuple[MetricSpec, ...] = (
    # The backend's state and counts, as of its last step or heartbeat.
    _spec("num_requests_running", "gauge", "Sequences in the running batch (a request with n > 1 counts n).", "engine"),
    _spec("num_requests_waiting", "gauge", "Sequences waiting for the scheduler to admit them.", "engine"),
    _spec("kv_cache_usage_perc", "gauge", "Fraction of the KV cache's blocks in use: 1 means 100 percent.", "engine"),
    _spec(
        "prefix_cache_queries",
        "counter",
        "Prefix cache queries, in tokens: the tokens of each sequence admitted to the batch.",
        "engine",
    ),
    _spec("prefix_cache_hits", "counter", "Prefix cache hits, in tokens: those whose K/V was cached.", "engine"),
    _spec("num_preemptions", "counter", "Sequences preempted (blocks freed, to be recomputed).", "engine"),
    _spec("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed by speculative decoding.", "engine"),
    _spec("spec_decode_num_accepted_tokens", "counter", "Draft tokens the model accepted.", "engine"),
    _spec(
        "engine_restarts",
        "counter",
        "Times a new backend took over from a dead one (restarted, or reconnected to).",
        "engine",
    ),
    _spec(
        "request_resumptions",
        "counter",
        "Times a request was sent again, with the tokens it had streamed, after its backend died.",
        "engine",
    ),
    _spec(
        "request_resume_failures",
        "counter",
        "Requests failed because their backend died after they had been resumed max_stream_resumes times.",
        "engine",
    ),
    # Each request's progress, as the frontend applies each step.
    _spec("prompt_tokens", "counter", "Prompt tokens of the requests that got their first token (prefill tokens)."),
    _spec("generation_tokens", "counter", "Tokens generated."),
    _spec(
        "request_success",
        "counter",
        "Requests finished, by finished_reason: stop, length, or abort (cancelled, aborted or refused).",
        labels=("model_name", "finished_reason"),
    ),
    _spec(
        "time_to_first_token_seconds",
        "histogram",
        "Seconds from a request's arrival to its first token.",
        buckets=TTFT_BUCKETS,
    ),
    _spec(
        "inter_token_latency_seconds",
        "histogram",
        "Seconds between two steps that give a request tokens.",
        buckets=INTER_TOKEN_BUCKETS,
    ),
    _spec(
        "e2e_request_latency_seconds",
        "histogram",
        "Seconds from a request's arrival to its end.",
        buckets=REQUEST_LATENCY_BUCKETS,
    ),
    _spec(
        "request_queue_time_seconds",
        "histogram",
        "Seconds from a request's arrival to its first scheduling.",
        buckets=REQUEST_LATENCY_BUCKETS,
    ),
    _spec(
        "request_inference_time_seconds",
        "histogram",
        "Seconds from a request's first scheduling to its end.",
        buckets=REQUEST_LATENCY_BUCKETS,
    ),
    _spec(
        "request_prefill_time_seconds",
        "histogram",
        "Seconds from a request's first scheduling to its first token.",
        buckets=REQUEST_LATENCY_BUCKETS,
    ),
    _spec(
        "request_decode_time_seconds",
        "histogram",
        "Seconds from a request's first token to its end.",
        buckets=REQUEST_LATENCY_BUCKETS,
    ),
    _spec("request_prompt_tokens", "histogram", "Prompt tokens of each finished request."),
    _spec("request_generation_tokens", "histogram", "Tokens generated for each finished request (all n)."),
    _spec("request_params_n", "histogram", "The n (completions) of each finished request.", buckets=N_BUCKETS),
    _spec("request_params_max_tokens", "histogram", "The max_tokens of each finished request that set it."),
    # Per LoRA adapter, from the frontend's requests: vLLM has only the names, in vllm:lora_requests_info.
    _spec(
        "lora_requests_running",
        "gauge",
        "Requests with this adapter that have had tokens and not ended.",
        "engine",
        labels=("model_name", "lora_name"),
    ),
    _spec(
        "lora_requests_waiting",
        "gauge",
        "Requests with this adapter that wait for their first tokens.",
        "engine",
        labels=("model_name", "lora_name"),
    ),
    _spec(
        "lora_adapter_resident",
        "gauge",
        "1 for each LoRA adapter loaded in the engine (its weights on the host, whether in a device slot or not).",
        "engine",
        labels=("model_name", "lora_name"),
    ),
)
"""The ``spindle:`` metrics."""

_NOT_IN_VLLM = {
    "spindle:engine_restarts",
    "spindle:request_resumptions",
    "spindle:request_resume_failures",
    "spindle:lora_requests_running",
    "spindle:lora_requests_waiting",
    "spindle:lora_adapter_resident",
}

VLLM_METRICS: tuple[MetricSpec, ...] = tuple(_vllm(spec) for spec in SPINDLE_METRICS if spec.name not in _NOT_IN_VLLM)
VLLM_METRICS += (
    MetricSpec(
        "vllm:cache_config_info",
        "gauge",
        "The KV cache's configuration, in the labels; the value is 1.",
        "engine",
        labels=("block_size", "num_gpu_blocks", "engine"),
    ),
    MetricSpec(
        "vllm:lora_requests_info",
        "gauge",
        "The LoRA adapters in use, in the labels (names separated by commas); the value is the time of the scrape.",
        "engine",
        labels=("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
    ),
)
"""The metrics under vLLM's names and labels: the counterparts of the ``spindle:`` ones, and vLLM's two infos."""

METRICS: tuple[MetricSpec, ...] = SPINDLE_METRICS + VLLM_METRICS
"""Every metric the server exports, besides the standard ``process_*`` and ``python_*`` ones."""

_CUMULATIVE_STATS = (
    "num_preemptions",
    "num_prefix_cache_queries",
    "num_prefix_cache_hits",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
)
"""The :class:`EngineStats` fields that count since the backend started (a new backend starts them at zero)."""


@dataclasses.dataclass
class Load:
    """The load figures of one ``LoadReport`` (and of ``GetServerInfo``).

    Attributes:
        num_requests_running: sequences in the running batch.
        num_requests_waiting: sequences waiting to be admitted.
        kv_cache_usage: fraction of the KV cache's blocks in use.
        prefix_cache_hit_rate: prefix cache hits over queries (tokens) in the recent window; 0 without a query.
        generation_tokens_per_second: tokens generated per second, averaged over the recent window.
        timestamp: when the figures were taken (``time.time()``).

    """

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    generation_tokens_per_second: float
    timestamp: float


def kv_cache_usage(stats: EngineStats | None) -> float:
    """The fraction of the KV cache's blocks in use (0 before the first stats)."""
    if stats is None or not stats.num_total_blocks:
        return 0.0
    return (stats.num_total_blocks - stats.num_free_blocks) / stats.num_total_blocks


class LoadTracker:
    """The engine's load as the server sees it: the latest stats, totals that survive backend restarts, and rates.

    :meth:`start` follows every stats update (each step and heartbeat) in a task, taking each backend's figures from
    :meth:`~spindle.frontend.engine.async_llm_engine.AsyncLLMEngine.rank_stats` (with several backends, they add up),
    and every request's tokens as a :class:`~spindle.frontend.processing.output_processor.StepListener`. A backend's
    counts start from zero when it restarts; the :attr:`totals` add up what they grew by, so they only ever grow.

    Args:
        engine: the engine, connected to its backend (or backends).
        window: the seconds that the recent rates (throughput, prefix cache hit rate) cover.

    Attributes:
        totals: per cumulative :class:`EngineStats` field (``num_preemptions``, ``num_prefix_cache_queries``, ...),
            its sum over every backend the engine has had.

    """

    def __init__(self, engine: "AsyncLLMEngine", window: float = 10.0) -> None:
        self.engine = engine
        self.window = window
        self.totals = dict.fromkeys(_CUMULATIVE_STATS, 0)
        # Per backend (its rank): its latest stats, whether it served at its latest look, and its restarts then.
        self._latest: dict[int, EngineStats] = {}
        self._serving: dict[int, bool] = {}
        self._restarts: dict[int, int] = {}
        self._started = time.monotonic()
        # One entry per second that saw activity: [second, tokens generated, prefix queries, prefix hits].
        self._seconds: collections.deque[list[int]] = collections.deque()
        self._updated = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def stats(self) -> EngineStats | None:
        """The latest stats (``None`` before the first): with several backends, the sum over those that serve.

        While none serves, the last ones seen stay, as they do for a single backend.
        """
        serving = [stats for rank, stats in self._latest.items() if self._serving[rank]]
        latest = serving or list(self._latest.values())
        if len(latest) <= 1:
            return latest[0] if latest else None
        return sum_stats(latest)

    def start(self) -> None:
        """Start following the engine (from its event loop)."""
        self.engine.output_processor.listeners.append(self)
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def close(self) -> None:
        """Stop following the engine."""
        with contextlib.suppress(ValueError):
            self.engine.output_processor.listeners.remove(self)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def update(self, stats: EngineStats, rank: int = 0, num_restarts: int = 0) -> None:
        """Take one stats update: add what the counts grew by to the totals and the window, wake the waiters.

        ``rank`` is the index of the backend the stats come from, ``num_restarts`` how many new backends had taken
        over there when it sent them.
        """
        # After a restart the new backend's counts start from zero, so all of them are new.
        previous = self._latest.get(rank) if num_restarts == self._restarts.get(rank, 0) else None
        self._restarts[rank] = num_restarts
        grown = {}
        for name in _CUMULATIVE_STATS:
            new, old = getattr(stats, name), getattr(previous, name, 0)
            # A count that went down means a new backend too (if the engine did not say so).
            grown[name] = new - old if new >= old else new
            self.totals[name] += grown[name]
        if rank in self._latest:  # the first update brings what the backend counted before this server
            second = self._second()
            second[2] += grown["num_prefix_cache_queries"]
            second[3] += grown["num_prefix_cache_hits"]
        self._latest[rank] = stats
        self._serving[rank] = True
        self._updated.set()
        self._updated = asyncio.Event()

    def on_tokens(self, state: RequestState, num_new_tokens: int, now: float) -> None:
        """Count the tokens a step gave a request (a :class:`StepListener` method)."""
        self._second()[1] += num_new_tokens

    def on_finished(self, state: RequestState, now: float) -> None:
        """Nothing to do when a request ends (a :class:`StepListener` method)."""

    def load(self) -> Load:
        """The current figures."""
        now = time.monotonic()
        tokens = queries = hits = 0.0
        for second, second_tokens, second_queries, second_hits in self._seconds:
            # The share of that second inside the window: the oldest one is only partly in it.
            share = min(1.0, max(0.0, second + 1 - (now - self.window)))
            tokens += share * second_tokens
            queries += share * second_queries
            hits += share * second_hits
        span = min(self.window, max(now - self._started, 1.0))
        stats = self.stats
        return Load(
            num_requests_running=stats.num_running if stats else 0,
            num_requests_waiting=stats.num_waiting if stats else 0,
            kv_cache_usage=kv_cache_usage(stats),
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            generation_tokens_per_second=tokens / span,
            timestamp=time.time(),
        )

    async def wait(self, timeout: float) -> None:
        """Return at the next stats update, or after ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._updated.wait(), timeout)

    def _second(self) -> list[int]:
        """The current second's entry (the older ones that left the window are dropped)."""
        second = int(time.monotonic())
        if not self._seconds or self._seconds[-1][0] != second:
            self._seconds.append([second, 0, 0, 0])
            while self._seconds[0][0] + 1 < second - self.window:
                self._seconds.popleft()
        return self._seconds[-1]

    async def _follow(self) -> None:
        while True:
            try:
                await self.engine.get_stats()  # the next step's or heartbeat's of each backend that serves
            except Exception as error:
                # Every backend is down (EngineDeadError): nothing to follow until the engine has one again.
                logger.debug("No engine stats (%s): trying again shortly", error)
                await asyncio.sleep(0.5)
            for rank, figures in enumerate(self.engine.rank_stats()):
                if figures.serving and figures.stats is not None:
                    self.update(figures.stats, rank, figures.num_restarts)
                else:
                    self._serving[rank] = False


def _finished_reason(state: RequestState) -> str:
    """The ``finished_reason`` label of a request that ended: abort, else length, else stop, over its completions."""
    reasons = {completion.finish_reason for completion in state.completions}
    for reason in (None, FinishReason.ABORT, FinishReason.LENGTH):
        if reason in reasons:
            return (reason or FinishReason.ABORT).value
    return FinishReason.STOP.value


def _short_name(name: str) -> str:
    """A metric's name without its ``spindle:`` or ``vllm:`` prefix: the same for a metric and its counterpart."""
    return name.split(":", 1)[1]


def _label_values(spec: MetricSpec, model_name: str) -> list[str]:
    """The values of a per-model metric's labels: the model's name, and vLLM's engine index for a ``vllm:`` one."""
    return [model_name, VLLM_ENGINE_INDEX] if spec.name.startswith("vllm:") else [model_name]


def lora_requests(engine: "AsyncLLMEngine") -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Per LoRA adapter, its requests that are running (have had tokens) and waiting (for their first tokens).

    The frontend learns that a request was scheduled from its first tokens, so a request in its prefill counts as
    waiting, and a preempted one as running.
    """
    running, waiting = collections.Counter(), collections.Counter()
    # A copy: the scrape runs in the metrics server's thread while the event loop adds and ends requests.
    for state in list(engine.output_processor.requests.values()):
        if state.request is not None and state.request.lora_name is not None and not state.finished:
            counts = waiting if state.last_token_time is None else running
            counts[state.request.lora_name] += 1
    return running, waiting


class _EngineCollector:
    """The ``source="engine"`` metrics, read from the :class:`LoadTracker` and the engine at each scrape."""

    def __init__(self, load: LoadTracker, model_name: str) -> None:
        self.load = load
        self.model_name = model_name

    def collect(self) -> Iterator[object]:
        """Yield one metric family per engine metric."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine = self.load.engine
        stats, totals = self.load.stats, self.load.totals
        values = {
            "num_requests_running": stats.num_running if stats else 0,
            "num_requests_waiting": stats.num_waiting if stats else 0,
            "kv_cache_usage_perc": kv_cache_usage(stats),
            "prefix_cache_queries": totals["num_prefix_cache_queries"],
            "prefix_cache_hits": totals["num_prefix_cache_hits"],
            "num_preemptions": totals["num_preemptions"],
            "spec_decode_num_draft_tokens": totals["num_draft_tokens"],
            "spec_decode_num_accepted_tokens": totals["num_accepted_draft_tokens"],
            "engine_restarts": engine.num_backend_restarts,
            "request_resumptions": engine.num_resumed_requests,
            "request_resume_failures": engine.num_resume_failures,
        }
        running, waiting = lora_requests(engine)
        resident = collections.Counter(stats.lora_adapters if stats else [])
        per_adapter = {
            "lora_requests_running": running,
            "lora_requests_waiting": waiting,
            "lora_adapter_resident": resident,
        }
        info = engine.info
        for spec in METRICS:
            if spec.source != "engine":
                continue
            family = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            metric = family(spec.name, spec.help, labels=spec.labels)
            name = _short_name(spec.name)
            if name in per_adapter:
                for adapter, count in sorted(per_adapter[name].items()):
                    metric.add_metric([self.model_name, adapter], count)
            elif name == "cache_config_info":
                metric.add_metric([str(info.block_size), str(info.num_kv_blocks), VLLM_ENGINE_INDEX], 1)
            elif name == "lora_requests_info":
                labels = [str(info.max_loras), ",".join(sorted(running)), ",".join(sorted(waiting))]
                metric.add_metric(labels, time.time())
            else:
                metric.add_metric(_label_values(spec, self.model_name), values[name])
            yield metric


class MetricsServer:
    """Serves the Prometheus metrics over HTTP at ``http://host:port/metrics``, from a thread of its own.

    The request metrics are recorded as the output processor applies each step (this is a
    :class:`~spindle.frontend.processing.output_processor.StepListener`), under their ``spindle:`` name and their
    ``vllm:`` one alike; the engine's are read from ``load`` and the engine at each scrape. The metrics live in a
    registry of their own (with the standard ``process_*`` and ``python_*`` collectors), not prometheus_client's
    global one, so that several servers can share a process.

    Args:
        engine: the engine, connected to its backend (or backends).
        load: the server's :class:`LoadTracker`, started.
        host: the interface to listen on.
        port: the TCP port; ``0`` picks a free one (:attr:`port` says which); ``None`` serves no port of its own,
            only the :attr:`registry` (which the HTTP API's ``/metrics`` serves).

    Attributes:
        port: the TCP port it listens on (``None`` without one).
        registry: the prometheus_client ``CollectorRegistry`` it serves.

    """

    def __init__(
        self, engine: "AsyncLLMEngine", load: LoadTracker, host: str = "127.0.0.1", port: int | None = 0
    ) -> None:
        # Imported here: only a server that serves metrics needs prometheus_client.
        import prometheus_client

        self.registry = prometheus_client.CollectorRegistry()
        prometheus_client.ProcessCollector(registry=self.registry)
        prometheus_client.PlatformCollector(registry=self.registry)
        prometheus_client.GCCollector(registry=self.registry)
        model_name = engine.info.model_name
        self.registry.register(_EngineCollector(load, model_name))
        # Per metric (its short name), its children under both names: a request is recorded in each.
        self._metrics: dict[str, list] = collections.defaultdict(list)
        # Per finished_reason, both names' children, each from the start, at zero: rate() sees the first request.
        self._success: dict[str, list] = collections.defaultdict(list)
        for spec in METRICS:
            if spec.source != "requests":
                continue
            if spec.kind == "counter":
                metric = prometheus_client.Counter(spec.name, spec.help, spec.labels, registry=self.registry)
            else:
                buckets = spec.buckets or token_buckets(engine.info.max_model_len)
                metric = prometheus_client.Histogram(
                    spec.name, spec.help, spec.labels, buckets=buckets, registry=self.registry
                )
            labels = _label_values(spec, model_name)
            name = _short_name(spec.name)
            if name == "request_success":
                for reason in FinishReason:
                    self._success[reason.value].append(metric.labels(*labels, reason.value))
            else:
                self._metrics[name].append(metric.labels(*labels))
        self.engine = engine
        engine.output_processor.listeners.append(self)
        self.httpd, self._thread, self.port = None, None, None
        if port is not None:
            self.httpd, self._thread = prometheus_client.start_http_server(port, host, registry=self.registry)
            self.port = self.httpd.server_address[1]
            logger.info("Serving Prometheus metrics on http://%s:%d/metrics", host, self.port)

    def on_tokens(self, state: RequestState, num_new_tokens: int, now: float) -> None:
        """Count a step's tokens for a request; time its first token, or the gap since its previous ones."""
        self._inc("generation_tokens", num_new_tokens)
        if state.last_token_time is None:
            self._inc("prompt_tokens", len(state.prompt_token_ids))
            self._observe("time_to_first_token_seconds", max(0.0, now - state.metrics.arrival_time))
        else:
            self._observe("inter_token_latency_seconds", now - state.last_token_time)

    def on_finished(self, state: RequestState, now: float) -> None:
        """Count a request that ended, by reason, and observe its latencies, sizes and parameters."""
        times = state.metrics
        for child in self._success[_finished_reason(state)]:
            child.inc()
        self._observe("e2e_request_latency_seconds", max(0.0, now - times.arrival_time))
        # The scheduling time is the backend's clock and the others the frontend's: never let a skew go negative.
        if times.first_scheduled_time is not None:
            self._observe("request_queue_time_seconds", max(0.0, times.first_scheduled_time - times.arrival_time))
            self._observe("request_inference_time_seconds", max(0.0, now - times.first_scheduled_time))
            if times.first_token_time is not None:
                prefill = times.first_token_time - times.first_scheduled_time
                self._observe("request_prefill_time_seconds", max(0.0, prefill))
        if times.first_token_time is not None:
            self._observe("request_decode_time_seconds", max(0.0, now - times.first_token_time))
        self._observe("request_prompt_tokens", len(state.prompt_token_ids))
        self._observe("request_generation_tokens", sum(len(c.token_ids) for c in state.completions))
        self._observe("request_params_n", state.params.n)
        if state.params.max_tokens is not None:
            self._observe("request_params_max_tokens", state.params.max_tokens)

    def _inc(self, name: str, amount: float) -> None:
        """Add ``amount`` to a counter under both its names."""
        for child in self._metrics[name]:
            child.inc(amount)

    def _observe(self, name: str, value: float) -> None:
        """Observe ``value`` in a histogram under both its names."""
        for child in self._metrics[name]:
            child.observe(value)

    def close(self) -> None:
        """Stop recording and serving."""
        with contextlib.suppress(ValueError):
            self.engine.output_processor.listeners.remove(self)
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self._thread.join(5)
