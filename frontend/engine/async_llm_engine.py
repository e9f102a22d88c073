"""``AsyncLLMEngine``: asyncio streams over an engine core that runs in one or several backend processes."""

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from spindle.frontend.engine.admission import Admission
from spindle.frontend.engine.async_client import RankStats
from spindle.frontend.engine.beam_search import BeamSearch, beam_prompts, step_params, top_logprobs
from spindle.frontend.engine.client import AsyncEngineClient, make_async_client
from spindle.frontend.engine.connection import EngineDeadError
from spindle.frontend.engine.kv_events import KvEventHub
from spindle.frontend.processing.input_processor import ProcessedPrompt
from spindle.frontend.processing.output_processor import OutputProcessor, RequestState
from spindle.frontend.processing.reasoning import ReasoningParser, reasoning_parser
from spindle.frontend.processing.tokenizer import Tokenizer
from spindle.shared import (
    CompletionOutput,
    EmbeddingRequestOutput,
    FinishReason,
    PoolingParams,
    PromptInputs,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from spindle.shared.beam_search import BeamSearchParams
from spindle.shared.config import EngineConfig, RecoveryConfig, SchedulerConfig, request_id_var
from spindle.shared.errors import RequestRefusedError
from spindle.shared.lora import LoraAdapterInfo, LoRARequest, check_lora_name
from spindle.shared.protocol import (
    Command,
    EngineInfo,
    EngineStats,
    ListLoras,
    LoadLora,
    ResetPrefixCache,
    SequenceDelta,
    UnloadLora,
)

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """Serve many concurrent streams from a backend process (or several), as vLLM's ``AsyncLLMEngine`` does.

    Tokenization, chat templates, detokenization and stop strings happen here, in the frontend process, which never
    imports torch; the backend sees token ids only. The engine client's task receives each step's deltas for all
    requests; the engine detokenizes them and feeds each request's queue. A stream that is cancelled or closed aborts
    its request in the backend, which frees its KV blocks at once.

    A stream whose reader falls behind holds its request back: once ``stream_buffer_outputs`` outputs wait unread in
    its queue, the request is paused in the backend (:class:`~spindle.shared.protocol.Pause`), where it keeps its KV
    blocks but gets no tokens, so the queue stops growing and a stream nobody reads costs no compute; once the
    reader has taken half of them, it is resumed and goes on as it would have. Pausing never ends a request: its
    reader does (the gRPC server aborts a stream left unread for ``unread_timeout``).

    If the backend dies (it exits, or sends nothing for ``HEARTBEAT_TIMEOUT`` seconds: hung), every call raises
    :class:`EngineDeadError` until a backend is back. The client brings one back
    (:class:`~spindle.frontend.engine.supervisor.ConnectionSupervisor`): it kills a backend it started and starts a
    new one, or reconnects to the backend at the address it was given, until one answers. It waits 1 s before the
    first attempt, twice as long after each failure, up to 30 s; the wait starts again from 1 s once a backend has
    served for 60 s. With several backends (``data_parallel_size``, or several addresses: a
    :class:`~spindle.frontend.engine.data_parallel.DataParallelClient`), each request goes to one of them, and a dead
    one disturbs only its own streams.

    The streams of a dead backend pause meanwhile, and are resumed (``resume_streams``, on by default): each request
    is sent again as its prompt and the tokens it has streamed, taken as its output so far, to the backend that takes
    over, or at once to another engine that serves, and its stream goes on with the next token, as it would have
    (greedy and seeded ones token for token); the completions that had finished stay so. A request is resumed at most
    ``max_stream_resumes`` times; when its backend dies once more, or with ``resume_streams`` off, its stream raises
    :class:`EngineDeadError` within two seconds of the death. An embedding request is sent again whole.

    Example::

        engine = AsyncLLMEngine.from_args(kv_cache_memory="1GiB")

        async def main():
            params = SamplingParams(temperature=0, max_tokens=32)
            async for output in engine.generate("The capital of France is", params, request_id="r1"):
                print(output.outputs[0].text)

        asyncio.run(main())
        engine.shutdown()

    Args:
        client: the engine client, connected to its backend (or backends).
        recovery: what to do with the requests of a backend that dies (by default: resume them).
        stream_buffer_outputs: the unread outputs a stream holds before its request is paused (see above).
        reasoning: the reasoning parser that splits every completion's text (``reasoning_parser``), or None.

    Attributes:
        num_resumed_requests: how many times a request was sent again after its backend died.
        num_resume_failures: the requests whose stream failed because their backend died once more after they had
            been resumed ``max_stream_resumes`` times.
        kv_events: relays the backends' KV cache events to subscribers (the ``SubscribeKvEvents`` RPC); the
            backends build none while it has none.

    """

    def __init__(
        self,
        client: AsyncEngineClient,
        recovery: RecoveryConfig | None = None,
        stream_buffer_outputs: int = SchedulerConfig.stream_buffer_outputs,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.client = client
        self.recovery = recovery or RecoveryConfig()
        self.stream_buffer_outputs = stream_buffer_outputs
        self.admission = Admission(client.info, client.call, reasoning)
        self.output_processor = OutputProcessor(self.admission.tokenizer)
        self.queues: dict[str, asyncio.Queue[RequestOutput | EmbeddingRequestOutput | BaseException]] = {}
        self.num_resumed_requests = 0
        self.num_resume_failures = 0
        self._closed = False
        # The requests whose backend died, in the order they are to be sent again, and the task that sends them.
        self._paused: dict[str, RequestState] = {}
        self._resuming: asyncio.Task | None = None
        # The requests paused in their backend because their streams' readers fell behind.
        self._held_back: set[str] = set()
        self.kv_events = KvEventHub(client)
        client.attach(self)

    @classmethod
    def from_args(
        cls,
        backend_address: str | None = None,
        startup_timeout: float = 600.0,
        data_parallel_size: int = 1,
        **engine_args: object,
    ) -> "AsyncLLMEngine":
        """Connect to the backend at ``backend_address``, or start one as a child process with ``engine_args``.

        ``engine_args`` are :class:`~spindle.shared.config.EngineConfig` fields (``model``, ``dtype``,
        ``kv_cache_memory``, ...); they only matter for backends this call starts. With ``data_parallel_size`` N it
        starts N backends, each with its own KV cache (and its own GPUs where there are enough, or else an equal
        share of this machine's cores), and routes each request to one of them; a comma-separated
        ``backend_address`` connects to one backend engine per address the same way
        (:func:`~spindle.frontend.engine.client.make_async_client`).
        """
        config = EngineConfig.of(**engine_args)
        client = make_async_client(config, backend_address, data_parallel_size, startup_timeout)
        reasoning = reasoning_parser(config.structured_output.reasoning_parser)
        return cls(client, config.recovery, config.scheduler.stream_buffer_outputs, reasoning)

    @property
    def info(self) -> EngineInfo:
        """The engine's description (model, limits, tokenizer files), from its backend's handshake."""
        return self.client.info

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.admission.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest prompt + completion the engine accepts."""
        return self.info.max_model_len

    @property
    def is_dead(self) -> bool:
        """Whether no backend serves now: it died and none is back yet, or the engine was shut down."""
        return self._closed or self.client.is_dead

    @property
    def num_backend_restarts(self) -> int:
        """How many times a new backend took over from a dead one, over all backends.

        Restarted (a backend this engine started) or reconnected to (one at ``backend_address``).
        """
        return self.client.num_restarts

    async def beam_search(
        self,
        inputs: PromptInputs,
        params: BeamSearchParams,
        request_id: str | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Beam-search one prompt, as :meth:`LLM.beam_search <spindle.frontend.engine.llm.LLM.beam_search>` does.

        It yields one output, when the search ends, whose completions are the ``beam_width`` beams, best first. Each
        step's one-token requests (``<request_id>-beam<step>-<beam>``) run concurrently; cancelling the task
        aborts them. A completion's ``cumulative_logprob`` is its beam's, and its score is that over its length to
        the power ``length_penalty``.

        Raises:
            InvalidRequestError: a bad prompt (or one with images), or a ``beam_width`` the log-probabilities of a
                step cannot serve.

        """
        request_id = request_id or uuid.uuid4().hex
        arrival = time.time()
        token_ids = beam_prompts(self.admission.input_processor, [inputs], params)
        search = BeamSearch(token_ids, params, self.info.eos_token_ids, self.info.max_model_len)
        step = step_params(search)

        async def extend(beam: list[int], beam_request_id: str) -> dict[int, float]:
            outputs = self.generate({"prompt_token_ids": beam}, step, beam_request_id, lora_request=lora_request)
            final = [output async for output in outputs][-1]  # one token: one output
            return top_logprobs(final, search.num_candidates)

        first_token_time = None
        for number in itertools.count():
            beams = search.running()
            if not beams:
                break
            search.advance(
                await asyncio.gather(*(extend(beam, f"{request_id}-beam{number}-{i}") for i, beam in enumerate(beams)))
            )
            first_token_time = first_token_time or time.time()
        (result,) = search.outputs(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        yield RequestOutput(
            request_id=request_id,
            prompt=inputs if isinstance(inputs, str) else inputs.get("prompt"),
            prompt_token_ids=token_ids[0],
            prompt_logprobs=None,
            outputs=[
                CompletionOutput(
                    index=i,
                    text=beam.text,
                    token_ids=beam.output_token_ids,
                    cumulative_logprob=beam.cum_logprob,
                    finish_reason=beam.finish_reason,
                )
                for i, beam in enumerate(result.sequences)
            ],
            finished=True,
            metrics=RequestMetrics(arrival, first_token_time=first_token_time, finished_time=time.time()),
        )

    async def generate(
        self,
        inputs: PromptInputs,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        delta: bool = False,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request until it finishes.

        Each :class:`~spindle.shared.RequestOutput` is cumulative (the text and tokens so far), or with ``delta=True``
        holds only what is new since the previous one. Breaking out, closing the generator or cancelling the task
        aborts the request in the backend. ``priority`` orders the request under the backend's
        ``scheduling_policy="priority"`` (lower runs first, as in vLLM); the ``fcfs`` policy ignores it.
        ``lora_request`` names the LoRA adapter to generate with; one with a ``lora_path`` is loaded under its name
        first unless it is loaded already (:doc:`lora`).

        Raises:
            InvalidRequestError: bad inputs or parameters, a request id already in use, an adapter that does not load
                or one loaded under this name from another path; nothing is queued.
            NotFoundError: no adapter has the ``lora_request``'s name.
            EngineUnavailableError: the backend is shutting down and refused the request.
            EngineDeadError: the backend died during the request, or is down (being brought back) when it comes.

        """
        params = sampling_params or SamplingParams()
        prompt = await self.admission.input_processor.process_async(inputs, params)
        async for output in self._stream(request_id, prompt, params, delta, priority, lora_request):
            yield output

    async def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        add_generation_prompt: bool = True,
        delta: bool = False,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = "auto",
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Like :meth:`generate` for a conversation, rendered with the model's chat template.

        ``tools`` and ``tool_choice`` are those of
        :meth:`~spindle.frontend.engine.llm_engine.LLMEngine.add_chat_request`: a finished completion of a request with
        tools carries its parsed calls (:doc:`tool_calling`).
        """
        params = sampling_params or SamplingParams()
        prompt = await self.admission.input_processor.process_chat_async(
            messages, params, add_generation_prompt, tools, tool_choice
        )
        async for output in self._stream(request_id, prompt, params, delta, priority, lora_request):
            yield output

    async def load_lora(self, name: str, path: str, *, confined: bool = False) -> LoraAdapterInfo:
        """Load the PEFT adapter directory ``path`` under ``name`` in the backends, for requests to name.

        Args:
            name: what requests will call it.
            path: the adapter's directory, as the backends process sees it.
            confined: load it as the gRPC API does: only if the backends runs with ``allow_runtime_lora``, and from
                its ``lora_dir`` (``path`` relative to it, or absolute inside it; see :doc:`lora`).

        Raises:
            InvalidRequestError: an empty name, no adapter the engine can serve at ``path``, or (``confined``) a path
                outside the backends's ``lora_dir`` or a backend that does not load adapters at run time.
            AlreadyExistsError: an adapter is loaded under ``name`` already.
            EngineDeadError: the backends is down.
            EngineUnavailableError: the backends did not answer within ``CALL_TIMEOUT`` seconds.

        """
        check_lora_name(name)
        return await self.call(LoadLora(name, path, confined))

    async def unload_lora(self, name: str) -> None:
        """Unload the adapter ``name`` in the backends; requests already running with it finish with it.

        Raises:
            NotFoundError: no adapter is loaded under ``name``.
            EngineDeadError: the backends is down.
            EngineUnavailableError: the backends did not answer within ``CALL_TIMEOUT`` seconds.

        """
        await self.call(UnloadLora(name))
        self.admission.forget_lora(name)

    async def list_loras(self) -> list[LoraAdapterInfo]:
        """The adapters the backends has loaded (:class:`EngineDeadError` while it is down)."""
        return await self.call(ListLoras())

    async def call(self, command: Command) -> Any:
        """Run a control-plane command in the backends and await its result (see :meth:`load_lora`)."""
        self._check_open()
        return await self.client.call(command)

    async def flush_cache(self, timeout: float = 0.0) -> bool:
        """Forget every backend's cached prefixes (a ``KvCacheCleared`` event each), once no request is in flight.

        It waits up to ``timeout`` seconds for the backends to go idle; returns whether every one was reset (a
        backend busy past the deadline is not; those reset before it stay reset).

        Raises:
            EngineDeadError: no backend serves, or one died meanwhile.

        """
        deadline = time.monotonic() + timeout
        while not await self.client.call(ResetPrefixCache()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def embed(
        self,
        inputs: PromptInputs | Sequence[PromptInputs],
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
    ) -> list[EmbeddingRequestOutput]:
        """Embed a batch of prompts (or one): all are queued at once, and the embeddings come back in input order.

        Each prompt is one engine request, ``{request_id}-{i}``, prefilled in the backend's steps beside the other
        requests and pooled as ``pooling_params`` say (:doc:`embeddings`). Every prompt is checked before any is
        queued; an error names the prompt at fault as the ``Embed`` RPC does (``inputs[2].token_ids[0]``). When one
        request fails, or the caller is cancelled, the others are aborted.

        Raises:
            InvalidRequestError: a bad prompt or parameter (``dimensions`` above the model's hidden size comes from
                the backend), or a request id in use; nothing is left queued.
            EngineUnavailableError: the backend is shutting down and refused a request.
            EngineDeadError: the backend died during the requests, or is down when they come.

        """
        self._check_open()
        pooling = pooling_params or PoolingParams()
        prompts = self.admission.embedding_prompts(inputs)
        request_ids = self.admission.batch_ids(request_id, len(prompts), self.queues)
        admitted = [
            self.admission.request(rid, prompt, pooling, priority=priority)
            for rid, prompt in zip(request_ids, prompts, strict=True)
        ]
        queues: dict[str, asyncio.Queue[RequestOutput | EmbeddingRequestOutput | BaseException]] = {}
        try:
            for request, state in admitted:
                queues[request.request_id] = self.queues[request.request_id] = asyncio.Queue()
                state.request = request
                self.output_processor.add_request(state)
            await self.client.add_requests([request for request, _ in admitted])
            logger.debug("Embedding requests added: %d prompts", len(prompts), extra={"request_id": request_ids[0]})
            outputs = []
            for queue in queues.values():
                item = await queue.get()  # an embedding request has one output, when it ends
                if isinstance(item, BaseException):
                    raise item
                outputs.append(item)
            return outputs
        finally:
            for rid in queues:
                del self.queues[rid]
                if rid in self.output_processor.requests:  # failed or cancelled before it ended: free its blocks
                    self._abort(rid)

    async def abort(self, request_id: str) -> bool:
        """Abort a request: its stream ends with a final output whose unfinished completions end with ``ABORT``.

        Returns whether the request was in flight (``False``: unknown or ended already, nothing to do).
        """
        state = self.output_processor.requests.get(request_id)
        if state is None:
            return False
        self._abort(request_id)
        for completion in state.completions:
            completion.finish_reason = completion.finish_reason or FinishReason.ABORT
        queue = self.queues.get(request_id)
        if queue is not None:
            queue.put_nowait(state.output())
        return True

    async def get_stats(self) -> EngineStats:
        """The backends' scheduler and KV cache state, added up, as of each one's next heartbeat or step.

        That is at most 0.25 s away.
        """
        self._check_open()
        return await self.client.get_stats()

    def rank_stats(self) -> list[RankStats]:
        """Each backend's latest figures (stats, restarts, whether it serves), one entry per backend."""
        return self.client.rank_stats()

    def shutdown(self) -> None:
        """Stop receiving, any attempt to bring a backend back, and the backends this engine started (if any)."""
        self._closed = True
        self.client.close()

    def on_step(self, deltas: list[SequenceDelta]) -> None:
        """Turn a step's deltas into outputs for the streams; end in the backend what a stop string ended here.

        A request whose output could not be processed is aborted in the backend, and its stream raises the
        :class:`~spindle.shared.errors.OutputProcessingError`; the other streams get their outputs as ever.
        """
        outputs, stopped, failed = self.output_processor.process(deltas)
        for request_id, index in stopped:
            self.client.finish_sequence(request_id, index)
        if failed:
            self.client.abort_requests([error.request_id for error in failed])
        for error in failed:
            queue = self.queues.get(error.request_id)
            if queue is not None:
                queue.put_nowait(error)
        lagging = []
        for output in outputs:
            queue = self.queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
                if self._lags(output, queue):
                    lagging.append(output.request_id)
        if lagging:
            self._held_back.update(lagging)
            self.client.pause_requests(lagging)

    def _lags(self, output: RequestOutput | EmbeddingRequestOutput, queue: asyncio.Queue) -> bool:
        """Whether an unfinished request's stream, not held back yet, holds ``stream_buffer_outputs`` unread."""
        if output.finished or output.request_id in self._held_back:
            return False
        return queue.qsize() >= self.stream_buffer_outputs

    def _catch_up(self, request_id: str, queue: asyncio.Queue) -> None:
        """Resume a held-back request once its reader has taken half of what its stream held."""
        if request_id in self._held_back and queue.qsize() <= self.stream_buffer_outputs // 2:
            self._held_back.discard(request_id)
            self.client.pause_requests([request_id], resume=True)

    def on_refused(self, request_id: str, error: RequestRefusedError) -> None:
        """A backend refused a request: its stream raises ``error``."""
        self.output_processor.abort_requests([request_id])
        queue = self.queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def on_lost(self, request_ids: list[str], error: EngineDeadError) -> None:
        """A backend died: its requests pause until a backend serves, to be resumed there, or their streams raise.

        They raise ``error`` with ``resume_streams`` off, and once a request was resumed ``max_stream_resumes``
        times.
        """
        limit = self.recovery.max_stream_resumes
        exhausted = EngineDeadError(f"{error}; not resumed again (max_stream_resumes={limit})")
        self._held_back.difference_update(request_ids)  # a backend that takes them over runs them: held back anew
        for request_id in request_ids:
            state = self.output_processor.requests.get(request_id)
            if not self.recovery.resume_streams or state is None:
                self._fail(request_id, error)
            elif state.num_resumes >= limit:
                self.num_resume_failures += 1
                self._fail(request_id, exhausted)
            else:
                logger.warning("Request paused: its backend died (%s)", error, extra={"request_id": request_id})
                self._paused[request_id] = state
        self._resume_paused()

    def on_adopted(self) -> None:
        """A new backend took over: follow its tokenizer and limits, and resume the paused requests there."""
        self.admission.adopt(self.client.info)
        self.output_processor.tokenizer = self.admission.tokenizer  # the same object: the requests' follow it
        self._resume_paused()

    def _fail(self, request_id: str, error: EngineDeadError) -> None:
        """End a request lost with its backend: its stream raises ``error``."""
        self.output_processor.abort_requests([request_id])
        queue = self.queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _resume_paused(self) -> None:
        """Start sending the paused requests again, unless that is under way or no backend serves."""
        if self._paused and not self.client.is_dead and (self._resuming is None or self._resuming.done()):
            self._resuming = asyncio.get_running_loop().create_task(self._resume())

    async def _resume(self) -> None:
        """Send each paused request again, as it stands (:meth:`RequestState.resumed_request`), while a backend serves.

        One that no backend takes (they all died meanwhile) stays paused for the next backend that serves.
        """
        while self._paused and not self.client.is_dead:
            request_id, state = next(iter(self._paused.items()))
            request = state.resumed_request()
            try:
                await self.client.add_requests([request])
            except EngineDeadError:
                return
            if self._paused.pop(request_id, None) is None:  # aborted while it was being sent: free it there
                self.client.abort_requests([request_id])
                continue
            state.num_resumes += 1
            self.num_resumed_requests += 1
            streamed = sum(len(completion.token_ids) for completion in request.resumed or [])
            logger.info(
                "Request resumed (%d of at most %d times), after %d tokens streamed",
                state.num_resumes,
                self.recovery.max_stream_resumes,
                streamed,
                extra={"request_id": request_id},
            )

    async def _stream(
        self,
        request_id: str | None,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        delta: bool,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> AsyncIterator[RequestOutput]:
        self._check_open()
        request, state = await self.admission.admit(
            request_id, prompt, params, self.queues, delta=delta, priority=priority, lora_request=lora_request
        )
        request_id = request.request_id
        # Set in the consumer's context (a generator runs in its caller's), so that its log lines name the request;
        # the lines below name it themselves, as a generator may be closed from another context.
        log_context = request_id_var.set(request_id)
        about = {"request_id": request_id}
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.queues[request_id] = queue
        finished = False
        try:
            state.request = request
            self.output_processor.add_request(state)
            await self.client.add_requests([request])
            logger.debug("Request added: %d prompt tokens", len(prompt.prompt_token_ids), extra=about)
            while not finished:
                item = await queue.get()
                self._catch_up(request_id, queue)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if finished:  # before the yield: a consumer may stop iterating at the last output
                    _log_finished(state, about)
                yield item
        except EngineDeadError as error:
            logger.warning("Request failed: the backend is down (%s)", error, extra=about)
            raise
        except RequestRefusedError as error:
            logger.info("Request refused by the backend: %s", error, extra=about)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            logger.info("Request aborted: its stream was closed or cancelled", extra=about)
            raise
        finally:
            del self.queues[request_id]
            self._held_back.discard(request_id)
            if not finished:
                self._abort(request_id)
            with contextlib.suppress(ValueError):  # closed from another context (an event loop's finalizer)
                request_id_var.reset(log_context)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    def _abort(self, request_id: str) -> None:
        self._paused.pop(request_id, None)
        self.output_processor.abort_requests([request_id])
        self.client.abort_requests([request_id])


def _log_finished(state: RequestState, about: dict[str, str]) -> None:
    """One line per request that ends with an output: how it ended, its tokens and its time."""
    logger.info(
        "Request finished (%s): %d prompt tokens (%d cached), %d generated in %.3f s",
        ",".join(str(c.finish_reason) for c in state.completions),
        len(state.prompt_token_ids),
        state.num_cached_tokens,
        sum(len(c.token_ids) for c in state.completions),
        time.time() - state.metrics.arrival_time,
        extra=about,
    )
