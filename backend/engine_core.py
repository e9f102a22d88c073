"""The engine core: requests of token ids in, per-step token deltas out. Both engines drive it."""

import atexit
import contextlib
import logging
import math
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec

from spindle.backend import parallel
from spindle.backend.block_manager import BlockManager
from spindle.backend.model_runner import ModelRunner
from spindle.backend.models.checkpoint_config import CheckpointConfig
from spindle.backend.models.loader import resolve_model
from spindle.backend.scheduler import Scheduler
from spindle.backend.scheduler_output import SchedulerOutput
from spindle.backend.sequence import Sequence
from spindle.backend.speculative import DraftProposer
from spindle.backend.structured_output import StructuredOutputManager
from spindle.backend.worker import Workers, check_tensor_parallel
from spindle.shared import FinishReason
from spindle.shared.config import EngineConfig
from spindle.shared.errors import InvalidRequestError, RequestRefusedError
from spindle.shared.lora import LoraAdapterInfo, confine_adapter_path
from spindle.shared.pooling_params import PoolingParams
from spindle.shared.protocol import (
    Command,
    EngineInfo,
    EngineRequest,
    EngineStats,
    KvEvent,
    ListLoras,
    LoadLora,
    ResetPrefixCache,
    SequenceDelta,
    UnloadLora,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
    "preprocessor_config.json",
)
"""The files a frontend needs to build the tokenizer (and a vision-language model's image processor); they travel in
the handshake, so it needs no shared disk."""


def context_length(config: EngineConfig, checkpoint: CheckpointConfig) -> int:
    """The ``max_model_len`` served: the configured one, else the model's context (a sliding window does not cap it).

    Raises:
        ValueError: the configured one exceeds the model's context.

    """
    model_max = checkpoint.max_position_embeddings
    if config.model.max_model_len is not None and config.model.max_model_len > model_max:
        raise ValueError(
            f"max_model_len={config.model.max_model_len} exceeds the model's context of {model_max} tokens"
        )
    return config.model.max_model_len or model_max


class EngineCore:
    """Scheduler, block manager and model runner behind one ``step()``.

    A step is the scheduler's :class:`~spindle.backend.scheduler_output.SchedulerOutput`, run by the model runner
    (:meth:`~spindle.backend.model_runner.ModelRunner.execute`, then
    :meth:`~spindle.backend.model_runner.ModelRunner.sample` with the step's grammar bitmask), whose
    :class:`~spindle.backend.runner_output.RunnerOutput` the scheduler applies
    (:meth:`~spindle.backend.scheduler.Scheduler.update_from_output`, the one place where sequences change). Each
    feature's state has one owner: the scheduler's sequences and requests, the
    :class:`~spindle.backend.structured_output.StructuredOutputManager` (grammars compiling, refusals, matchers,
    bitmasks), the :class:`~spindle.backend.speculative.DraftProposer` (drafts and their acceptance counts), and in
    the runner the LoRA manager (adapters and slots), the encoder cache (image embeddings) and each sequence's
    state (pooling, prompt log-probabilities). The core knows token ids only: stop strings are the frontend's
    business, which ends such a sequence with :meth:`finish_sequence`.

    A constrained request is accepted at once and its grammar compiled in the background; one whose spec does not
    compile is dropped later, and its refusal comes out of :meth:`pop_refused`.

    An embedding request (``EngineRequest.pooling`` set) is one sequence that is prefilled in the same steps as the
    others and pooled by the runner (:mod:`spindle.backend.pooler`); the step that completes its prompt ends it,
    frees its blocks and reports it with one delta that carries the embedding and no tokens. A model without an LM
    head (``LlamaModel``) takes embedding requests only.

    A request may name a LoRA adapter loaded with :meth:`add_lora` (or ``lora_modules`` at start-up); requests of
    different adapters and of the base model run in the same steps (:mod:`spindle.backend.lora_manager`). Admin
    operations such as these are the control plane's commands (:meth:`call`).

    With ``tensor_parallel_size > 1`` this process is rank 0: it starts its node's worker processes
    (:class:`~spindle.backend.worker.Workers`), and its runner sends them each step; while it is idle, a
    :class:`~spindle.backend.parallel.KeepAlive` keeps their wait for the next step within ``collective_timeout``.
    :meth:`close` stops them; a worker that dies before, or that fails a keep-alive or a step's collectives (wedged:
    it does not answer within ``collective_timeout``), is reported to ``on_worker_death`` (by default logged: the
    next step's collective fails).

    Args:
        config: the engine's settings.
        on_worker_death: called with why when a tensor-parallel worker dies or stops answering (from a watcher
            thread, or the thread that found it).

    """

    def __init__(self, config: EngineConfig, on_worker_death: Callable[[str], None] | None = None) -> None:
        if config.lora.allow_runtime_lora and not Path(config.lora.lora_dir).is_dir():
            raise ValueError(f"lora_dir={config.lora.lora_dir!r} is not a directory")
        self.config = config
        self.model_dir = resolve_model(config.model.model)
        self.checkpoint = CheckpointConfig.from_dir(self.model_dir)
        self.max_model_len = context_length(config, self.checkpoint)
        self.workers: Workers | None = None
        self.keep_alive: parallel.KeepAlive | None = None
        self.runner, self.num_blocks = self._start_runner(config, on_worker_death or logger.error)
        windows = self.checkpoint.layer_windows
        self.block_manager = BlockManager(
            self.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            self._lora_name,
            # Blocks are released only where every layer slides: a layer over the whole context reads them all.
            max(windows) if all(windows) else None,
        )
        self.structured_output = StructuredOutputManager(
            self.model_dir,
            self.checkpoint.vocab_size,
            self.checkpoint.eos_token_ids,
            compile_workers=config.structured_output.grammar_compile_workers,
            compile_timeout=config.structured_output.grammar_compile_timeout,
        )
        self.drafter = DraftProposer(
            self.max_model_len, self.structured_output, adaptive=config.scheduler.adaptive_drafts
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            max_model_len=self.max_model_len,
            eos_token_ids=self.checkpoint.eos_token_ids,
            structured_output=self.structured_output,
            drafter=self.drafter,
            max_loras=config.lora.max_loras,
        )
        self.refused: list[tuple[str, RequestRefusedError]] = []
        self.info = EngineInfo(
            model_name=Path(config.model.model).name if config.model.model else DEFAULT_MODEL_NAME,
            max_model_len=self.max_model_len,
            vocab_size=self.checkpoint.vocab_size,
            eos_token_ids=self.checkpoint.eos_token_ids,
            num_kv_blocks=self.num_blocks,
            block_size=config.cache.block_size,
            tokenizer_files={
                name: (self.model_dir / name).read_bytes()
                for name in TOKENIZER_FILES
                if (self.model_dir / name).is_file()
            },
            runtime_lora_dir=config.lora.lora_dir if config.lora.allow_runtime_lora else None,
            step_timeout=config.backend.step_timeout,
            max_message_size=config.backend.max_message_size,
            max_loras=config.lora.max_loras,
            architectures=[self.checkpoint.architecture],
            kv_medium="GPU" if self.runner.device.type == "cuda" else "CPU",
            boot_id=uuid.uuid4().hex,
            kv_cache=self.runner.kv_cache_report,
        )
        for name, path in (config.lora.lora_modules or {}).items():
            self.add_lora(name, path)

    def _start_runner(self, config: EngineConfig, on_worker_death: Callable[[str], None]) -> tuple[ModelRunner, int]:
        """Build the model runner and its KV cache; returns both.

        Under tensor parallelism the workers start first, so that they load their shards while this process loads
        its own.
        """
        if config.parallel.tensor_parallel_size > 1:
            # Refused before any process starts; the workers would find the same.
            check_tensor_parallel(config, self.checkpoint)
            config = parallel.rendezvous(config)
            local_size = config.parallel.tensor_parallel_size // config.parallel.nnodes
            self.workers = Workers(config, self.model_dir, range(1, local_size), self.max_model_len)
        try:
            runner = ModelRunner(config, self.checkpoint, self.model_dir)
            if self.workers is not None:
                self.workers.wait_loaded()
                parallel.init_group(config, runner.device)
            num_blocks = runner.init_cache(self.max_model_len)
        except BaseException:
            if self.workers is not None:
                self.workers.kill()
            parallel.destroy_group()
            raise
        if self.workers is not None:
            self.workers.watch(on_worker_death)
            self.keep_alive = parallel.KeepAlive(runner.device, config.parallel.collective_timeout, on_worker_death)
            atexit.register(self.close)  # an in-process engine nobody closed: stop the workers before exiting
        return runner, num_blocks

    def close(self) -> None:
        """Stop the grammar compile workers, and the tensor-parallel ones and leave their process group.

        The engine serves no step after it.
        """
        self.structured_output.shutdown()
        if self.workers is None:
            return
        atexit.unregister(self.close)
        workers, self.workers = self.workers, None
        workers.closing = True
        self.keep_alive.stop()
        if self.keep_alive.failed:  # out of step with this rank: they would not take the stop
            workers.kill()
        else:
            # A worker already gone fails the exchange: it needs no stop.
            with contextlib.suppress(RuntimeError), self.keep_alive.exclusive():
                self.runner.close()
            workers.join(timeout=10)
        parallel.destroy_group()

    def call(self, command: Command) -> object:
        """Run one control-plane command (between two steps, never under a running batch); its ``Result``.

        This is the one dispatcher of :data:`~spindle.shared.protocol.Command`: the backend process answers a
        :class:`~spindle.shared.protocol.Call` with what it returns, and an in-process client calls it directly.

        Raises:
            RequestRefusedError: the command is refused (see each handler); the engine is unchanged.

        """
        match command:
            case LoadLora(name=name, path=path, confined=confined):
                return self.add_lora(name, self._confined(path) if confined else path)
            case UnloadLora(name=name):
                return self.remove_lora(name)
            case ListLoras():
                return self.list_loras()
            case ResetPrefixCache():
                return self.reset_prefix_cache()
        raise TypeError(f"not a command: {command!r}")

    def _confined(self, path: str) -> str:
        """A runtime load's ``path`` inside ``lora_dir``; refused without ``allow_runtime_lora``."""
        if self.info.runtime_lora_dir is None:
            raise InvalidRequestError("path", "this engine does not load LoRA adapters at run time")
        return str(confine_adapter_path(path, self.info.runtime_lora_dir))

    def add_lora(self, name: str, path: str) -> LoraAdapterInfo:
        """Load a PEFT LoRA adapter directory under ``name``; requests use it with ``lora_name=name``.

        Its weights stay on the host; it takes one of the ``max_loras`` device slots while requests use it
        (:mod:`spindle.backend.lora_manager`).

        Raises:
            AlreadyExistsError: ``name`` is taken (field ``name``).
            InvalidRequestError: the directory is not a PEFT LoRA adapter this model can serve: files missing, a rank
                above ``max_lora_rank``, targets other than q/k/v/o/gate/up/down_proj, or matrices that do not fit
                the model (field ``path``).

        """
        try:
            info = self.runner.add_lora(name, path)
        except RequestRefusedError:
            raise
        except Exception as error:
            # A directory that holds no readable adapter must not stop the engine for everyone: refuse the call.
            logger.exception("Could not load a LoRA adapter from %s", path)
            raise InvalidRequestError("path", f"could not load a LoRA adapter from {path!r}: {error}") from error
        targets = ", ".join(info.target_modules)
        logger.info("Loaded LoRA adapter %s (rank %d, %s) from %s", name, info.rank, targets, path)
        return info

    def remove_lora(self, name: str) -> None:
        """Unload the adapter ``name``: new requests naming it are refused; those using it finish with it.

        Raises:
            NotFoundError: no adapter of that name is loaded (field ``name``).

        """
        self.runner.remove_lora(name, self.scheduler.lora_users)
        logger.info("Unloaded LoRA adapter %s", name)

    def list_loras(self) -> list[LoraAdapterInfo]:
        """The loaded LoRA adapters, in loading order."""
        return self.runner.list_loras()

    def _lora_name(self, lora_id: int) -> str | None:
        """The name an adapter was loaded under (``None`` once it is gone), for the KV events."""
        adapter = self.runner.lora.adapters.get(lora_id)
        return None if adapter is None else adapter.info.name

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, only while no request is in flight; returns whether it did.

        Subscribers hear of it as a :class:`~spindle.shared.protocol.KvCacheCleared`.
        """
        return not self.has_unfinished_requests() and self.block_manager.reset_prefix_cache()

    def record_kv_events(self, on: bool) -> None:
        """Collect the prefix cache's events from now on, starting from a snapshot of it (``on`` false: stop)."""
        self.block_manager.record_events(on)

    def pop_kv_events(self) -> list[KvEvent]:
        """The prefix cache's events since the last call, for the frontends that subscribed (none while off)."""
        return self.block_manager.pop_events()

    def add_request(self, request: EngineRequest) -> None:
        """Queue a tokenized request; ``n > 1`` becomes ``n`` sequences that share the prompt's blocks.

        A resumed request (``EngineRequest.resumed``) becomes a sequence per completion it lists, each starting with
        its output so far.

        Raises:
            InvalidRequestError: the request id is in use, the prompt leaves no room for a completion (an embedding
                request's may fill the context), a generation request comes to an embedding model, an embedding
                request's pooling parameters do not fit the model (``dimensions`` above the hidden size, ``n > 1``),
                or a resumed request's completions do not fit it (an embedding request's, completions listed twice
                or outside ``range(n)``, or one that has nothing left to generate), or its logits processors do not
                build (an unknown name, arguments the class refuses).
            NotFoundError: ``lora_name`` names no loaded LoRA adapter (field ``lora_name``).

        """
        if self.has_request(request.request_id):
            raise InvalidRequestError("request_id", f"request id {request.request_id!r} is already in use")
        pooling = None if request.pooling is None else self._check_pooling(request)
        if pooling is None and self.runner.is_pooling_model:
            raise InvalidRequestError(
                "sampling_params",
                f"{self.info.model_name} is an embedding model (a {self.checkpoint.architecture}, without an LM "
                "head): it cannot generate; ask it for embeddings (Embed, LLM.embed) instead",
            )
        if pooling is not None and len(request.prompt_token_ids) > self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {len(request.prompt_token_ids)} tokens, more than max_model_len={self.max_model_len}",
            )
        if pooling is None and len(request.prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {len(request.prompt_token_ids)} tokens, but max_model_len={self.max_model_len} "
                "leaves no room for a completion",
            )
        if request.images:
            self._check_images(request)
        if request.prompt_embeds is not None:
            self._check_prompt_embeds(request)
        if request.params.logits_processors:
            self.runner.sampler.processors.build(request.params.logits_processors)  # refuses what would not build
        outputs = self._resumed_outputs(request)
        lora_id = self.runner.lora_id(request.lora_name) if request.lora_name else None
        seqs = [
            Sequence(
                request.request_id,
                i,
                request.prompt_token_ids,
                request.params,
                request.arrival_time,
                request.priority,
                pooling=pooling,
                lora_id=lora_id,
                images=request.images,
                output_token_ids=outputs.get(i),
                prompt_embeds=request.prompt_embeds,
            )
            for i in request.indices
        ]
        if request.params.structured_output is not None:
            seq_ids = [seq.seq_id for seq in seqs]
            replay = {seq.seq_id: seq.output_token_ids for seq in seqs if seq.num_output_tokens}
            tokens_left = {seq.seq_id: seq.tokens_left(self.max_model_len) for seq in seqs}
            self.structured_output.add_request(
                request.request_id,
                seq_ids,
                request.params.structured_output,
                replay,
                tokens_left,
                request.grammar_after,
            )
        self.scheduler.add_request(seqs)

    def _resumed_outputs(self, request: EngineRequest) -> dict[int, list[int]]:
        """A resumed request's output so far, by completion index (nothing for a new request).

        Raises:
            InvalidRequestError: an embedding request, no completion or one listed twice or out of ``range(n)``, or
                an output that had reached its ``max_tokens`` or the context (it would have finished).

        """
        if request.resumed is None:
            return {}
        if request.pooling is not None:
            raise InvalidRequestError("resumed", "an embedding request is sent again whole, never resumed")
        indices = request.indices
        if not indices or len(set(indices)) != len(indices) or not all(0 <= i < request.params.n for i in indices):
            raise InvalidRequestError(
                "resumed",
                f"a resumed request lists each unfinished completion once, of range({request.params.n}): {indices}",
            )
        max_tokens = request.params.max_tokens or self.max_model_len
        for k, completion in enumerate(request.resumed):
            generated = len(completion.token_ids)
            if generated >= max_tokens or len(request.prompt_token_ids) + generated >= self.max_model_len:
                raise InvalidRequestError(
                    f"resumed[{k}].token_ids",
                    f"completion {completion.index} has {generated} tokens: it reached max_tokens={max_tokens} or "
                    f"max_model_len={self.max_model_len} with the prompt, and has nothing left to generate",
                )
        return {completion.index: completion.token_ids for completion in request.resumed}

    def _check_prompt_embeds(self, request: EngineRequest) -> None:
        """Refuse embeddings that are not one row of the model's hidden size per prompt position.

        Raises:
            InvalidRequestError: for ``prompt.prompt_embeds``.

        """
        embeds = request.prompt_embeds
        expected = [len(request.prompt_token_ids), self.checkpoint.hidden_size]
        problem = None
        if embeds.shape != expected:
            problem = f"have shape {embeds.shape}; this prompt needs {expected} (the model's hidden size)"
        elif len(embeds.data) != 4 * math.prod(embeds.shape):
            problem = f"have {len(embeds.data)} bytes, not the {4 * math.prod(embeds.shape)} of their shape"
        elif request.images:
            problem = "come with images: a prompt is embeddings or has images, not both"
        elif not hasattr(self.runner.model, "input_embeds"):
            problem = f"are not taken by {type(self.runner.model).__name__}: send token ids"
        if problem is not None:
            raise InvalidRequestError("prompt.prompt_embeds", f"the prompt's embeddings {problem}")

    def _check_images(self, request: EngineRequest) -> None:
        """Refuse images the model cannot take: to a text-only model, or not as its vision encoder takes them.

        The frontend preprocesses images for this model; a mismatch here is a frontend for another model or a
        hand-built request.

        Raises:
            InvalidRequestError: the model takes no images, or an image's shape, pixels or placeholder span (its
                place, length and tokens) do not fit the model and the prompt.

        """
        spec = self.runner.image_input
        if spec is None:
            raise InvalidRequestError(
                "prompt.multi_modal_data",
                f"{self.info.model_name} (a {self.checkpoint.architecture}) takes text only: send no images",
            )
        prompt = request.prompt_token_ids
        end_of_previous = 0
        for i, image in enumerate(request.images):
            span = prompt[image.offset : image.offset + image.length]
            problem = None
            if tuple(image.shape) != spec.shape:
                problem = f"has shape {image.shape}; the vision encoder takes {list(spec.shape)}"
            elif len(image.pixels) != 4 * math.prod(image.shape):
                problem = f"has {len(image.pixels)} bytes of pixels, not the {4 * math.prod(image.shape)} of its shape"
            elif image.length != spec.num_tokens:
                problem = f"has {image.length} placeholder tokens; the model gives an image {spec.num_tokens}"
            elif image.offset < end_of_previous or len(span) != image.length:
                problem = f"has its placeholder at [{image.offset}, {image.offset + image.length}), outside the prompt "
                problem += "or overlapping the previous image's"
            elif any(token != spec.token_id for token in span):
                problem = f"has placeholder tokens other than the image token {spec.token_id}"
            if problem is not None:
                raise InvalidRequestError(f"prompt.multi_modal_data[{i}]", f"image {i} {problem}")
            end_of_previous = image.offset + image.length

    def _check_pooling(self, request: EngineRequest) -> PoolingParams:
        """An embedding request's pooling parameters with the model's default pooling (``last``) filled in.

        Raises:
            InvalidRequestError: ``dimensions`` exceeds the hidden size, or the request asks for ``n > 1``.

        """
        assert request.pooling is not None
        hidden_size = self.checkpoint.hidden_size
        if request.pooling.dimensions is not None and request.pooling.dimensions > hidden_size:
            raise InvalidRequestError(
                "pooling_params.dimensions",
                f"PoolingParams.dimensions={request.pooling.dimensions} exceeds the model's hidden size of "
                f"{hidden_size}: leave it unset for the whole embedding, or ask for at most {hidden_size}",
            )
        if request.params.n != 1:
            raise InvalidRequestError(
                "sampling_params.n", f"an embedding request has one result: n={request.params.n} must be 1"
            )
        # Every model Spindle serves is causal: its last token is the one that has seen the whole prompt.
        return msgspec.structs.replace(request.pooling, pooling=request.pooling.pooling or "last")

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop requests wherever they are and free all their blocks; unknown ids are ignored."""
        self.scheduler.abort_requests(request_ids)

    def pause_requests(self, request_ids: list[str], resume: bool = False) -> None:
        """Schedule no tokens for requests until resumed (``resume``: schedule them again); unknown ids are ignored.

        Their sequences keep their blocks meanwhile (see :class:`~spindle.backend.scheduler.Scheduler`).
        """
        if resume:
            self.scheduler.resume_requests(request_ids)
        else:
            self.scheduler.pause_requests(request_ids)

    def pop_refused(self) -> list[tuple[str, RequestRefusedError]]:
        """The requests dropped since the last call because their structured-output spec did not compile, with why.

        They were accepted by :meth:`add_request` and are gone now (no delta reports them): their frontend must fail
        them with the error.
        """
        refused, self.refused = self.refused, []
        return refused

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion of a request (the frontend matched a stop string) and free its blocks."""
        self.scheduler.finish_sequence(request_id, index)

    def stats(self) -> EngineStats:
        """The scheduler's and the KV cache's current state."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_draft_tokens=self.drafter.num_draft_tokens,
            num_accepted_draft_tokens=self.drafter.num_accepted_draft_tokens,
            num_prefix_cache_queries=self.block_manager.num_prefix_queries,
            num_prefix_cache_hits=self.block_manager.num_prefix_hits,
            num_paused_requests=len(self.scheduler.paused),
            lora_adapters=list(self.runner.lora.by_name),
        )

    def has_request(self, request_id: str) -> bool:
        """Whether the request is still in flight (some completion of it unfinished)."""
        return request_id in self.scheduler.requests

    def abort_all(self) -> list[SequenceDelta]:
        """Abort every request in flight; one ``ABORT`` delta per unfinished completion, for their owners."""
        deltas = [
            SequenceDelta(seq.request_id, seq.index, [], finish_reason=FinishReason.ABORT)
            for seqs in self.scheduler.requests.values()
            for seq in seqs
            if not seq.is_finished
        ]
        self.abort_requests(list(self.scheduler.requests))
        return deltas

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running."""
        return self.scheduler.has_unfinished()

    def has_unpaused_requests(self) -> bool:
        """Whether any unfinished request is not paused: with none, a step has nothing to do."""
        return self.scheduler.has_unpaused()

    def step(self) -> list[SequenceDelta]:
        """Schedule, run, apply the results; what changed for each sequence that got a token or its embedding."""
        self._drop_refused()
        scheduled = self.scheduler.schedule()
        if not scheduled.num_scheduled_tokens:
            # Nothing to run but compiles: wait for one instead of spinning (the compiler needs the core).
            self.structured_output.wait_for_compile(timeout=0.05)
            return []
        self._execute(scheduled)
        output = self.runner.sample(self.structured_output.bitmask(scheduled))
        return self.scheduler.update_from_output(scheduled, output)

    def _execute(self, scheduled: SchedulerOutput) -> None:
        """Run the step's forward pass; under tensor parallelism, with the keep-alives held off meanwhile.

        A step that fails there leaves the workers out of step with this rank: the failure goes to
        ``on_worker_death`` (the backend process then exits) before it is raised.
        """
        if self.keep_alive is None:
            self.runner.execute(scheduled)
            return
        try:
            with self.keep_alive.exclusive():
                self.runner.execute(scheduled)
        except Exception as error:
            self.keep_alive.fail(f"a step failed on tensor-parallel rank 0: {error}")
            raise

    def _drop_refused(self) -> None:
        """Drop the requests whose structured-output spec did not compile, keeping why for :meth:`pop_refused`."""
        for request_id, error in self.structured_output.collect():
            logger.info("Refused request: %s", error, extra={"request_id": request_id})
            self.scheduler.abort_requests([request_id])
            self.refused.append((request_id, error))
