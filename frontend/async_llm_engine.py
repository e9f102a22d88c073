"""``AsyncLLMEngine``: asyncio streams over an engine core that runs in a backend process."""

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import zmq

from spindle.frontend.admission import Admission
from spindle.frontend.core_client import (
    CALL_TIMEOUT,
    BackendConnection,
    BackendProcess,
    EngineDeadError,
    start_backend,
)
from spindle.frontend.input_processor import InputProcessor, ProcessedPrompt
from spindle.frontend.output_processor import OutputProcessor, RequestState
from spindle.frontend.tokenizer import Tokenizer
from spindle.shared import (
    EmbeddingRequestOutput,
    FinishReason,
    PoolingParams,
    PromptInputs,
    RequestOutput,
    SamplingParams,
)
from spindle.shared.config import EngineConfig, request_id_var
from spindle.shared.errors import EngineUnavailableError, RequestRefusedError
from spindle.shared.lora import LoraAdapterInfo, LoRARequest, check_lora_name
from spindle.shared.protocol import (
    Call,
    CallReply,
    Command,
    EngineInfo,
    EngineStats,
    Heartbeat,
    ListLoras,
    LoadLora,
    RequestError,
    StepOutputs,
    UnloadLora,
    decode_result,
)

logger = logging.getLogger(__name__)

RESTART_BACKOFF_INITIAL = 1.0
"""Seconds before the first attempt to bring a dead backend back (the wait before a restart, or the time a
reconnection attempt waits for an answer)."""

RESTART_BACKOFF_MAX = 30.0
"""The longest wait: each failed attempt doubles the wait, up to this."""

RESTART_BACKOFF_RESET = 60.0
"""Seconds a backend must have served for the wait to start again from ``RESTART_BACKOFF_INITIAL`` when it dies; one
that dies sooner (a crash loop) is brought back after twice the previous wait."""


class AsyncLLMEngine:
    """Serve many concurrent streams from one backend process, as vLLM's ``AsyncLLMEngine`` does.

    Tokenization, chat templates, detokenization and stop strings happen here, in the frontend process, which never
    imports torch; the backend sees token ids only. One output task receives each step's deltas for all requests,
    detokenizes them and feeds each request's queue. A stream that is cancelled or closed aborts its request in the
    backend, which frees its KV blocks at once.

    If the backend dies (it exits, or sends nothing for ``HEARTBEAT_TIMEOUT`` seconds: hung), every stream raises
    :class:`EngineDeadError` within two seconds, and so does every call until a backend is back. The output task
    brings one back: it kills a backend this engine started and starts a new one, or reconnects to the backend at
    the address it was given, until one answers. It waits 1 s before the first attempt, twice as long after each
    failure, up to 30 s; the wait starts again from 1 s once a backend has served for 60 s.

    Example::

        engine = AsyncLLMEngine.from_args(kv_cache_memory="1GiB")

        async def main():
            params = SamplingParams(temperature=0, max_tokens=32)
            async for output in engine.generate("The capital of France is", params, request_id="r1"):
                print(output.outputs[0].text)

        asyncio.run(main())
        engine.shutdown()

    Attributes:
        num_backend_restarts: how many times a new backend took over from a dead one: restarted (a backend this
            engine started) or reconnected to (a backend at ``backend_address``).

    """

    def __init__(self, connection: BackendConnection) -> None:
        self.connection = connection
        self.admission = Admission(connection.info, self.call)
        self.output_processor = OutputProcessor(self.admission.tokenizer)
        self.queues: dict[str, asyncio.Queue[RequestOutput | EmbeddingRequestOutput | BaseException]] = {}
        self.stats: EngineStats | None = None
        self.num_backend_restarts = 0
        self._stats_updated: asyncio.Event | None = None
        self._output_task: asyncio.Task | None = None
        self._closed = False
        # While no backend serves: what calls raise, and the death that started it.
        self._down: EngineDeadError | None = None
        self._down_cause: EngineDeadError | None = None
        self._up_since = time.monotonic()
        self._next_delay = RESTART_BACKOFF_INITIAL
        self._opening: tuple[threading.Event, concurrent.futures.Future[BackendConnection]] | None = None
        self._calls: dict[str, asyncio.Future[CallReply]] = {}  # control-plane calls awaiting the backend's reply

    @classmethod
    def from_args(
        cls, backend_address: str | None = None, startup_timeout: float = 600.0, **engine_args: object
    ) -> "AsyncLLMEngine":
        """Connect to the backend at ``backend_address``, or start one as a child process with ``engine_args``.

        ``engine_args`` are :class:`~spindle.shared.config.EngineConfig` fields (``model``, ``dtype``,
        ``kv_cache_memory``, ...); they only matter for a backend this call starts.
        """
        config = EngineConfig(**engine_args)
        return cls(BackendConnection(backend_address, config, use_asyncio=True, startup_timeout=startup_timeout))

    @property
    def info(self) -> EngineInfo:
        """The engine's description (model, limits, tokenizer files), from its backend's handshake."""
        return self.admission.info

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.admission.tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        """What checks and tokenizes prompts and conversations for this engine."""
        return self.admission.input_processor

    @property
    def max_model_len(self) -> int:
        """The longest prompt + completion the engine accepts."""
        return self.info.max_model_len

    @property
    def is_dead(self) -> bool:
        """Whether no backend serves now: it died and none is back yet, or the engine was shut down."""
        return self._closed or self._down is not None or self.connection.dead is not None

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
        prompt = await self.input_processor.process_async(inputs, params)
        async for output in self.generate_processed(
            prompt, params, request_id, delta=delta, priority=priority, lora_request=lora_request
        ):
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

        ``tools`` and ``tool_choice`` are those of :meth:`~spindle.frontend.llm_engine.LLMEngine.add_chat_request`:
        a finished completion of a request with tools carries its parsed calls (:doc:`tool_calling`).
        """
        params = sampling_params or SamplingParams()
        prompt = await self.input_processor.process_chat_async(
            messages, params, add_generation_prompt, tools, tool_choice
        )
        async for output in self.generate_processed(
            prompt, params, request_id, delta=delta, priority=priority, lora_request=lora_request
        ):
            yield output

    async def generate_processed(
        self,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        delta: bool = False,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Like :meth:`generate` for a prompt that :attr:`input_processor` has already checked and tokenized.

        A router that needs a prompt's token ids to choose an engine
        (:class:`~spindle.frontend.data_parallel.DataParallelEngine`) tokenizes it once and streams it here; a chat
        prompt with tools constrains ``params`` to its tool calls, as :meth:`chat` does. Raises what
        :meth:`generate` raises, except for the checks of the inputs.
        """
        async for output in self._stream(request_id, prompt, params, delta, priority, lora_request):
            yield output

    async def load_lora(self, name: str, path: str, *, confined: bool = False) -> LoraAdapterInfo:
        """Load the PEFT adapter directory ``path`` under ``name`` in the backend, for requests to name.

        Args:
            name: what requests will call it.
            path: the adapter's directory, as the backend process sees it.
            confined: load it as the gRPC API does: only if the backend runs with ``allow_runtime_lora``, and from
                its ``lora_dir`` (``path`` relative to it, or absolute inside it; see :doc:`lora`).

        Raises:
            InvalidRequestError: an empty name, no adapter the engine can serve at ``path``, or (``confined``) a path
                outside the backend's ``lora_dir`` or a backend that does not load adapters at run time.
            AlreadyExistsError: an adapter is loaded under ``name`` already.
            EngineDeadError: the backend is down.
            EngineUnavailableError: the backend did not answer within ``CALL_TIMEOUT`` seconds.

        """
        check_lora_name(name)
        return await self.call(LoadLora(name, path, confined))

    async def unload_lora(self, name: str) -> None:
        """Unload the adapter ``name`` in the backend; requests already running with it finish with it.

        Raises:
            NotFoundError: no adapter is loaded under ``name``.
            EngineDeadError: the backend is down.
            EngineUnavailableError: the backend did not answer within ``CALL_TIMEOUT`` seconds.

        """
        await self.call(UnloadLora(name))
        self.admission.forget_lora(name)

    async def list_loras(self) -> list[LoraAdapterInfo]:
        """The adapters the backend has loaded (:class:`EngineDeadError` while it is down)."""
        return await self.call(ListLoras())

    async def call(self, command: Command) -> Any:
        """Run a control-plane command in the backend and await its result (the output task routes the reply here)."""
        self._start_output_task()
        call = Call(uuid.uuid4().hex, command)
        reply: asyncio.Future[CallReply] = asyncio.get_running_loop().create_future()
        self._calls[call.call_id] = reply
        try:
            self.connection.send(call)
            async with asyncio.timeout(CALL_TIMEOUT):
                answer = await reply
        except TimeoutError:
            raise EngineUnavailableError(
                f"the backend did not answer a {type(command).__name__} within {CALL_TIMEOUT:g} s: it may still carry "
                "it out, check before retrying"
            ) from None
        finally:
            del self._calls[call.call_id]
        return decode_result(command, answer)

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
        pooling = pooling_params or PoolingParams()
        prompts = self.admission.embedding_prompts(inputs)
        self._start_output_task()
        request_ids = self.admission.batch_ids(request_id, len(prompts), self.queues)
        queues: dict[str, asyncio.Queue[RequestOutput | EmbeddingRequestOutput | BaseException]] = {}
        try:
            for rid, prompt in zip(request_ids, prompts, strict=True):
                request, state = self.admission.request(rid, prompt, pooling, priority=priority)
                queues[rid] = self.queues[rid] = asyncio.Queue()
                self.output_processor.add_request(state)
                self.connection.add_request(request)
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
        """The backend's scheduler and KV cache state, as of its next heartbeat or step (at most 0.25 s away)."""
        self._start_output_task()
        self._stats_updated.clear()
        await self._stats_updated.wait()
        self._check_alive()
        return self.stats

    def shutdown(self) -> None:
        """Stop the output task, any attempt to bring a backend back, and the backend this engine started (if any)."""
        self._closed = True
        if self._output_task is not None:
            self._output_task.cancel()
        self._abandon_opening()
        self.connection.close()

    async def _stream(
        self,
        request_id: str | None,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        delta: bool,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> AsyncIterator[RequestOutput]:
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
            self._start_output_task()
            self.output_processor.add_request(state)
            self.connection.add_request(request)
            logger.debug("Request added: %d prompt tokens", len(prompt.prompt_token_ids), extra=about)
            while not finished:
                item = await queue.get()
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
            if not finished:
                self._abort(request_id)
            with contextlib.suppress(ValueError):  # closed from another context (an event loop's finalizer)
                request_id_var.reset(log_context)

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if self._down is not None:
            raise self._down
        self.connection.check_alive()

    def _start_output_task(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        # One output task per event loop: a task of an earlier asyncio.run() is done and cannot be awaited here.
        # It is started even while the backend is down: it is what brings one back.
        task = self._output_task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._stats_updated = asyncio.Event()
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop())
        self._check_alive()

    def _abort(self, request_id: str) -> None:
        self.output_processor.abort_requests([request_id])
        with contextlib.suppress(EngineDeadError):
            self.connection.abort_requests([request_id])

    async def _output_loop(self) -> None:
        """Receive every message from the backend; when it dies, fail the streams in flight and bring one back."""
        while True:
            if self._down is None:
                try:
                    await self._receive(self.connection)
                except EngineDeadError as dead:
                    self._down = self._down_cause = dead
                    self._stats_updated.set()  # get_stats() callers see the error through _check_alive
                    for queue in self.queues.values():
                        queue.put_nowait(dead)
                    for reply in self._calls.values():
                        if not reply.done():
                            reply.set_exception(dead)
                    self.output_processor.abort_requests(list(self.output_processor.requests))
            await self._recover()

    async def _receive(self, connection: BackendConnection) -> None:
        """Turn the backend's step outputs into request outputs for the streams, until it dies (EngineDeadError)."""
        while True:
            # Drain what is there before awaiting readiness: ZeroMQ signals readiness on edges only.
            try:
                payload = connection.sync_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                await connection.socket.poll(50)
                connection.check_alive()
                continue
            message = connection.decode(payload)
            if isinstance(message, StepOutputs | Heartbeat):
                self.stats = message.stats
                self._stats_updated.set()
            if isinstance(message, StepOutputs):
                outputs, stopped = self.output_processor.process(message.deltas)
                for request_id, index in stopped:
                    connection.finish_sequence(request_id, index)
                for output in outputs:
                    queue = self.queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
            elif isinstance(message, RequestError):
                self.output_processor.abort_requests([message.request_id])
                queue = self.queues.get(message.request_id)
                if queue is not None:
                    queue.put_nowait(message.to_exception())
            elif isinstance(message, CallReply):
                reply = self._calls.get(message.call_id)
                if reply is not None and not reply.done():  # else its caller gave up waiting
                    reply.set_result(message)
            connection.check_alive()

    async def _recover(self) -> None:
        """Replace the dead backend: restart the one this engine started, or reconnect to the remote one.

        Attempts go on, with the backoff of ``RESTART_BACKOFF_*``, until one succeeds or the task is cancelled.
        """
        old = self.connection
        old.close()  # SIGKILLs a backend this engine started: dead or hung, it has nothing left to finish
        owned = old.process is not None
        cause = self._down_cause
        if time.monotonic() - self._up_since >= RESTART_BACKOFF_RESET:
            self._next_delay = RESTART_BACKOFF_INITIAL
        attempt = 0
        while True:
            attempt += 1
            delay, self._next_delay = self._next_delay, min(2 * self._next_delay, RESTART_BACKOFF_MAX)
            started = time.monotonic()
            try:
                if owned:
                    self._down = EngineDeadError(f"{cause}; a new backend is starting, attempt {attempt}")
                    logger.warning(
                        "The backend is down (%s): starting a new one in %g s (attempt %d)", cause, delay, attempt
                    )
                    await asyncio.sleep(delay)
                    # From this thread: see start_backend. With the variables the old one had (its devices).
                    process, address = start_backend(old.config, env=old.process.extra_env)
                    connection = await self._open(address, old.config, old.startup_timeout, process)
                else:
                    self._down = EngineDeadError(f"{cause}; reconnecting, attempt {attempt}")
                    logger.warning(
                        "The backend is down (%s): reconnecting, waiting up to %g s for an answer (attempt %d)",
                        cause,
                        delay,
                        attempt,
                    )
                    connection = await self._open(old.address, old.config, delay)
            except (EngineDeadError, RuntimeError, OSError) as error:
                logger.warning("Attempt %d to bring the backend back failed: %s", attempt, error)
                # A refusal or a crash can come at once: the next attempt still waits for its turn.
                await asyncio.sleep(max(0.0, started + delay - time.monotonic()))
                continue
            break
        self._adopt(connection)
        how = "restarted" if owned else f"reconnected to {connection.address}"
        logger.info(
            "The backend is back (%s after %d attempt(s); %d since start-up)", how, attempt, self.num_backend_restarts
        )

    async def _open(
        self, address: str, config: EngineConfig, timeout: float, process: BackendProcess | None = None
    ) -> BackendConnection:
        """A new connection, its blocking handshake run in a thread of its own; given up if this task is cancelled."""
        cancelled = threading.Event()
        future: concurrent.futures.Future[BackendConnection] = concurrent.futures.Future()
        # Running, so that cancelling the awaiting task cannot cancel the future and lose the connection it will hold.
        future.set_running_or_notify_cancel()

        def handshake() -> None:
            try:
                connection = BackendConnection(
                    address, config, True, timeout, process=process, cancelled=cancelled.is_set
                )
            except BaseException as error:
                if process is not None:  # a failed handshake stopped it; anything else may not have
                    process.kill()
                    process.wait()
                future.set_exception(error)
            else:
                future.set_result(connection)

        self._opening = cancelled, future
        # A daemon thread, not the loop's executor: a handshake may take minutes, and must not hold up the exit.
        threading.Thread(target=handshake, name="spindle-reconnect", daemon=True).start()
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._abandon_opening()
            raise
        finally:
            self._opening = None

    def _abandon_opening(self) -> None:
        """Give up the connection being opened, and close it should it open anyway."""
        if self._opening is not None:
            cancelled, future = self._opening
            cancelled.set()
            future.add_done_callback(_close_opened)

    def _adopt(self, connection: BackendConnection) -> None:
        """Serve from the new backend's connection, following its tokenizer and limits if they changed."""
        self.admission.adopt(connection.info)
        self.output_processor.tokenizer = self.admission.tokenizer  # the same object: the requests' follow it
        self.connection = connection
        self.num_backend_restarts += 1
        self._up_since = time.monotonic()
        self._down = self._down_cause = None


def _close_opened(future: concurrent.futures.Future[BackendConnection]) -> None:
    """Close the connection an abandoned attempt opened after all."""
    if future.exception() is None:
        future.result().close()


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
