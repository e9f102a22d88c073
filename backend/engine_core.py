"""The engine core: requests of token ids in, per-step token deltas out. Both engines drive it."""

import atexit
import contextlib
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path

import msgspec
import numpy as np
import torch

from spindle.backend import parallel
from spindle.backend.block_manager import BlockManager
from spindle.backend.model_runner import ModelRunner
from spindle.backend.models.config import ModelConfig
from spindle.backend.models.loader import resolve_model
from spindle.backend.scheduler import Scheduler
from spindle.backend.sequence import Sequence
from spindle.backend.speculative import propose
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
    ListLoras,
    LoadLora,
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


def context_length(config: EngineConfig, model_config: ModelConfig) -> int:
    """The ``max_model_len`` served: the configured one, else the model's context.

    Raises:
        ValueError: the configured one exceeds the model's context.

    """
    # We attend over the whole context, so a sliding-window model is exact only up to its window.
    model_max = min(filter(None, (model_config.max_position_embeddings, model_config.sliding_window)))
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of {model_max} tokens")
    return config.max_model_len or model_max


class EngineCore:
    """Scheduler, block manager and model runner behind one ``step()``.

    One step schedules, has the model runner run the flat batch and sample (it only reads the sequences), then
    applies the runner's :class:`~spindle.backend.model_runner.RunnerOutput`: it extends the prompt
    log-probabilities, appends the new tokens, ends the sequences that hit eos, a stop token, their length limit or
    the end of their grammar (structured output), and frees their blocks. It knows token ids only: stop strings are
    the frontend's business, which ends such a sequence with :meth:`finish_sequence`.

    A constrained request is accepted at once and its grammar compiled in the background; one whose spec does not
    compile is dropped later, and its refusal comes out of :meth:`pop_refused`.

    An embedding request (``EngineRequest.pooling`` set) is one sequence that is prefilled in the same steps as the
    others and pooled by the runner (:mod:`spindle.backend.pooler`); the step that completes its prompt ends it,
    frees its blocks and reports it with one delta that carries the embedding and no tokens. A model without an LM
    head (``LlamaModel``) takes embedding requests only.

    A request may name a LoRA adapter loaded with :meth:`add_lora` (or ``lora_modules`` at start-up); requests of
    different adapters and of the base model run in the same steps (:mod:`spindle.backend.lora`).

    With ``tensor_parallel_size > 1`` this process is rank 0: it starts its node's worker processes
    (:class:`~spindle.backend.worker.Workers`), and its runner sends them each step. :meth:`close` stops them; a
    worker that dies before is reported to ``on_worker_death`` (by default logged: the next step's collective fails).

    Args:
        config: the engine's settings.
        on_worker_death: called with why, from a watcher thread, when a tensor-parallel worker dies.

    """

    def __init__(self, config: EngineConfig, on_worker_death: Callable[[str], None] | None = None) -> None:
        if config.allow_runtime_lora and not Path(config.lora_dir).is_dir():
            raise ValueError(f"lora_dir={config.lora_dir!r} is not a directory")
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = context_length(config, self.model_config)
        self.workers: Workers | None = None
        self.runner, self.num_blocks = self._start_runner(config, on_worker_death or logger.error)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_decode_slowdown,
            config.scheduling_policy,
            config.priority_aging,
            config.max_loras,
            config.long_prefill_token_threshold,
        )
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}
        self.structured_output = StructuredOutputManager(
            self.model_dir, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        self.pending_grammars: dict[str, Future] = {}  # request id -> its grammar, compiling
        self.refused: list[tuple[str, RequestRefusedError]] = []
        # Speculative decoding: draft tokens verified, and accepted, since start-up.
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.info = EngineInfo(
            model_name=Path(config.model).name if config.model else DEFAULT_MODEL_NAME,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
            num_kv_blocks=self.num_blocks,
            block_size=config.block_size,
            tokenizer_files={
                name: (self.model_dir / name).read_bytes()
                for name in TOKENIZER_FILES
                if (self.model_dir / name).is_file()
            },
            runtime_lora_dir=config.lora_dir if config.allow_runtime_lora else None,
        )
        for name, path in (config.lora_modules or {}).items():
            self.add_lora(name, path)

    def _start_runner(self, config: EngineConfig, on_worker_death: Callable[[str], None]) -> tuple[ModelRunner, int]:
        """Build the model runner and its KV cache; returns both.

        Under tensor parallelism the workers start first, so that they load their shards while this process loads
        its own.
        """
        if config.tensor_parallel_size > 1:
            # Refused before any process starts; the workers would find the same.
            check_tensor_parallel(config, self.model_config)
            config = parallel.rendezvous(config)
            local_size = config.tensor_parallel_size // config.nnodes
            self.workers = Workers(config, self.model_dir, range(1, local_size), self.max_model_len)
        try:
            runner = ModelRunner(config, self.model_config, self.model_dir)
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
            atexit.register(self.close)  # an in-process engine nobody closed: stop the workers before exiting
        return runner, num_blocks

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group; nothing to do with one rank.

        The engine serves no step after it.
        """
        if self.workers is None:
            return
        atexit.unregister(self.close)
        workers, self.workers = self.workers, None
        workers.closing = True
        with contextlib.suppress(RuntimeError):  # a worker already gone fails the broadcast: it needs no stop
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
        raise TypeError(f"not a command: {command!r}")

    def _confined(self, path: str) -> str:
        """A runtime load's ``path`` inside ``lora_dir``; refused without ``allow_runtime_lora``."""
        if self.info.runtime_lora_dir is None:
            raise InvalidRequestError("path", "this engine does not load LoRA adapters at run time")
        return str(confine_adapter_path(path, self.info.runtime_lora_dir))

    def add_lora(self, name: str, path: str) -> LoraAdapterInfo:
        """Load a PEFT LoRA adapter directory under ``name``; requests use it with ``lora_name=name``.

        Its weights stay on the host; it takes one of the ``max_loras`` device slots while requests use it
        (:mod:`spindle.backend.lora`).

        Raises:
            AlreadyExistsError: ``name`` is taken (field ``name``).
            InvalidRequestError: the directory is not a PEFT LoRA adapter this model can serve: files missing, a rank
                above ``max_lora_rank``, targets other than q/k/v/o/gate/up/down_proj, or matrices that do not fit
                the model (field ``path``).

        """
        try:
            info = self.runner.lora.add(name, path)
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
        self.runner.lora.remove(name)
        logger.info("Unloaded LoRA adapter %s", name)

    def list_loras(self) -> list[LoraAdapterInfo]:
        """The loaded LoRA adapters, in loading order."""
        return self.runner.lora.list_adapters()

    def add_request(self, request: EngineRequest) -> None:
        """Queue a tokenized request; ``n > 1`` becomes ``n`` sequences that share the prompt's blocks.

        Raises:
            InvalidRequestError: the request id is in use, the prompt leaves no room for a completion (an embedding
                request's may fill the context), a generation request comes to an embedding model, or an embedding
                request's pooling parameters do not fit the model (``dimensions`` above the hidden size, ``n > 1``).
            NotFoundError: ``lora_name`` names no loaded LoRA adapter (field ``lora_name``).

        """
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"request id {request.request_id!r} is already in use")
        pooling = None if request.pooling is None else self._check_pooling(request)
        if pooling is None and self.runner.is_pooling_model:
            raise InvalidRequestError(
                "sampling_params",
                f"{self.info.model_name} is an embedding model (a {self.model_config.architecture}, without an LM "
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
        lora_id = self.runner.lora.lookup(request.lora_name) if request.lora_name else None
        image_embeds: dict[int, torch.Tensor] = {}  # one for the n sequences: each image is encoded once
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
                image_embeds=image_embeds,
            )
            for i in range(request.params.n)
        ]
        self.requests[request.request_id] = seqs
        if lora_id is not None:
            self.runner.lora.acquire(lora_id)
        if request.params.structured_output is not None:
            self.pending_grammars[request.request_id] = self.structured_output.compile(request.params.structured_output)
        for seq in seqs:
            self.scheduler.add(seq)

    def _check_images(self, request: EngineRequest) -> None:
        """Refuse images the model cannot take: to a text-only model, or not as its vision encoder takes them.

        The frontend preprocesses images for this model; a mismatch here is a frontend for another model or a
        hand-built request.

        Raises:
            InvalidRequestError: the model takes no images, or an image's shape, pixels or placeholder span (its
                place, length and tokens) do not fit the model and the prompt.

        """
        model = self.runner.model
        if not getattr(model, "supports_images", False):
            raise InvalidRequestError(
                "prompt.multi_modal_data",
                f"{self.info.model_name} (a {self.model_config.architecture}) takes text only: send no images",
            )
        prompt = request.prompt_token_ids
        end_of_previous = 0
        for i, image in enumerate(request.images):
            span = prompt[image.offset : image.offset + image.length]
            problem = None
            if tuple(image.shape) != tuple(model.image_shape):
                problem = f"has shape {image.shape}; the vision encoder takes {list(model.image_shape)}"
            elif len(image.pixels) != 4 * math.prod(image.shape):
                problem = f"has {len(image.pixels)} bytes of pixels, not the {4 * math.prod(image.shape)} of its shape"
            elif image.length != model.num_image_tokens:
                problem = f"has {image.length} placeholder tokens; the model gives an image {model.num_image_tokens}"
            elif image.offset < end_of_previous or len(span) != image.length:
                problem = f"has its placeholder at [{image.offset}, {image.offset + image.length}), outside the prompt "
                problem += "or overlapping the previous image's"
            elif any(token != model.image_token_id for token in span):
                problem = f"has placeholder tokens other than the image token {model.image_token_id}"
            if problem is not None:
                raise InvalidRequestError(f"prompt.multi_modal_data[{i}]", f"image {i} {problem}")
            end_of_previous = image.offset + image.length

    def _check_pooling(self, request: EngineRequest) -> PoolingParams:
        """An embedding request's pooling parameters with the model's default pooling (``last``) filled in.

        Raises:
            InvalidRequestError: ``dimensions`` exceeds the hidden size, or the request asks for ``n > 1``.

        """
        assert request.pooling is not None
        hidden_size = self.model_config.hidden_size
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
        for request_id in request_ids:
            self.pending_grammars.pop(request_id, None)
            seqs = self.requests.pop(request_id, [])
            for seq in seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.ABORT)
            if seqs and seqs[0].lora_id is not None:
                self.runner.lora.release(seqs[0].lora_id)

    def pop_refused(self) -> list[tuple[str, RequestRefusedError]]:
        """The requests dropped since the last call because their structured-output spec did not compile, with why.

        They were accepted by :meth:`add_request` and are gone now (no delta reports them): their frontend must fail
        them with the error.
        """
        refused, self.refused = self.refused, []
        return refused

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion of a request (the frontend matched a stop string) and free its blocks."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return
        if not seqs[index].is_finished:
            self.scheduler.finish(seqs[index], FinishReason.STOP)
        self._forget_if_done(request_id)

    def stats(self) -> EngineStats:
        """The scheduler's and the KV cache's current state."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_draft_tokens=self.num_accepted_draft_tokens,
            num_prefix_cache_queries=self.block_manager.num_prefix_queries,
            num_prefix_cache_hits=self.block_manager.num_prefix_hits,
        )

    def has_request(self, request_id: str) -> bool:
        """Whether the request is still in flight (some completion of it unfinished)."""
        return request_id in self.requests

    def abort_all(self) -> list[SequenceDelta]:
        """Abort every request in flight; one ``ABORT`` delta per unfinished completion, for their owners."""
        deltas = [
            SequenceDelta(seq.request_id, seq.index, [], finish_reason=FinishReason.ABORT)
            for seqs in self.requests.values()
            for seq in seqs
            if not seq.is_finished
        ]
        self.abort_requests(list(self.requests))
        return deltas

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running."""
        return bool(self.requests)

    def step(self) -> list[SequenceDelta]:
        """Schedule, run, sample, apply the runner's output; return what changed for each sequence that got a token.

        Embedding sequences whose prompt the step completed come first, each with its embedding.
        """
        if self.pending_grammars:
            self._attach_grammars()
        self._propose_drafts()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.pending_grammars:
                # Nothing to run but compiles: wait for one instead of spinning (the compiler needs the core).
                wait(self.pending_grammars.values(), timeout=0.05, return_when=FIRST_COMPLETED)
            return []
        now = time.time()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        start = time.perf_counter()
        out = self.runner.execute(batch)
        self.scheduler.observe(batch, time.perf_counter() - start)
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.prompt_logprobs.extend(out.prompt_logprobs.get(seq.seq_id, ()))
            seq.num_computed_tokens += num_new
            if seq.seq_id in out.pooling_states:
                seq.pooling_state = out.pooling_states[seq.seq_id]
            if seq.images:
                self._keep_image_embeds(seq, out.image_embeds.get(seq.seq_id))
        deltas = [
            self._finish_embedding(seq, embedding)
            for seq, embedding in zip(out.pooled_seqs, out.embeddings, strict=True)
        ]
        for seq, token_ids, logprobs in zip(out.sampled_seqs, out.token_ids, out.logprobs, strict=True):
            first = seq.num_output_tokens == 0
            num_drafts = len(seq.spec_token_ids)
            if num_drafts:
                # The rejected drafts' K/V is not the sequence's: step back over it.
                self.num_draft_tokens += num_drafts
                self.num_accepted_draft_tokens += len(token_ids) - 1
                seq.num_computed_tokens -= num_drafts - (len(token_ids) - 1)
                seq.spec_token_ids = []
            emitted = 0
            for token_id in token_ids:
                seq.token_ids.append(token_id)
                emitted += 1
                if seq.grammar is not None:
                    self._advance_grammar(seq, token_id)
                if not seq.is_finished:
                    self._check_stop(seq, token_id)
                if seq.is_finished:
                    break
            if num_drafts and not seq.is_finished:
                self.block_manager.trim(seq)
            deltas.append(
                SequenceDelta(
                    request_id=seq.request_id,
                    index=seq.index,
                    new_token_ids=token_ids[:emitted],
                    new_logprobs=None if logprobs is None else logprobs[:emitted],
                    prompt_logprobs=seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    num_cached_tokens=seq.num_cached_tokens if first else 0,
                    first_scheduled_time=seq.first_scheduled_time if first else None,
                )
            )
            if seq.is_finished:
                self._forget_if_done(seq.request_id)
        return deltas

    @staticmethod
    def _keep_image_embeds(seq: Sequence, encoded: dict[int, torch.Tensor] | None) -> None:
        """Keep the images the step encoded for ``seq``'s later chunks; drop all once its placeholders are computed.

        The dict is shared with the request's other sequences, which get the new embeddings too; dropping rebinds
        ``seq``'s own, so the others keep theirs until their prompts are computed.
        """
        if encoded:
            seq.image_embeds.update(encoded)
        last = seq.images[-1]
        if seq.image_embeds and seq.num_computed_tokens >= last.offset + last.length:
            seq.image_embeds = {}

    def _finish_embedding(self, seq: Sequence, embedding: np.ndarray) -> SequenceDelta:
        """End an embedding sequence whose prompt is complete (its blocks are freed) and report its embedding."""
        self.scheduler.finish(seq, FinishReason.STOP)
        seq.pooling_state = None
        self._forget_if_done(seq.request_id)
        return SequenceDelta(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=[],
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            first_scheduled_time=seq.first_scheduled_time,
            embedding=embedding.astype("<f4", copy=False).tobytes(),
        )

    def _propose_drafts(self) -> None:
        """Give each decoding sequence that speculates its draft tokens for the next step (prompt lookup)."""
        for seq in self.scheduler.running:
            wanted = seq.params.num_speculative_tokens
            if wanted and len(seq) - seq.num_computed_tokens == 1:
                # Never past max_tokens or the context: the step emits up to one token more than its drafts.
                max_tokens = seq.params.max_tokens or self.max_model_len
                wanted = min(wanted, max_tokens - seq.num_output_tokens - 1, self.max_model_len - len(seq) - 1)
                seq.spec_token_ids = propose(seq.token_ids, wanted)
                if seq.grammar is not None and seq.spec_token_ids:
                    # Drafts the grammar forbids would be rejected anyway; and the runner masks each row after them.
                    accepted = 0
                    for token_id in seq.spec_token_ids:
                        if not seq.grammar.accept_token(token_id):
                            break
                        accepted += 1
                    seq.grammar.rollback(accepted)
                    del seq.spec_token_ids[accepted:]

    def _attach_grammars(self) -> None:
        """Give the sequences of each request whose grammar has compiled their matchers; drop those that failed."""
        for request_id, future in list(self.pending_grammars.items()):
            if not future.done():
                continue
            del self.pending_grammars[request_id]
            error = future.exception()
            if error is not None:
                assert isinstance(error, RequestRefusedError)
                logger.info("Refused request: %s", error, extra={"request_id": request_id})
                self.abort_requests([request_id])
                self.refused.append((request_id, error))
                continue
            for seq in self.requests[request_id]:
                seq.grammar = self.structured_output.matcher(future.result())
                seq.waiting_for_grammar = False

    def _advance_grammar(self, seq: Sequence, token_id: int) -> None:
        """Feed a new token to the sequence's matcher; end the sequence when its grammar is complete."""
        assert seq.grammar is not None
        if not seq.grammar.accept_token(token_id):
            # Only a token outside the mask gets here: min_tokens held back eos where the grammar allowed nothing
            # else, or every allowed token had a logit of -inf. The output so far is a valid prefix; stop there.
            logger.warning(
                "Token %d does not continue the grammar: ending the completion",
                token_id,
                extra={"request_id": seq.request_id},
            )
            self.scheduler.finish(seq, FinishReason.STOP)
        elif seq.grammar.is_terminated():
            self.scheduler.finish(seq, FinishReason.STOP)

    def _forget_if_done(self, request_id: str) -> None:
        """Drop a request once all its completions have finished (it is no longer unfinished work)."""
        seqs = self.requests[request_id]
        if all(seq.is_finished for seq in seqs):
            del self.requests[request_id]
            if seqs[0].lora_id is not None:
                self.runner.lora.release(seqs[0].lora_id)

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        params = seq.params
        max_tokens = params.max_tokens or self.max_model_len
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return self.scheduler.finish(seq, FinishReason.STOP)
            if params.stop_token_ids and token_id in params.stop_token_ids:
                return self.scheduler.finish(seq, FinishReason.STOP, token_id)
        if seq.num_output_tokens >= max_tokens or len(seq) >= self.max_model_len:
            self.scheduler.finish(seq, FinishReason.LENGTH)
