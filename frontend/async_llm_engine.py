"""``AsyncLLMEngine``: asyncio streams over an engine core that runs in a backend process."""

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import zmq

from spindle.frontend.core_client import BackendConnection, EngineDeadError
from spindle.frontend.input_processor import InputProcessor, ProcessedPrompt
from spindle.frontend.output_processor import OutputProcessor, RequestState
from spindle.frontend.tokenizer import Tokenizer
from spindle.shared import FinishReason, PromptInputs, RequestOutput, SamplingParams
from spindle.shared.config import EngineConfig
from spindle.shared.errors import InvalidRequestError
from spindle.shared.protocol import EngineInfo, EngineRequest, EngineStats, Heartbeat, RequestError, StepOutputs


class AsyncLLMEngine:
    """Serve many concurrent streams from one backend process, as vLLM's ``AsyncLLMEngine`` does.

    Tokenization, chat templates, detokenization and stop strings happen here, in the frontend process, which never
    imports torch; the backend sees token ids only. One output task receives each step's deltas for all requests,
    detokenizes them and feeds each request's queue. A stream that is cancelled or closed aborts its request in the
    backend, which frees its KV blocks at once. If the backend dies, every stream raises :class:`EngineDeadError`
    within two seconds, and so does every later call.

    Example::

        engine = AsyncLLMEngine.from_args(kv_cache_memory="1GiB")

        async def main():
            params = SamplingParams(temperature=0, max_tokens=32)
            async for output in engine.generate("The capital of France is", params, request_id="r1"):
                print(output.outputs[0].text)

        asyncio.run(main())
        engine.shutdown()
    """

    def __init__(self, connection: BackendConnection) -> None:
        self.connection = connection
        self.info: EngineInfo = connection.info
        self.tokenizer = Tokenizer.from_files(self.info.tokenizer_files)
        self.input_processor = InputProcessor(self.tokenizer, self.info.max_model_len, self.info.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self.stats: EngineStats | None = None
        self._stats_updated: asyncio.Event | None = None
        self._output_task: asyncio.Task | None = None

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
    def max_model_len(self) -> int:
        """The longest prompt + completion the engine accepts."""
        return self.info.max_model_len

    @property
    def is_dead(self) -> bool:
        """Whether the backend has died."""
        return self.connection.dead is not None

    async def generate(
        self,
        inputs: PromptInputs,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        delta: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request until it finishes.

        Each :class:`~spindle.shared.RequestOutput` is cumulative (the text and tokens so far), or with ``delta=True``
        holds only what is new since the previous one. Breaking out, closing the generator or cancelling the task
        aborts the request in the backend.

        Raises:
            InvalidRequestError: bad inputs or parameters, or a request id already in use; nothing is queued.
            EngineUnavailableError: the backend is shutting down and refused the request.
            EngineDeadError: the backend died (before or during the request).

        """
        params = sampling_params or SamplingParams()
        async for output in self._stream(request_id, self.input_processor.process(inputs, params), params, delta):
            yield output

    async def chat(
        self,
        messages: list[dict[str, str]],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        add_generation_prompt: bool = True,
        delta: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Like :meth:`generate` for a conversation, rendered with the model's chat template."""
        params = sampling_params or SamplingParams()
        prompt = self.input_processor.process_chat(messages, params, add_generation_prompt)
        async for output in self._stream(request_id, prompt, params, delta):
            yield output

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with a final output whose unfinished completions end with ``ABORT``."""
        state = self.output_processor.requests.get(request_id)
        if state is None:
            return
        self._abort(request_id)
        for completion in state.completions:
            completion.finish_reason = completion.finish_reason or FinishReason.ABORT
        queue = self.queues.get(request_id)
        if queue is not None:
            queue.put_nowait(state.output())

    async def get_stats(self) -> EngineStats:
        """The backend's scheduler and KV cache state, as of its next heartbeat or step (at most 0.25 s away)."""
        self._start_output_task()
        self._stats_updated.clear()
        await self._stats_updated.wait()
        self.connection.check_alive()
        return self.stats

    def shutdown(self) -> None:
        """Stop the output task and the backend this engine started (if any)."""
        if self._output_task is not None:
            self._output_task.cancel()
        self.connection.close()

    async def _stream(
        self, request_id: str | None, prompt: ProcessedPrompt, params: SamplingParams, delta: bool
    ) -> AsyncIterator[RequestOutput]:
        self._start_output_task()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.queues:
            raise InvalidRequestError("request_id", f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.queues[request_id] = queue
        state = RequestState(
            request_id, prompt.prompt, prompt.prompt_token_ids, params, self.tokenizer, time.time(), delta
        )
        self.output_processor.add_request(state)
        finished = False
        try:
            self.connection.add_request(
                EngineRequest(request_id, prompt.prompt_token_ids, params, state.metrics.arrival_time)
            )
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            del self.queues[request_id]
            if not finished:
                self._abort(request_id)

    def _start_output_task(self) -> None:
        self.connection.check_alive()
        # One output task per event loop: a task of an earlier asyncio.run() is done and cannot be awaited here.
        task = self._output_task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._stats_updated = asyncio.Event()
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    def _abort(self, request_id: str) -> None:
        self.output_processor.abort_requests([request_id])
        with contextlib.suppress(EngineDeadError):
            self.connection.abort_requests([request_id])

    async def _output_loop(self) -> None:
        """Receive every message from the backend; turn step outputs into request outputs for the streams."""
        connection = self.connection
        try:
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
                        self.connection.finish_sequence(request_id, index)
                    for output in outputs:
                        queue = self.queues.get(output.request_id)
                        if queue is not None:
                            queue.put_nowait(output)
                elif isinstance(message, RequestError):
                    self.output_processor.abort_requests([message.request_id])
                    queue = self.queues.get(message.request_id)
                    if queue is not None:
                        queue.put_nowait(message.to_exception())
                self.connection.check_alive()
        except EngineDeadError as dead:
            self._stats_updated.set()  # get_stats() callers see the error through check_alive
            for queue in self.queues.values():
                queue.put_nowait(dead)
            self.output_processor.abort_requests(list(self.output_processor.requests))
