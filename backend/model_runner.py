"""Runs the model on each step's scheduler output: builds the flat batch, owns the KV cache, samples.

:meth:`ModelRunner.execute` takes a :class:`~spindle.backend.scheduler_output.SchedulerOutput` and
:meth:`ModelRunner.sample` returns a :class:`~spindle.backend.runner_output.RunnerOutput`; between them the runner
keeps its own state of each sequence, and never sees the scheduler's.
"""

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, islice
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from spindle.backend import parallel
from spindle.backend.encoder_cache import EncoderCache
from spindle.backend.input_buffers import InputBuffers, StepInputs
from spindle.backend.logits_processors import LogitsProcessors
from spindle.backend.lora_manager import LoraManager
from spindle.backend.memory import KVBudget, MemoryMeter, kv_cache_budget, release_freed_heap
from spindle.backend.models.checkpoint_config import CheckpointConfig, Shard
from spindle.backend.models.loader import (
    MIXED,
    load_model,
    quantized_weights,
    resolve_dtype,
    resolve_quantization,
)
from spindle.backend.parallel import TensorParallel
from spindle.backend.pooler import pool
from spindle.backend.runner_output import RunnerOutput
from spindle.backend.runner_state import SequenceState, apply_scheduler_output
from spindle.backend.sampler import LogprobTensors, Sampler, SampleRow
from spindle.backend.scheduler_output import SchedulerOutput
from spindle.backend.speculative import accepted_tokens
from spindle.backend.structured_output import GrammarBitmask
from spindle.backend.transfers import fetch, to_device
from spindle.kernels import AttentionMetadata, eager, huge_pages
from spindle.kernels.cpu import cpu_ops
from spindle.kernels.lora import LoraMapping, lora_mapping
from spindle.shared import SamplingParams
from spindle.shared.config import EngineConfig
from spindle.shared.lora import LoraAdapterInfo
from spindle.shared.protocol import ImageInput, KVCacheReport, kv_block_bytes
from spindle.shared.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def decode_graph_sizes(max_batch: int) -> list[int]:
    """The decode batch sizes captured as CUDA graphs: 1, 2, 4, then every multiple of 8, up to ``max_batch``.

    A decode step of ``n`` sequences replays the smallest captured size ``>= n``, so at most 7 rows are padding.
    """
    sizes = [s for s in (1, 2, 4, *range(8, max_batch + 1, 8)) if s <= max_batch]
    return sizes if sizes[-1] == max_batch else [*sizes, max_batch]


class DecodeGraphs:
    """CUDA graphs of a decode step, one per size of :func:`decode_graph_sizes`, over shared static inputs.

    A step of ``n`` sequences is copied into the first ``n`` rows of the inputs and replays the smallest graph of
    at least ``n`` rows. The padding rows keep the valid ids, positions and block ids they last held, with a
    context of one token and cache slot ``-1``, which the Triton cache write skips: they compute rows that are
    dropped and write nothing.

    Args:
        model: the model; on CUDA called once per size to compile the kernels, then once under capture.
        kv_caches: the allocated KV cache, one ``(k_cache, v_cache)`` per layer.
        max_batch: the largest decode batch to capture.
        max_model_len: the longest context a replay may have (it sizes the decode kernel's context split).
        block_size: tokens per cache block.

    """

    @torch.inference_mode()
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        device = kv_caches[0][0].device
        self.sizes = decode_graph_sizes(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, -(-max_model_len // block_size), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        # Largest first, so that the smaller graphs fit in the memory the larger ones already took from the pool.
        for size in reversed(self.sizes):
            args = (self.input_ids[:size], self.positions[:size], self._metadata(size, max_model_len), kv_caches)
            if pool is None:
                # Nothing to capture on the CPU: a replay runs the same forward over the static inputs eagerly,
                # which is how the tests check the padding under Triton's interpreter.
                self._steps[size] = partial(model, *args)
                continue
            model(*args)  # compiles the kernels for these shapes outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = model(*args)
            self._steps[size] = partial(_replay, graph, output)

    def _metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        # The host lists are stand-ins: the Triton decode path reads only the tensors and max_seq_len.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            num_decodes=size,
            max_seq_len=max_seq_len,
            query_lens_list=[1] * size,
            seq_lens_list=[max_seq_len] * size,
        )

    @property
    def max_batch(self) -> int:
        """The largest decode batch a graph holds."""
        return self.sizes[-1]

    def replay(self, step: StepInputs) -> torch.Tensor:
        """Run a decode-only step; returns its hidden states ``[n, hidden]``.

        The inputs are copied on the device into the graphs' own; the rows returned are a view of the graph's output,
        overwritten by the next replay.
        """
        meta = step.meta
        num = step.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num)
        self.input_ids[:num].copy_(step.input_ids)
        self.positions[:num].copy_(step.positions)
        self.slot_mapping[:num].copy_(meta.slot_mapping)
        self.slot_mapping[num:size].fill_(-1)
        self.seq_lens[:num].copy_(meta.seq_lens)
        self.seq_lens[num:size].fill_(1)
        self.block_tables[:num, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        return self._steps[size]()[:num]


def sample_rows(state: SequenceState, drafts: list[int]) -> list[SampleRow]:
    """What the sampler needs of each of the ``len(drafts) + 1`` rows a sequence samples this step.

    Row ``i`` counts the first ``i`` drafts as output, as they would be once accepted (penalties and ``min_tokens``
    see them), and samples their next position, so each row draws its own random numbers.
    """
    tokens = state.token_ids
    if not drafts:  # a step's usual case, built without the loop
        return [SampleRow(state.params, state.seed, tokens, state.num_prompt_tokens)]
    return [
        SampleRow(state.params, state.seed, tokens + drafts[:i] if i else tokens, state.num_prompt_tokens)
        for i in range(len(drafts) + 1)
    ]


def _enforce_eager_if_configured(
    method: "Callable[Concatenate[ModelRunner, P], R]",
) -> "Callable[Concatenate[ModelRunner, P], R]":
    """Run a :class:`ModelRunner` method within ``spindle.kernels.eager`` when the engine enforces eager mode."""

    @functools.wraps(method)
    def run(runner: "ModelRunner", *args: P.args, **kwargs: P.kwargs) -> R:
        with eager(runner.config.model.enforce_eager):
            return method(runner, *args, **kwargs)

    return run


def _replay(graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> torch.Tensor:
    graph.replay()
    return output


@dataclass
class _ExecutedStep:
    """What :meth:`ModelRunner.execute` leaves for :meth:`ModelRunner.sample`: the step's layout and results so far.

    Attributes:
        start: when the step began (``time.perf_counter``).
        states: the step's sequences, in batch order.
        query_start_loc: where each one's tokens start in the flat batch, and the batch's end.
        sampling: the indices in ``states`` of those that sample, with their drafts; their rows come first among
            the logits, in that order, ``1 + len(drafts)`` each.
        spans: the prompt log-probability positions computed (:func:`_prompt_spans`); their rows follow.
        hidden: the step's hidden states.
        logits: the logits of the rows, or None without any.

    """

    start: float
    states: list[SequenceState]
    query_start_loc: list[int]
    sampling: list[tuple[int, list[int]]]
    spans: list[tuple[SequenceState, int, int, int]]
    hidden: torch.Tensor
    logits: torch.Tensor | None


@dataclass(frozen=True)
class ImageSpec:
    """What a vision-language model takes as an image (the engine core checks requests' images against it).

    Attributes:
        shape: the pixel array's shape, ``[channels, height, width]``.
        num_tokens: the placeholder tokens (embeddings) an image has in the prompt.
        token_id: the placeholder token.

    """

    shape: tuple[int, ...]
    num_tokens: int
    token_id: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ImageSpec":
        """The spec of a model that takes images (``supports_images``)."""
        return cls(tuple(model.image_shape), model.num_image_tokens, model.image_token_id)


class ModelRunner:
    """Owns the model weights, the KV cache, the sampler and its own state of each sequence; runs one step at a time.

    A step is two calls: :meth:`execute` applies the :class:`~spindle.backend.scheduler_output.SchedulerOutput` to the
    runner's state of each sequence (:class:`~spindle.backend.runner_state.SequenceState`, keyed by ``seq_id``), and
    runs one forward pass over a flat batch of tokens (no padding): decodes first, then prefill chunks, each token
    with its position and the cache slot its K/V goes to, and the LM head over the rows anything needs. On CUDA that
    is queued on the device and returns at once; :meth:`sample` then takes the step's grammar bitmask (filled on the
    CPU meanwhile), samples, verifies drafts, pools and computes prompt log-probabilities, and returns the step's
    :class:`~spindle.backend.runner_output.RunnerOutput`, waiting for the device once. On CUDA the kernels are
    Triton's, and a decode-only step replays a CUDA graph captured for its batch size rounded up
    (:func:`decode_graph_sizes`).

    The runner owns each feature's device-side state: the LoRA adapters' slots (``lora``), the image embeddings
    (``encoder_cache``), the embedding sequences' pooling states and the prompt log-probabilities under way (in
    each sequence's state).

    A step whose sequences use LoRA adapters has each sequence's adapter put in a device slot (``lora``), orders
    its sequences by slot within the decodes and within the prefill chunks (so that a slot's tokens are at most two
    runs) and runs eagerly: the decode graphs are captured without LoRA, and a step with adapters is never replayed.
    Steps of the base model alone run exactly as without LoRA.

    With ``enforce_eager`` the steps (and the start-up's profile pass and weight preparation) run within
    ``spindle.kernels.eager``: torch's ops alone on the CPU, where nothing is compiled, and no CUDA graphs.

    Under tensor parallelism (``tensor_parallel_size > 1``) every rank has a runner over its
    :class:`~spindle.backend.models.checkpoint_config.Shard` of the model and of the KV cache (its KV heads). Rank 0's
    :meth:`execute` broadcasts each step's scheduler output to the workers, whose :meth:`follow` runs the same
    :meth:`execute` on it; rank 0 alone samples, prompt log-probabilities and pools. Decodes run eagerly (no CUDA
    graphs) and LoRA is refused.

    Attributes:
        decode_graphs: the CUDA graphs of decode steps, or None (on the CPU, before :meth:`init_cache`, with
            ``enforce_eager``, or under tensor parallelism).
        lora: the LoRA adapters and the device's adapter slots.
        states: the runner's state of each sequence it runs, by ``seq_id``.
        encoder_cache: the image embeddings of a vision-language model, by image content.
        is_pooling_model: the model has no LM head: it serves embedding requests only.
        image_input: what a vision-language model takes as an image, or None for a text model.
        kv_budget: how :meth:`init_cache` sized the KV cache on CUDA, its inputs and result (None on the CPU and
            before it).
        kv_cache_report: the same for any device, as the engine reports it to its frontends (None before
            :meth:`init_cache`).

    """

    def __init__(self, config: EngineConfig, checkpoint: CheckpointConfig, model_dir: Path, rank: int = 0) -> None:
        self.config = config
        self.checkpoint = checkpoint
        self.block_size = config.cache.block_size
        self.parallel = TensorParallel.of(config, rank)
        parallel.set_current(self.parallel)
        self.shard = Shard.of(checkpoint, rank, self.parallel.size)
        use_cuda = config.model.device == "cuda" or (config.model.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if use_cuda else "cpu")
        if self.parallel.size > 1 and use_cuda:
            self.device = torch.device("cuda", self.parallel.local_rank)
            torch.cuda.set_device(self.device)
        if config.parallel.cpu_threads is not None or self.parallel.size > 1:
            # The node's ranks (or data-parallel engines) share its cores: oversubscribed threads spin against each
            # other, a step of one waiting on a thread that another's has descheduled.
            torch.set_num_threads(
                config.parallel.cpu_threads or max(1, (os.cpu_count() or 1) // self.parallel.local_size)
            )
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.kv_budget: KVBudget | None = None
        self.kv_cache_report: KVCacheReport | None = None
        if self.device.type == "cuda":
            # Before the weights: the KV budget counts what this process takes from here on (spindle.backend.memory).
            self.memory = MemoryMeter(self.device)
        start = time.perf_counter()
        self.model = load_model(model_dir, self.dtype, self.device)
        self.is_pooling_model = self.model.is_pooling_model
        bits = resolve_quantization(config.model.quantization, model_dir)
        with eager(config.model.enforce_eager):
            self.model.prepare_weights(quantized_weights(self.model, model_dir, bits) if bits else None)
        logger.info(
            "Loaded %s (%s, %s) in %.1f s",
            model_dir,
            self.dtype,
            {None: "unquantized", MIXED: "projections at the GGUF file's widths"}.get(bits, f"int{bits} projections"),
            time.perf_counter() - start,
        )
        if self.device.type == "cpu" and not config.model.enforce_eager:
            # Build (first start on a machine: ~50 s) or load the C++ kernels now, before the engine reports ready,
            # rather than in the first step, where it would stall the first requests. They are the CPU's compiled
            # path, in place of torch.compile: inductor (weight freezing, the norms, rotary and SwiGLU fused) ran a
            # float32 batch-1 decode step in 46.0 ms against eager's 45.5 and a batch-8 one in 137 against 67, after
            # 48-82 s of compiling per shape; per-layer compiling saved 5% of a bf16 batch-64 step and nothing on a
            # 512-token prefill (docs/architecture.rst). Our fused norm, rotary and SwiGLU alone took a batch-1
            # forward from 27 ms to 22.
            start = time.perf_counter()
            try:
                cpu_ops()
            except Exception as error:
                raise RuntimeError(
                    f"Building the CPU kernels failed ({type(error).__name__}: {error}). They need a C++ compiler "
                    "with OpenMP (g++) and Python's headers; --enforce-eager (enforce_eager=True) serves without "
                    "them, on torch's own ops, slower."
                ) from error
            logger.info("CPU kernels ready in %.1f s", time.perf_counter() - start)
        processors = LogitsProcessors(config.sampling.logits_processors)
        self.sampler = Sampler(checkpoint.vocab_size, checkpoint.eos_token_ids, processors)
        self.lora = LoraManager(
            self.model,
            config.lora.max_loras,
            config.lora.max_lora_rank,
            self.device,
            self.dtype,
            max_loaded=config.lora.max_loaded_loras,
        )
        if config.lora.lora_modules or config.lora.allow_runtime_lora:
            # Now, so that the CUDA memory budget counts the slots; otherwise the first adapter loaded allocates them.
            self.lora.allocate()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_graphs: DecodeGraphs | None = None
        self.states: dict[int, SequenceState] = {}
        self.image_input = ImageSpec.of(self.model) if self.model.supports_images else None
        # As vLLM sizes its encoder cache: a step's budget of tokens, or one image where that is more.
        self.encoder_cache = EncoderCache(
            max(config.scheduler.max_num_batched_tokens, self.image_input.num_tokens if self.image_input else 0)
        )
        self._executed: _ExecutedStep | None = None

    def add_lora(self, name: str, path: str) -> LoraAdapterInfo:
        """Load a PEFT adapter under ``name`` (:meth:`LoraManager.add`)."""
        return self.lora.add(name, path)

    def remove_lora(self, name: str, in_use: Collection[int]) -> None:
        """Unload ``name``; its weights stay while a sequence in ``in_use`` uses it (:meth:`LoraManager.remove`)."""
        self.lora.remove(name, in_use)

    def list_loras(self) -> list[LoraAdapterInfo]:
        """The loaded adapters, in loading order."""
        return self.lora.list_adapters()

    def lora_id(self, name: str) -> int:
        """The id of the loaded adapter ``name`` (:class:`~spindle.shared.errors.NotFoundError` if none)."""
        return self.lora.lookup(name)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers (:func:`~spindle.shared.protocol.kv_block_bytes`).

        The kv heads are this rank's (:class:`~spindle.backend.models.checkpoint_config.Shard`).
        """
        return kv_block_bytes(
            self.checkpoint.num_layers,
            self.shard.num_kv_heads,
            self.checkpoint.head_dim,
            self.block_size,
            self.dtype.itemsize,
        )

    def init_cache(self, max_model_len: int) -> int:
        """Profile one maximal step, size the KV cache from the memory budget, allocate it.

        On CUDA the budget is this engine's share of the device, ``gpu_memory_utilization``, minus what this process
        uses: its weights, the profiled step's reserved peak and what the device lost outside torch since start-up
        (:func:`~spindle.backend.memory.kv_cache_budget`) and the decode CUDA graphs' private pool, measured on
        trial graphs captured over a scratch cache; other processes' memory is not counted against it. The inputs and
        the result are kept in :attr:`kv_budget`. On the CPU it is ``kv_cache_memory``. On CUDA every Triton kernel
        variant is then compiled (``_warm_up_kernels``) and the decode graphs are captured. Returns the number of
        blocks. Under tensor parallelism every rank calls it (the profiled forward has collectives), and the cache
        has the blocks that fit on every rank.
        """
        self._profile_run(max_model_len, sample=self.device.type == "cuda" and not self.is_pooling_model)
        if self.device.type == "cuda":
            utilization = self.config.cache.gpu_memory_utilization
            trial = partial(self._trial_decode_graphs, max_model_len)
            measured = self.memory.after_profile(trial if self._captures_graphs else None)
            budget = kv_cache_budget(utilization, *measured)
            knob = f"gpu_memory_utilization={utilization}"
        else:
            budget = self.config.cache.kv_cache_memory
            knob = f"kv_cache_memory={budget / 2**20:.1f} MiB"
        num_blocks = parallel.min_over_ranks(max(0, budget // self.block_bytes), self.device)
        if self.device.type == "cuda":
            self.kv_budget = KVBudget.of(utilization, measured, budget, self.block_bytes, num_blocks)
        self.kv_cache_report = self._kv_cache_report(budget, num_blocks, max_model_len)
        blocks_per_seq = -(-max_model_len // self.block_size)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"The KV cache ({knob}) holds {num_blocks} blocks of {self.block_size} tokens "
                f"({self.block_bytes} bytes each), but one max_model_len={max_model_len} sequence needs "
                f"{blocks_per_seq}: raise the memory budget or lower max_model_len."
            )
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self.inputs = InputBuffers(
            self.config.scheduler.max_num_batched_tokens,
            self.config.scheduler.max_num_seqs,
            blocks_per_seq,
            self.block_size,
            self.device,
        )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); %.1f sequences of max_model_len=%d fit",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            num_blocks * self.block_bytes / 2**30,
            self.dtype,
            num_blocks / blocks_per_seq,
            max_model_len,
        )
        if self.device.type == "cuda":
            self._warm_up_kernels()
            if self._captures_graphs:
                self._capture_decode_graphs(max_model_len)
        release_freed_heap()  # what loading (dense weights replaced by their quantized forms) and the profile freed
        return num_blocks

    def _kv_cache_report(self, budget: int, num_blocks: int, max_model_len: int) -> KVCacheReport:
        """How this cache was sized, as the engine reports it (:class:`~spindle.shared.protocol.KVCacheReport`)."""
        kv = self.kv_budget
        terms = {}
        if kv is not None:
            terms = {
                "total": kv.total,
                "share": int(kv.utilization * kv.total),
                "torch_peak": kv.torch_peak,
                "outside_torch": kv.outside_torch,
                "graph_pool": kv.graph_pool,
            }
        return KVCacheReport(
            device=self.device.type,
            dtype=str(self.dtype).removeprefix("torch."),
            num_layers=self.checkpoint.num_layers,
            num_kv_heads=self.shard.num_kv_heads,
            head_dim=self.checkpoint.head_dim,
            block_size=self.block_size,
            element_bytes=self.dtype.itemsize,
            budget_bytes=budget,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            device_terms=terms,
        )

    @torch.inference_mode()
    def _warm_up_kernels(self) -> None:
        """Compile every Triton kernel variant a step can launch (seconds each), so that no request's step waits on one.

        The decode kernel at every split count; then a step and the LM head at every row count of
        :func:`~spindle.kernels.triton.compile_check.warm_up_row_counts`, as the quantized projections and the LoRA
        kernels choose their tiles from a step's rows (tokens, sampled rows, an adapter's tokens): the quantized LM
        head's small-batch tiles too, which a decode graph does not hold. With LoRA slots each count runs twice, on
        the base model and on one adapter slot. The other kernels have no step-dependent compile-time constants, and
        their step-varying integers are not specialised on.
        """
        from spindle.kernels.triton.compile_check import warm_up_row_counts
        from spindle.kernels.triton.decode_attention import SPLIT_COUNTS, warm_up

        mc = self.checkpoint
        query = torch.zeros(1, self.shard.num_heads, mc.head_dim, dtype=self.dtype, device=self.device)
        variants = [(count, window) for count in SPLIT_COUNTS for window in set(mc.layer_windows)]
        for count, window in tqdm(variants, desc="Compiling the decode kernels", unit="variant"):
            warm_up(query, *self.kv_caches[0], count, window)
        slots = [-1, 0] if self.lora.allocated else [-1]
        counts = warm_up_row_counts(self.config.scheduler.max_num_batched_tokens)
        for num_tokens in tqdm(counts, desc="Compiling the step kernels", unit="step size"):
            # Decodes and a 2-token prefill chunk (both attention kernels), all over the cache's first block.
            lens = [1] * (num_tokens - 2) + [2] if num_tokens > 1 else [1]
            meta = AttentionMetadata.from_lists(lens, lens, [[0]] * len(lens), self.block_size, self.device)
            zeros = torch.zeros(num_tokens, dtype=torch.long, device=self.device)  # token ids and positions
            for slot in slots:
                with lora_mapping(LoraMapping.build([slot] * len(lens), lens, self.device)):
                    hidden = self.model(zeros, zeros, meta, self.kv_caches)
                if not self.is_pooling_model:
                    self.model.compute_logits(hidden)

    @property
    def _captures_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (captured collectives would need NCCL graph support)."""
        return self.device.type == "cuda" and self.parallel.size == 1 and not self.config.model.enforce_eager

    def _new_decode_graphs(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_model_len: int
    ) -> DecodeGraphs:
        # A decode step never has more sequences than either limit.
        max_batch = min(self.config.scheduler.max_num_seqs, self.config.scheduler.max_num_batched_tokens)
        return DecodeGraphs(self.model, kv_caches, max_batch, max_model_len, self.block_size)

    def _trial_decode_graphs(self, max_model_len: int) -> DecodeGraphs:
        # Over a one-block scratch cache: they are never replayed, only their memory pool is measured.
        return self._new_decode_graphs(self._allocate_kv_caches(1), max_model_len)

    def _capture_decode_graphs(self, max_model_len: int) -> None:
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        self.decode_graphs = self._new_decode_graphs(self.kv_caches, max_model_len)
        torch.cuda.empty_cache()  # the eager warm-up runs' blocks; the graphs keep their own pool
        logger.info(
            "Captured %d decode CUDA graphs (batch sizes up to %d) in %.1f s, using %.2f GiB",
            len(self.decode_graphs.sizes),
            self.decode_graphs.max_batch,
            time.perf_counter() - start,
            (torch.cuda.memory_reserved() - reserved) / 2**30,
        )

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Zeros, not empty: batched decodes read padding slots (with zero weight), and garbage NaNs would spread.
        mc = self.checkpoint
        shape = (num_blocks, self.block_size, self.shard.num_kv_heads, mc.head_dim)
        if self.device.type == "cpu":
            # On huge pages, as the weights are (spindle.kernels.huge_pages): attention streams the cache as a decode
            # streams the weights. Written once here, so that the memory is taken now, as torch.zeros takes it.
            block = huge_pages.empty(2 * mc.num_layers * math.prod(shape) * self.dtype.itemsize)
            caches = block.view(self.dtype).view(mc.num_layers, 2, *shape).zero_()
            return [(layer[0], layer[1]) for layer in caches]
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(mc.num_layers)
        ]

    @_enforce_eager_if_configured
    def _profile_run(self, max_model_len: int, sample: bool) -> None:
        """Run the most a step can do, so that torch's memory peak covers every real step.

        That is a forward of ``max_num_batched_tokens`` prompt tokens and, with ``sample`` (on CUDA, where the peak
        sizes the cache; on the CPU it would only slow the start by seconds), every one of ``max_num_seqs``
        sequences sampling with top-k/top-p over nearly the whole vocabulary and the most logprobs, and a full
        chunk's prompt log-probabilities, and a vision-language model's encoder over :attr:`max_images_per_batch`
        images. The tokens form sequences of at most ``max_model_len``, as a real step's
        do: a budget larger than the model's context must not ask for positions past it. (The profile's own small KV
        cache is in the peak too, which errs on the safe side.)
        """
        num_tokens = self.config.scheduler.max_num_batched_tokens
        num_seqs = min(self.config.scheduler.max_num_seqs, num_tokens)
        full, rest = divmod(num_tokens, max_model_len)
        lens = sorted([max_model_len] * full + [rest] * (rest > 0), key=lambda n: n != 1)  # a 1-token one decodes
        tables, num_blocks = [], 0
        for n in lens:
            tables.append(list(range(num_blocks, num_blocks + -(-n // self.block_size))))
            num_blocks += len(tables[-1])
        caches = self._allocate_kv_caches(num_blocks)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        meta = AttentionMetadata.from_lists(lens, lens, tables, self.block_size, self.device)
        vocab = self.checkpoint.vocab_size
        widest = SamplingParams(temperature=0.8, top_k=max(vocab - 1, 1), top_p=0.9, logprobs=MAX_LOGPROBS)
        with torch.inference_mode():
            hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device), positions, meta, caches)
            if not sample:
                return
            if self.image_input is not None:
                shape = (self.max_images_per_batch, *self.image_input.shape)
                self.model.embed_images(torch.zeros(shape, dtype=self.dtype, device=self.device))
            # Every rank computes its LM head shard (rank 0 gathers them); rank 0 alone samples.
            logits = self.model.compute_logits(hidden[:num_seqs])
            prompt_logits = self.model.compute_logits(hidden)
            if self.parallel.rank == 0:
                self.sampler(logits, [SampleRow(widest, None, [0], 1)] * num_seqs)
                targets = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
                self.sampler.prompt_logprobs(prompt_logits, targets, MAX_LOGPROBS)

    @torch.inference_mode()
    @_enforce_eager_if_configured
    def execute(self, scheduled: SchedulerOutput) -> None:
        """Start a step: update the sequences' states, then run the forward pass and the LM head (queued, on CUDA).

        The LM head runs once, over every row anything needs (the rows to sample, then the prompt log-probability
        positions), so that under tensor parallelism the ranks gather their logits once a step. Rank 0 then calls
        :meth:`sample` for the step's results.
        """
        start = time.perf_counter()
        if self.parallel.size > 1 and self.parallel.rank == 0:
            parallel.send_step(scheduled, self.device)
        states = apply_scheduler_output(self.states, scheduled, self.block_size)
        self.lora.release_unused(scheduled.lora_ids_in_use)
        # Decodes (one query token) go first, then decodes verifying drafts, whose tokens attend as decodes each
        # (InputBuffers): the CPU attention path batches decodes together, and a step of them alone runs as a decode
        # step. With adapters, each group is ordered by slot: a slot's tokens are then one run in each
        # (spindle.kernels.lora's CPU path).
        query_lens = [scheduled.num_scheduled_tokens[state.seq_id] for state in states]
        groups = [
            0 if n == 1 else 1 if state.seq_id in scheduled.spec_token_ids else 2
            for state, n in zip(states, query_lens, strict=True)
        ]
        lora_ids = [state.lora_id for state in states]
        slots = self.lora.assign(lora_ids, scheduled.running_lora_ids) if any(i is not None for i in lora_ids) else None
        if slots is None:
            order = sorted(range(len(states)), key=lambda i: groups[i])
        else:
            order = sorted(range(len(states)), key=lambda i: (groups[i], slots[i]))
        states = [states[i] for i in order]
        query_lens = [query_lens[i] for i in order]
        num_decode_seqs = sum(group < 2 for group in groups)
        input_ids: list[int] = []
        sampling: list[tuple[int, list[int]]] = []  # (index in states, drafts) of each sequence that samples
        for i, (state, n) in enumerate(zip(states, query_lens, strict=True)):
            start_token = state.num_computed_tokens
            drafts = scheduled.spec_token_ids.get(state.seq_id, [])
            input_ids += state.token_ids[start_token : start_token + n - len(drafts)] + drafts
            if start_token + n - len(drafts) >= len(state) and state.pooling is None:
                sampling.append((i, drafts))
        query_start_loc = [0, *accumulate(query_lens)]
        # One row per token to sample: a sequence's last position, and for a decode with drafts each draft's too.
        rows = [
            row
            for i, drafts in sampling
            for row in range(query_start_loc[i + 1] - 1 - len(drafts), query_start_loc[i + 1])
        ]
        spans = _prompt_spans(states, query_start_loc)
        prompt_rows = [row for _, start, end, first in spans for row in range(first, first + end - start)]
        lora_slots = None if slots is None else [slots[i] for i in order]
        step = self.inputs.build(states, query_lens, input_ids, rows + prompt_rows, lora_slots, num_decode_seqs)

        images = _joined(
            self._image_rows(states, query_start_loc, scheduled.scheduled_images),
            self._embeds_rows(states, query_start_loc),
        )
        graphs = self.decode_graphs
        decode_only = len(input_ids) == len(states)  # a prompt's last token may be an image's: not a graph's step
        if (
            graphs is not None
            and step.lora is None
            and images is None
            and decode_only
            and len(states) <= graphs.max_batch
        ):
            hidden = graphs.replay(step)
        else:
            # Rows of images or prompt embeddings only: a step without them keeps the four-argument contract.
            merge = {} if images is None else {"image_rows": images[0], "image_embeds": images[1]}
            with lora_mapping(step.lora):
                hidden = self.model(step.input_ids, step.positions, step.meta, self.kv_caches, **merge)
        logits = self.model.compute_logits(hidden[step.sample_rows]) if rows or prompt_rows else None
        self._executed = _ExecutedStep(start, states, query_start_loc, sampling, spans, hidden, logits)

    @torch.inference_mode()
    @_enforce_eager_if_configured
    def sample(self, grammar: GrammarBitmask | None) -> RunnerOutput:
        """Finish the step :meth:`execute` started: sample, verify drafts, pool, compute prompt log-probabilities.

        ``grammar`` masks the rows of the constrained sequences (structured output). On CUDA the step waits for the
        device once, to fetch what it returns (:func:`fetch`). Only rank 0 samples.
        """
        step, self._executed = self._executed, None
        assert step is not None, "sample() follows execute()"
        num_rows = sum(len(drafts) + 1 for _, drafts in step.sampling)
        prompt = self._prompt_logprobs(step.spans, step.logits[num_rows:] if step.spans else None)  # type: ignore[index]
        embeddings = pool(step.states, step.query_start_loc, step.hidden)
        sampled = None
        if step.sampling:
            rows = [row for i, drafts in step.sampling for row in sample_rows(step.states[i], drafts)]
            allowed = self._allowed(grammar, step) if grammar is not None else None
            sampled = self.sampler(step.logits[:num_rows], rows, allowed)  # type: ignore[index]
        # Fetched in this order: each sequence's prompt log-probabilities, the sampled tokens, the embeddings.
        tensors = [
            *(t for entry in prompt.values() for t in entry.tensors()),
            *(sampled.tensors() if sampled else []),
            *embeddings.values(),
        ]
        fetched = iter(fetch(tensors))

        output = RunnerOutput()
        for seq_id, entry in prompt.items():
            self.states[seq_id].prompt_logprobs += entry.from_host(*islice(fetched, len(entry.tensors())))
        if sampled is not None:
            token_ids, logprobs = sampled.from_host(*islice(fetched, len(sampled.tensors())))
            row = 0
            for i, drafts in step.sampling:
                state = step.states[i]
                tokens = token_ids[row : row + len(drafts) + 1]
                if drafts:
                    tokens = accepted_tokens(drafts, tokens)
                    output.num_drafts[state.seq_id] = len(drafts)
                output.sampled_token_ids[state.seq_id] = tokens
                chosen = logprobs[row : row + len(tokens)]
                if chosen[0] is not None:
                    output.logprobs[state.seq_id] = chosen  # type: ignore[assignment]
                if state.params.prompt_logprobs is not None and not state.num_output_tokens:
                    output.prompt_logprobs[state.seq_id] = state.prompt_logprobs
                row += len(drafts) + 1
        for seq_id, embedding in zip(embeddings, fetched, strict=True):
            output.embeddings[seq_id] = embedding.astype("<f4", copy=False).tobytes()
        output.seconds = time.perf_counter() - step.start
        return output

    def _allowed(self, grammar: GrammarBitmask, step: _ExecutedStep) -> tuple[torch.Tensor, list[int]]:
        """The grammar bitmask laid out in the step's sample rows, and the rows it constrains."""
        source, target, row = [], [], 0
        for i, drafts in step.sampling:
            first = grammar.first_row.get(step.states[i].seq_id)
            if first is not None:
                source += range(first, first + len(drafts) + 1)
                target += range(row, row + len(drafts) + 1)
            row += len(drafts) + 1
        mask = grammar.bitmask.new_full((row, grammar.bitmask.shape[1]), -1)
        mask[target] = grammar.bitmask[source]
        return mask, target

    def _image_rows(
        self, states: list[SequenceState], query_start_loc: list[int], scheduled_images: dict[int, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The image embeddings of the step's placeholder tokens, ``(rows, embeds)``, or None without any.

        ``rows`` are the flat batch's rows that hold placeholder tokens, ``embeds`` their embeddings, row for row.
        An image the encoder cache lacks is encoded in the step that reaches its placeholder, once however many
        sequences of the step hold it (by content hash), in one batch per image shape; it stays cached while a
        sequence the runner holds has yet to compute its placeholder.
        """
        pieces: list[tuple[bytes, int, int, int]] = []  # (content hash, first row, start, end in the placeholder)
        to_encode: dict[bytes, ImageInput] = {}
        for i, state in enumerate(states):
            start, end = (
                state.num_computed_tokens,
                state.num_computed_tokens + query_start_loc[i + 1] - query_start_loc[i],
            )
            for k in scheduled_images.get(state.seq_id, ()):
                image = state.images[k]
                lo, hi = max(start, image.offset), min(end, image.offset + image.length)
                pieces.append(
                    (image.content_hash, query_start_loc[i] + lo - start, lo - image.offset, hi - image.offset)
                )
                if image.content_hash not in self.encoder_cache:
                    to_encode.setdefault(image.content_hash, image)
        if not pieces:
            return None
        if to_encode:
            # Never drop an image whose placeholder a sequence the runner holds has still to compute.
            needed = {
                image.content_hash
                for state in self.states.values()
                for image in state.images
                if image.offset + image.length > state.num_computed_tokens
            }
            self.encoder_cache.add(self._encode_images(list(to_encode.values())), needed)
        rows = [torch.arange(first_row, first_row + end - start) for _, first_row, start, end in pieces]
        embeds = [self.encoder_cache.get(content_hash)[start:end] for content_hash, _, start, end in pieces]
        return torch.cat(rows).to(self.device), torch.cat(embeds)

    def _embeds_rows(
        self, states: list[SequenceState], query_start_loc: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows of this step's prompt positions given as embeddings, and those embeddings (None without any)."""
        rows, embeds = [], []
        for i, state in enumerate(states):
            if state.prompt_embeds is None:
                continue
            start = state.num_computed_tokens
            end = min(start + query_start_loc[i + 1] - query_start_loc[i], len(state.prompt_embeds))
            if start < end:
                rows.append(torch.arange(query_start_loc[i], query_start_loc[i] + end - start))
                embeds.append(torch.tensor(state.prompt_embeds[start:end]))  # a copy: the array is read-only
        if not rows:
            return None
        return torch.cat(rows).to(self.device), self.model.input_embeds(torch.cat(embeds).to(self.device))

    def _encode_images(self, images: list[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Run the vision encoder over ``images``, one batch per shape; their embeddings by content hash."""
        by_shape: dict[tuple[int, ...], list[ImageInput]] = {}
        for image in images:
            by_shape.setdefault(tuple(image.shape), []).append(image)
        encoded = {}
        batch = self.max_images_per_batch
        for group in by_shape.values():
            for first in range(0, len(group), batch):
                chunk = group[first : first + batch]
                pixels = torch.from_numpy(np.stack([image.array() for image in chunk]))
                embeds = self.model.embed_images(pixels.to(self.device, self.dtype))
                encoded.update(zip((image.content_hash for image in chunk), embeds, strict=True))
        return encoded

    @property
    def max_images_per_batch(self) -> int:
        """The most images one vision-encoder call takes: as many as a step's token budget has placeholders for.

        A step may reach more (one placeholder token each, at the end of many chunks); they are encoded in several
        calls, so the encoder's peak memory is that of this many, which :meth:`init_cache` profiles.
        """
        num_tokens = self.image_input.num_tokens if self.image_input is not None else 1
        return max(1, self.config.scheduler.max_num_batched_tokens // num_tokens)

    def _prompt_logprobs(
        self, spans: list[tuple[SequenceState, int, int, int]], logits: torch.Tensor | None
    ) -> dict[int, LogprobTensors]:
        """By ``seq_id``, the prompt log-probabilities of the positions in ``spans`` (:func:`_prompt_spans`).

        ``logits`` holds the spans' rows one after another.
        """
        computed: dict[int, LogprobTensors] = {}
        row = 0
        for state, start, end, _ in spans:
            targets = to_device(state.token_ids[start + 1 : end + 1], torch.int64, self.device)
            rows = logits[row : row + end - start]  # type: ignore[index]
            computed[state.seq_id] = self.sampler.prompt_logprobs(rows, targets, state.params.prompt_logprobs)
            row += end - start
        return computed

    def follow(self) -> None:
        """A tensor-parallel worker: run :meth:`execute` on each scheduler output rank 0 sends, until it stops."""
        while (scheduled := parallel.receive_step(self.device)) is not None:
            self.execute(scheduled)

    def close(self) -> None:
        """Rank 0 under tensor parallelism: tell the workers to stop (they leave their loop and exit)."""
        if self.parallel.size > 1 and self.parallel.rank == 0:
            parallel.send_stop(self.device)


def _joined(
    *parts: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows and their embeddings from several sources (images, prompt embeddings) as one pair; None for none."""
    given = [part for part in parts if part is not None]
    if not given:
        return None
    if len(given) == 1:
        return given[0]
    rows, embeds = zip(*given, strict=True)
    dtype = embeds[0].dtype
    return torch.cat(rows), torch.cat([e.to(dtype) for e in embeds])


def _prompt_spans(states: list[SequenceState], query_start_loc: list[int]) -> list[tuple[SequenceState, int, int, int]]:
    """The prompt log-probability positions this step computes, for each sequence that needs some.

    One ``(state, start, end, first_row)`` per sequence: positions ``[start, end)`` of its prompt, whose hidden
    states are the flat batch's rows from ``first_row`` on. A sequence that has generated tokens had its prompt's
    (it is recomputed after a preemption): they were reported with its first token.
    """
    spans = []
    for i, state in enumerate(states):
        start = state.num_computed_tokens
        end = min(start + query_start_loc[i + 1] - query_start_loc[i], state.num_prompt_tokens - 1)
        if state.params.prompt_logprobs is not None and not state.num_output_tokens and start < end:
            spans.append((state, start, end, query_start_loc[i]))
    return spans
