"""Engine settings by concern (model, cache, scheduler, parallelism, LoRA), the flags that set them, log formats.

:func:`add_settings_args` is the one generator of the commands' flags, for every settings dataclass.
"""

import argparse
import contextvars
import dataclasses
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Literal, TextIO, get_args, get_origin, get_type_hints

import msgspec

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_size(value: int | str) -> int:
    """Turn ``"2GiB"``, ``"512MB"``, ``"1e9"`` or an int into a number of bytes."""
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
        unit = match and match.group(2).lower()
        if not match or unit not in _UNITS:
            raise ValueError(f"kv_cache_memory={value!r} is not a size: write it like '2GiB', '512MiB' or 1073741824")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"kv_cache_memory={value!r} must be a positive size")
    return size


Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["auto", "none", "int8", "int4"]
Device = Literal["auto", "cpu", "cuda"]
SchedulingPolicy = Literal["fcfs", "priority"]
ReasoningParserName = Literal["deepseek_r1", "qwen3"]


def check_choices(settings: object) -> None:
    """Refuse a value outside its ``Literal`` type, for every such field of a settings dataclass (the one check).

    Raises:
        ValueError: naming the field, the value and the values allowed.

    """
    for name, kind in get_type_hints(type(settings)).items():
        if get_origin(kind) is Literal and getattr(settings, name) not in get_args(kind):
            raise ValueError(f"{name}={getattr(settings, name)!r} must be one of {', '.join(get_args(kind))}")


def _check_at_least(settings: object, minimum: int, *names: str) -> None:
    for name in names:
        if getattr(settings, name) < minimum:
            raise ValueError(f"{name}={getattr(settings, name)} must be >= {minimum}")


@dataclass(frozen=True)
class ModelConfig:
    """Which model the engine serves, how, and where.

    Attributes:
        model: a Hugging Face model directory, a ``.gguf`` file, or ``None`` for the embedded SmolLM2-135M-Instruct.
        dtype: ``auto``, ``float32``, ``bfloat16`` or ``float16`` for weights, activations and the KV cache.
        quantization: quantization of the projections: ``auto`` (a GGUF file's own Q4_0/Q4_1/Q4_K as int4,
            Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 as int8, each projection of a file that mixes them at its own width and those
            of other types at int8; other models unquantized), ``none``, ``int8`` (per output row) or ``int4``
            (groups of 32 inputs); quantized at load where the checkpoint is not. The lm head stays at 8 bits
            under int4. Weight-only, except ``int8`` on a CPU with AVX-512 VNNI, which quantizes the activations
            too, per 64 inputs, on the fly (W8A8: past the bf16 matmul rate, perplexity +0.6% against bf16 on
            SmolLM2).
        device: ``auto`` (CUDA when present, else CPU), ``cpu`` or ``cuda``.
        max_model_len: longest prompt + completion; defaults to the model's ``max_position_embeddings``.
        enforce_eager: run torch's own ops only, as vLLM's flag does: on CUDA no decode steps replayed from CUDA
            graphs; on the CPU the torch references in place of the C++ kernels the backend otherwise compiles for
            the machine at its first start (the attention, norms, rotary, SwiGLU, bf16 and quantized projections):
            no compiler needed, for a slower engine (``bench.offline_throughput --enforce-eager`` measures it).

    """

    model: str | None = None
    dtype: Dtype = "auto"
    quantization: Quantization = "auto"
    device: Device = "auto"
    max_model_len: int | None = None
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        check_choices(self)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: its blocks and how much memory it may take.

    Attributes:
        block_size: tokens per KV cache block.
        kv_cache_memory: KV cache size on the CPU, e.g. ``"2GiB"``.
        gpu_memory_utilization: fraction of GPU memory the engine may use (weights, activations, KV cache).
        enable_prefix_caching: share full KV blocks between sequences with the same prefix.

    """

    block_size: int = 16
    kv_cache_memory: int | str = "2GiB"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        object.__setattr__(self, "kv_cache_memory", parse_memory_size(self.kv_cache_memory))


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold, and in which order requests get the steps.

    Attributes:
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: the per-step token budget that chunked prefill splits long prompts against.
        max_decode_slowdown: how much slower than their decodes alone the steps may get, on average, from the
            prefill chunks beside them (an estimate from a cost model): bounds the inter-token latency of running
            streams while a long prompt is prefilled, at the price of that prompt's time to first token. ``0`` turns
            the bound off, so chunks fill ``max_num_batched_tokens`` (best throughput; ``LLM``'s default).
        long_prefill_token_threshold: prompts longer than this many tokens are long (vLLM's term): only their
            prefill is held to ``max_decode_slowdown``; shorter ones are prefilled whole beside the streams, so that
            a burst of them is not starved by a few streams' bound. ``0``: every prompt is held to it.
        scheduling_policy: ``fcfs`` (first come, first served; a request's ``priority`` is ignored) or ``priority``
            (lower ``priority`` first, then arrival, as vLLM's: the lowest-priority running request is preempted
            first, also to make room for a better waiting one).
        priority_aging: under ``priority``, the seconds since arrival worth one priority level: requests rank by
            ``arrival + priority * priority_aging``, which bounds starvation, as a request is never overtaken by one
            ``d`` levels better that arrived more than ``d * priority_aging`` seconds after it. ``0`` is strict
            priority (vLLM's), where a stream of better requests can starve a worse one.
        stream_buffer_outputs: outputs an ``AsyncLLMEngine`` stream holds unread (64; a gRPC stream reads up to
            ``max_unread_outputs`` ahead of these) before its request is paused in the backend: no tokens are
            scheduled for it, though it keeps its KV blocks, until its reader has taken half of them. So a stream
            nobody reads costs no compute; its frontend still aborts it after ``unread_timeout`` (gRPC).
        adaptive_drafts: each step verifies only the draft tokens (``num_speculative_tokens``) worth their cost: the
            drafts that give the most expected tokens per second, by each sequence's acceptance so far and the step
            times measured by token count. Off: every draft found, up to ``num_speculative_tokens`` (vLLM's way),
            which slows the steps down where the projections are compute-bound (batches; one stream on AVX2).

    """

    # 256, as vLLM: measured on 2 Zen 4 cores (bf16 SmolLM2, `LLM.generate` of 512 requests, two passes in opposite
    # orders), the rate does not depend on it from 64 up: 512 short prompts x 128 tokens 798 and 835 tok/s at 64,
    # 794 and 868 at 128, 808 and 868 at 256, 779 and 901 at 512; prompts of 10-160 words x 64 tokens 423-472 at 64
    # to 256, 417-431 at 512. A decode step's projections are compute-bound from ~12 rows here (reading the weights
    # takes ~8 ms at the 34 GB/s measured, their FLOPs ~0.7 ms a row), so the limit only trades a burst's queueing
    # (time to first token) against the length of each step (inter-token latency).
    max_num_seqs: int = 256
    # 2048, as vLLM's API server: measured on 2 Zen 4 cores (bf16 SmolLM2, `bench.serving`, 64 prompts at once),
    # 512 served 78-87% of `LLM.generate`'s rate through gRPC in six runs, 1024 93-99% and 2048 80-99% in two and
    # four: the burst's prompts took three steps, not one, and finished in three waves. In `LLM`, 2048 against 512:
    # a fresh 1k prompt 773-919 against 631-732 tok/s, 4k 358-391 against 310-327. A smaller budget trades that
    # for shorter steps while a burst of short prompts is prefilled (inter-token p99 ~300 ms against ~100 there).
    max_num_batched_tokens: int = 2048
    max_decode_slowdown: float = 2.0
    long_prefill_token_threshold: int = 256
    scheduling_policy: SchedulingPolicy = "fcfs"
    priority_aging: float = 10.0
    stream_buffer_outputs: int = 64
    adaptive_drafts: bool = True

    def __post_init__(self) -> None:
        check_choices(self)
        _check_at_least(self, 1, "stream_buffer_outputs")
        _check_at_least(self, 1, "max_num_seqs", "max_num_batched_tokens")
        _check_at_least(self, 0, "long_prefill_token_threshold")
        if self.max_decode_slowdown != 0 and self.max_decode_slowdown < 1:
            raise ValueError(f"max_decode_slowdown={self.max_decode_slowdown} must be 0 (no bound) or >= 1")
        if not 0 <= self.priority_aging < math.inf:
            raise ValueError(f"priority_aging={self.priority_aging} must be >= 0 seconds (0: no aging)")


@dataclass(frozen=True)
class ParallelConfig:
    """How the engine spreads over processes, machines and cores.

    Attributes:
        tensor_parallel_size: processes (ranks) the model is sharded over, Megatron-style, with ``torch.distributed``
            (NCCL on CUDA, gloo on the CPU); rank 0 runs the engine core, the others are workers (:doc:`scaling`).
        nnodes: machines the ranks are spread over; each runs ``tensor_parallel_size / nnodes`` of them.
        node_rank: this machine's index among ``nnodes``: 0 runs the engine core, the others only workers.
        master_addr: the address of node 0 for the ``torch.distributed`` rendezvous; unset: ``MASTER_ADDR`` from
            the environment (as ``torchrun`` sets it), else ``127.0.0.1``.
        master_port: the rendezvous port on node 0; unset: ``MASTER_PORT`` from the environment, else (one node
            only) a free port.
        cpu_threads: torch's threads in each process of the engine; unset: the machine's cores divided among the
            processes of this node (tensor parallel ranks). Data-parallel engines that one ``spindle serve`` starts
            get the cores divided among them: threads that outnumber the cores stall each other's steps.
        collective_timeout: seconds a rank waits in one ``torch.distributed`` collective before it fails, and with it
            the engine: a rank that died or is wedged (stopped, or stuck in a kernel) is found within this time.
            Idle workers do not wait out this time for the next step: rank 0 exchanges a keep-alive with them at a
            quarter of it. It must exceed the longest step's time between two collectives.

    """

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    cpu_threads: int | None = None
    collective_timeout: float = 600.0

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "tensor_parallel_size", "nnodes")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of nnodes={self.nnodes}: "
                "every node runs the same number of ranks"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads={self.cpu_threads} must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if not 0 < self.collective_timeout < math.inf:
            raise ValueError(f"collective_timeout={self.collective_timeout} must be a positive number of seconds")


@dataclass(frozen=True)
class LoraConfig:
    """Which LoRA adapters the engine serves, and how many at once.

    Attributes:
        lora_modules: LoRA adapters loaded at start-up, ``name=path`` of a PEFT adapter directory each (on the
            command line ``--lora-modules sql=/adapters/sql chat=/adapters/chat``); requests pick one by name.
        max_loras: adapter slots in memory: the most distinct adapters one step may use; more adapters may be
            loaded, and the least recently used one leaves its slot for the one a new request needs.
        max_lora_rank: the largest rank ``r`` an adapter may have (the slots are sized for it).
        allow_runtime_lora: accept ``LoadLoraAdapter``/``UnloadLoraAdapter`` calls (off: a request must not make
            the server read files unless the operator allows it).
        lora_dir: the directory runtime-loaded adapters must lie in (required with ``allow_runtime_lora``).
        max_loaded_loras: the most adapter names loaded at once (start-up ones included); one more load is refused
            with ``RESOURCE_EXHAUSTED``. Each distinct adapter's weights stay in host memory (a rank-16 adapter of
            every projection of an 8B model: ~130 MB in bf16); a name for the same files as a loaded one shares
            its weights.

    """

    lora_modules: dict[str, str] | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    allow_runtime_lora: bool = False
    lora_dir: str | None = None
    max_loaded_loras: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.lora_modules, list | tuple):  # from the command line: name=path strings
            object.__setattr__(self, "lora_modules", parse_named(self.lora_modules, "lora module", "path"))
        _check_at_least(self, 1, "max_loras", "max_lora_rank", "max_loaded_loras")
        if self.allow_runtime_lora and not self.lora_dir:
            raise ValueError("allow_runtime_lora needs lora_dir: the directory runtime-loaded adapters must lie in")


@dataclass(frozen=True)
class RecoveryConfig:
    """What the frontend does with the requests of a backend that dies (a backend ignores these settings).

    Attributes:
        resume_streams: send each request in flight on a backend that dies again, as its prompt and the tokens it
            has streamed, to the backend that takes over (or another data-parallel engine that serves), so that its
            stream pauses and goes on where it was, greedy and seeded ones token for token (default on); off,
            those streams fail with ``EngineDeadError`` (``UNAVAILABLE``).
        max_stream_resumes: the most times one request is resumed (default 3); when its backend dies once more, its
            stream fails with ``EngineDeadError``.

    """

    resume_streams: bool = True
    max_stream_resumes: int = 3

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "max_stream_resumes")


@dataclass(frozen=True)
class BackendConfig:
    """How a backend process serves its frontends: when it counts as hung, who may talk to it, and how much at once.

    Attributes:
        step_timeout: seconds one turn of the backend's step loop (taking in what the frontends sent, then one
            step) may last before the frontends declare the backend hung, as if it had stopped answering (the one
            that started it replaces it; ``spindle backend --check`` fails). Generous, as one step may prefill
            ``max_num_batched_tokens`` tokens: 2,048 tokens of an 8B model are ~33 TFLOP, minutes on a few CPU cores.
        zmq_secret_file: a file holding a secret of at least 32 characters that the backend and its frontends
            share: the backend then takes messages only from peers that hold it (CURVE keys derived from it), and
            the traffic is encrypted. Required by a backend that listens on TCP beyond loopback; unset, any process
            that reaches the socket may talk to the backend.
        max_message_size: the largest message, in bytes, the backend takes: a peer that sends a larger one is
            disconnected, and a frontend refuses to send one (a request with very many images, say).

    """

    step_timeout: float = 300.0
    zmq_secret_file: str | None = None
    max_message_size: int = 64 * 2**20

    def __post_init__(self) -> None:
        if not 0 < self.step_timeout < math.inf:
            raise ValueError(f"step_timeout={self.step_timeout} must be a positive number of seconds")
        _check_at_least(self, 2**10, "max_message_size")


@dataclass(frozen=True)
class StructuredOutputConfig:
    """How the engine compiles structured-output specs (JSON schemas, regexes, grammars) to grammars.

    Attributes:
        grammar_compile_workers: worker processes that compile specs, started at the first constrained request (each
            takes ~300 MB with xgrammar and torch loaded). Two, so that one spec slow to compile holds up no other
            request's compile.
        grammar_compile_timeout: seconds one spec's compile may run in its worker before the worker is killed and
            the request refused (``INVALID_ARGUMENT``); the spec then stays refused for ten minutes. Ordinary schemas
            compile in milliseconds (100 properties in 30 ms on SmolLM2's vocabulary), pathological ones take
            minutes.
        reasoning_parser: how a reasoning model writes its thoughts, so that outputs carry them apart from the
            answer as ``reasoning_content``: ``deepseek_r1`` (the text is thinking until ``</think>``) or ``qwen3``
            (a ``<think>`` block when the text starts with one); none by default
            (:mod:`spindle.frontend.processing.reasoning`).

    """

    grammar_compile_workers: int = 2
    grammar_compile_timeout: float = 10.0
    reasoning_parser: ReasoningParserName | None = None

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "grammar_compile_workers")
        if not 0 < self.grammar_compile_timeout < math.inf:
            raise ValueError(f"grammar_compile_timeout={self.grammar_compile_timeout} must be > 0 seconds")


@dataclass(frozen=True)
class SamplingConfig:
    """What the sampler may run besides its own stages.

    Attributes:
        logits_processors: logits processor classes requests may select by name, ``name=module:Class`` each (on the
            command line ``--logits-processors ban=myproj.ban:BanTokens``), beside Spindle's own and those of the
            ``spindle.logits_processors`` entry point group (:mod:`spindle.backend.logits_processors`). The module
            must import in the backend process.

    """

    logits_processors: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logits_processors, list | tuple):  # from the command line: name=module:Class strings
            named = parse_named(self.logits_processors, "logits processor", "module:Class")
            object.__setattr__(self, "logits_processors", named)


SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}
SECTIONS["lora"] = LoraConfig
SECTIONS["recovery"] = RecoveryConfig
SECTIONS["backend"] = BackendConfig
SECTIONS["structured_output"] = StructuredOutputConfig
SECTIONS["sampling"] = SamplingConfig
"""The parts of :class:`EngineConfig`, each one concern's settings, by attribute name."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs to start, by concern.

    Build it from flat settings, as ``LLM(...)`` and the command line give them, with :meth:`of`:
    ``EngineConfig.of(model="...", kv_cache_memory="1GiB")``; every setting names its part (they are listed on
    :doc:`configuration`). A backend process started by a frontend gets it encoded as a struct.

    Attributes:
        model: which model, its dtype, quantization and device (:class:`ModelConfig`).
        cache: the KV cache (:class:`CacheConfig`).
        scheduler: the step's limits and the queue order (:class:`SchedulerConfig`).
        parallel: tensor parallelism and threads (:class:`ParallelConfig`).
        lora: LoRA adapters (:class:`LoraConfig`).
        recovery: the frontend's handling of a backend's death (:class:`RecoveryConfig`).
        backend: the backend process's liveness limit, socket secret and message size (:class:`BackendConfig`).
        structured_output: grammar compiles (:class:`StructuredOutputConfig`).
        sampling: the logits processors requests may select (:class:`SamplingConfig`).

    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    @classmethod
    def of(cls, **settings: object) -> "EngineConfig":
        """The configuration of the given flat settings (the others at their defaults).

        Raises:
            TypeError: a setting no part has.
            ValueError: a value out of its range.

        """
        return cls().replace(**settings)

    def replace(self, **settings: object) -> "EngineConfig":
        """A copy with the given flat settings changed, each in its part.

        Raises:
            TypeError: a setting no part has.
            ValueError: a value out of its range.

        """
        unknown = set(settings) - set(_PART_OF)
        if unknown:
            raise TypeError(f"unknown engine settings {sorted(unknown)}: see spindle.shared.config for the settings")
        parts = {}
        for part in SECTIONS:
            changed = {name: value for name, value in settings.items() if _PART_OF[name] == part}
            if changed:
                parts[part] = dataclasses.replace(getattr(self, part), **changed)
        return dataclasses.replace(self, **parts)

    def settings(self) -> dict[str, object]:
        """The flat settings, each part's fields (what :meth:`of` takes)."""
        return {name: getattr(getattr(self, part), name) for name, part in _PART_OF.items()}


_PART_OF = {f.name: part for part, section in SECTIONS.items() for f in fields(section)}


def parse_named(specs: list[str] | tuple[str, ...], what: str, value: str) -> dict[str, str]:
    """``["name=value", ...]`` (``--lora-modules``, ``--logits-processors``) as a dict.

    A malformed entry or a repeated name is refused; ``what`` and ``value`` name the entries and their values in the
    errors.
    """
    named: dict[str, str] = {}
    for spec in specs:
        name, sep, given = spec.partition("=")
        if not sep or not name or not given:
            raise ValueError(f"{what} {spec!r} must be written name={value}")
        if name in named:
            raise ValueError(f"{what} name {name!r} is given twice")
        named[name] = given
    return named


def attribute_help(cls: type) -> dict[str, str]:
    """The one-line help of each field, from the ``Attributes:`` section of a dataclass's docstring (for --help)."""
    section = (cls.__doc__ or "").partition("Attributes:")[2]
    entries = re.findall(r"^\s{4,8}(\w+): (.+?)(?=^\s{4,8}\w+: |\Z)", section, flags=re.MULTILINE | re.DOTALL)
    return {name: " ".join(text.split()) for name, text in entries}


def add_settings_args(parser: argparse.ArgumentParser, *classes: type) -> None:
    """Add one ``--flag`` per field of each settings dataclass, defaulting to ``SPINDLE_<FIELD>`` from the environment.

    The one generator of the commands' flags (:class:`EngineConfig`'s parts for ``spindle serve`` and ``spindle
    backend``, ``ServerConfig`` for ``spindle serve``): the type of each flag is its field's annotation (a
    ``Literal`` gives its choices, a ``bool`` a ``--flag``/``--no-flag`` pair, a ``dict[str, str]`` ``NAME=VALUE``
    pairs and a ``list[str]`` one or more values, both space-separated in the environment), its help the field's
    line in the class's ``Attributes:``.
    """
    for cls in classes:
        # argparse %-formats help strings (%(default)s): a literal % must be %%.
        helps = {name: text.replace("%", "%%") for name, text in attribute_help(cls).items()}
        for f, kind in ((f, get_type_hints(cls)[f.name]) for f in fields(cls)):
            flag = "--" + f.name.replace("_", "-")
            default = os.environ.get(f"SPINDLE_{f.name.upper()}", f.default)
            kinds = (kind,) if get_origin(kind) is Literal else get_args(kind) or (kind,)
            if kind is bool:
                if isinstance(default, str):
                    default = default.lower() in ("1", "true", "yes", "on")
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=helps[f.name])
            elif dict[str, str] in kinds:
                value = default.split() if isinstance(default, str) else None
                parser.add_argument(flag, nargs="*", metavar="NAME=VALUE", default=value, help=helps[f.name])
            elif list[str] in kinds:
                value = default.split() if isinstance(default, str) else default
                parser.add_argument(flag, nargs="+", metavar="NAME", default=value, help=helps[f.name])
            else:
                literal = next((k for k in kinds if get_origin(k) is Literal), None)
                convert = str if str in kinds else next((k for k in (int, float) if k in kinds), str)
                parser.add_argument(
                    flag,
                    type=convert,
                    choices=get_args(literal) if literal is not None else None,
                    default=None if default is None else convert(default),
                    help=helps[f.name],
                )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags of every :class:`EngineConfig` setting (:func:`add_settings_args` over its parts)."""
    add_settings_args(parser, *SECTIONS.values())


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the :class:`EngineConfig` from flags added by :func:`add_engine_args`."""
    return EngineConfig.of(**{name: getattr(args, name) for name in _PART_OF})


def config_to_json(config: EngineConfig) -> str:
    """``config`` as JSON, every field (nested dataclasses too) as msgspec encodes it.

    It is how a frontend hands a backend child its whole configuration (``spindle backend --engine-config``), so that
    no field has to have a flag that rebuilds it.
    """
    return msgspec.json.encode(config).decode()


def config_from_json(text: str) -> EngineConfig:
    """The :class:`EngineConfig` that :func:`config_to_json` encoded; its checks (``__post_init__``) run again.

    Raises:
        ValueError: a field has the wrong type, or a check refuses its value (a ``msgspec.ValidationError``).

    """
    return msgspec.json.decode(text, type=EngineConfig)


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    """The ``spindle backend`` flags: the engine's, where to listen, and the SIGTERM grace period."""
    add_engine_args(parser)
    parser.add_argument(
        "--listen",
        default=os.environ.get("SPINDLE_LISTEN", "ipc:///tmp/spindle/engine.sock"),
        help="ZeroMQ address to bind: ipc:///path/engine.sock or tcp://127.0.0.1:PORT",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=float(os.environ.get("SPINDLE_GRACE_PERIOD", 30)),
        help="seconds in-flight requests may take to finish after SIGTERM before they are aborted",
    )
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    # start_backend hands its child the whole EngineConfig as JSON (config_to_json), in place of the engine's flags.
    parser.add_argument("--engine-config", default=None, help=argparse.SUPPRESS)
    # start_backend made the ipc socket's directory for this backend: remove it (if empty) on exit.
    parser.add_argument("--remove-socket-dir", action="store_true", help=argparse.SUPPRESS)
    add_log_args(parser)


LOG_FORMATS = ("text", "json")
"""The values of ``--log-format``: ``text`` lines for people, ``json`` objects (one a line) for log collectors."""

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("spindle_request_id", default=None)
"""The id of the request that the running code serves; every log line emitted meanwhile carries it.

``AsyncLLMEngine`` sets it for the code that consumes a request's stream (a gRPC call's task); code that works for
many requests at once names one with ``logger.info(..., extra={"request_id": request_id})`` instead.
"""

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_configured_format: str | None = None


def add_log_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--log-format`` (default ``SPINDLE_LOG_FORMAT``, else ``text``) to a server command's parser."""
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get("SPINDLE_LOG_FORMAT", "text"),
        help="log lines as text, or as JSON objects, one a line: timestamp, level, logger, message, request_id",
    )


class _RequestIdFilter(logging.Filter):
    """Gives every record a ``request_id``: the one passed in ``extra``, else :data:`request_id_var`'s."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


# Line breaks and other control characters (C0, DEL, C1, the Unicode line and paragraph separators) that text from
# users may carry into a log record (a request id, an error that quotes a request): written as escapes, that text
# stays on its record's line and sends a terminal no commands.
_CONTROL_CODES = (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)
_TEXT_ESCAPES = {code: repr(chr(code))[1:-1] for code in _CONTROL_CODES}
# A traceback keeps its own line breaks and tabs; its lines are indented instead (see _TextFormatter).
_TRACEBACK_ESCAPES = {code: escape for code, escape in _TEXT_ESCAPES.items() if chr(code) not in "\n\t"}
# JSON escapes the C0 controls itself; the others are valid raw in a JSON string but break lines for some readers.
_JSON_ESCAPES = {code: f"\\u{code:04x}" for code in _CONTROL_CODES if code >= 0x7F}
_TRACEBACK_INDENT = "    "


class _TextFormatter(logging.Formatter):
    """The plain format, with `` [request_id=...]`` after the message of a line about a request.

    Each record is one line that starts at column 0, its control characters escaped (newlines too), so that no
    request id or quoted request can forge a line of the log; a traceback follows on lines of its own, each
    indented.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        """The record's line: the format with its message, and the request id it is about."""
        line = super().formatMessage(record).translate(_TEXT_ESCAPES)
        request_id = getattr(record, "request_id", None)
        if request_id is None:
            return line
        return f"{line} [request_id={str(request_id).translate(_TEXT_ESCAPES)}]"

    def format(self, record: logging.LogRecord) -> str:
        """The record's line, then its traceback or stack (if any) indented, so that none of its lines pass for one."""
        line, _, traceback = super().format(record).partition("\n")
        if not traceback:
            return line
        lines = traceback.translate(_TRACEBACK_ESCAPES).split("\n")
        return "\n".join([line, *(_TRACEBACK_INDENT + part for part in lines)])


class JsonLogFormatter(logging.Formatter):
    """Formats each record as one JSON object on one line.

    Its keys: ``timestamp`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``, ``message``, and when there is one,
    ``request_id``, ``exception`` (the formatted traceback) and ``stack``.
    """

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON (line breaks and control characters in any value are escaped)."""
        timestamp = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        entry = {
            "timestamp": timestamp.replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str).translate(_JSON_ESCAPES)


def configure_logging(log_format: str = "text", level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """Send every log record (warnings too) to ``stream`` (stderr) in ``log_format``, replacing earlier handlers.

    A backend child started afterwards by :func:`~spindle.frontend.engine.connection.start_backend` logs in the same
    format.

    Raises:
        ValueError: ``log_format`` is neither ``text`` nor ``json`` (e.g. a mistyped ``SPINDLE_LOG_FORMAT``).

    """
    global _configured_format
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} must be one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLogFormatter() if log_format == "json" else _TextFormatter(_TEXT_FORMAT))
    handler.addFilter(_RequestIdFilter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)  # so that a JSON log holds no stray warning text
    _configured_format = log_format


def configured_log_format() -> str | None:
    """The format :func:`configure_logging` last set in this process, or ``None`` if it was never called."""
    return _configured_format
