"""``Admission``: the one path a checked prompt takes into an engine, the same for ``LLMEngine`` and ``AsyncLLMEngine``.

A request gets its id, its LoRA adapter and, for a chat with tools, the constraint of its tool choice here, and leaves
as the :class:`~spindle.shared.protocol.EngineRequest` the engine core queues and the
:class:`~spindle.frontend.processing.output_processor.RequestState` the output processor follows. The engines only say
where each goes: an ``LLMEngine`` queues the request and then tracks it, so that a refusal of its in-process core leaves
no trace; an ``AsyncLLMEngine`` opens the request's stream first, so that no output can come before it.
"""

import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Container, Coroutine, Sequence
from typing import Any

import msgspec

from spindle.frontend.processing.image_processor import ImageProcessor
from spindle.frontend.processing.input_processor import InputProcessor, ProcessedPrompt, refer_to_input
from spindle.frontend.processing.output_processor import EMBEDDING_SAMPLING_PARAMS, RequestState
from spindle.frontend.processing.reasoning import ReasoningParser
from spindle.frontend.processing.tokenizer import Tokenizer
from spindle.shared import PoolingParams, PromptInputs, RequestOutputKind, SamplingParams
from spindle.shared.errors import AlreadyExistsError, InvalidRequestError
from spindle.shared.lora import LoRARequest, check_same_adapter
from spindle.shared.protocol import Command, EngineInfo, EngineRequest, ListLoras, LoadLora

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_LENGTH = 256
"""The longest request id a caller may give, in characters (a fresh id is 32 hex digits)."""

PRIORITY_RANGE = (-100, 100)
"""The priorities a request may have (lower runs first under the priority policy).

Aging bounds starvation by ``(p - p_min) * priority_aging`` seconds (:doc:`architecture`, "Priority scheduling"), so
the range bounds it for everyone: with the default aging of 10 s, no request waits for ones that arrive more than
2,000 s (33 min) after it, however the others set their priority. 201 levels is room for any tiering.
"""


class Admission:
    """Turns checked prompts into engine requests: ids, LoRA adapters, tool constraints, request and state.

    Args:
        info: the engine's description from its handshake: the tokenizer files and the limits prompts must fit.
        call: runs a control-plane command in the engine and returns its result (awaited: see
            :func:`run_unsuspended` for an engine whose calls answer at once).
        reasoning: the reasoning parser that splits every completion's text (``reasoning_parser``), or None.

    Attributes:
        info: the description of the engine requests go to.
        tokenizer: the model's tokenizer.
        input_processor: checks and tokenizes prompts and conversations, within the engine's limits.

    """

    def __init__(
        self, info: EngineInfo, call: Callable[[Command], Awaitable[Any]], reasoning: ReasoningParser | None = None
    ) -> None:
        self.info = info
        self.call = call
        self.reasoning = reasoning
        self.tokenizer = Tokenizer.from_files(info.tokenizer_files)
        self.input_processor = self._input_processor()
        # Adapter name -> the resolved path a LoRARequest loaded it from, so later requests skip the look-up.
        self._lora_paths: dict[str, str] = {}

    def adopt(self, info: EngineInfo) -> None:
        """Follow a new backend: its tokenizer and limits, where they changed.

        It has none of the adapters that requests loaded into the old one: the next request naming one loads it again.
        """
        if info.model_name != self.info.model_name:
            logger.warning("The new backend serves %s, no longer %s", info.model_name, self.info.model_name)
        old, self.info = self.info, info
        if info.tokenizer_files != old.tokenizer_files:
            self.tokenizer = Tokenizer.from_files(info.tokenizer_files)
        if (info.tokenizer_files, info.max_model_len, info.vocab_size) != (
            old.tokenizer_files,
            old.max_model_len,
            old.vocab_size,
        ):
            self.input_processor = self._input_processor()
        self._lora_paths.clear()

    async def admit(
        self,
        request_id: str | None,
        prompt: ProcessedPrompt,
        params: SamplingParams | PoolingParams,
        in_use: Container[str],
        *,
        arrival_time: float | None = None,
        delta: bool = False,
        final_only: bool = False,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineRequest, RequestState]:
        """The engine request and the request state of one checked prompt, its adapter loaded if it must be.

        Args:
            request_id: the caller's id, or ``None`` for a fresh one.
            prompt: the prompt, checked and tokenized by :attr:`input_processor`.
            params: sampling parameters, or :class:`~spindle.shared.PoolingParams` for an embedding request.
            in_use: the ids of the requests in flight, which this one may not take.
            arrival_time: when the request came (``time.time()``; now when ``None``).
            delta: the request's outputs hold only what is new since the previous one (also when the parameters'
                ``output_kind`` is ``DELTA``).
            final_only: the request has one output, when it finishes (:class:`RequestState`; also when the
                parameters' ``output_kind`` is ``FINAL_ONLY``).
            priority: its place under the priority scheduling policy (lower first).
            lora_request: the adapter to generate with (:meth:`lora_name`).

        Raises:
            InvalidRequestError: the id is in use, or the adapter does not load or is loaded under its name from
                another path.

        """
        request_id = self.request_id(request_id, in_use)
        lora_name = await self.lora_name(lora_request)
        if isinstance(params, SamplingParams):
            delta = delta or params.output_kind == RequestOutputKind.DELTA
            final_only = final_only or params.output_kind == RequestOutputKind.FINAL_ONLY
        return self.request(
            request_id,
            prompt,
            params,
            lora_name,
            arrival_time=arrival_time,
            delta=delta,
            final_only=final_only,
            priority=priority,
        )

    def request_id(self, request_id: str | None, in_use: Container[str]) -> str:
        """``request_id``, or a fresh one for ``None``.

        Raises:
            InvalidRequestError: a request in flight has it, or it is not an id (see :func:`check_request_id`).

        """
        request_id = request_id or uuid.uuid4().hex
        check_request_id(request_id)
        if request_id in in_use:
            raise InvalidRequestError("request_id", f"request id {request_id!r} is already in use")
        return request_id

    def batch_ids(self, request_id: str | None, size: int, in_use: Container[str]) -> list[str]:
        """One id per prompt of an embedding batch, ``{request_id}-{i}`` (from a fresh id for ``None``), all free."""
        request_id = request_id or uuid.uuid4().hex
        check_request_id(request_id)
        request_ids = [f"{request_id}-{index}" for index in range(size)]
        busy = [rid for rid in request_ids if rid in in_use]
        if busy:
            raise InvalidRequestError("request_id", f"request ids {busy} are already in use")
        return request_ids

    def embedding_prompts(self, inputs: PromptInputs | Sequence[PromptInputs]) -> list[ProcessedPrompt]:
        """Check every prompt of an embedding batch (or one) before any is queued.

        Raises:
            InvalidRequestError: a bad prompt, named as the ``Embed`` RPC names it (``inputs[2].token_ids[0]``).

        """
        batch = [inputs] if isinstance(inputs, str | dict) else list(inputs)
        prompts = []
        for index, item in enumerate(batch):
            try:
                prompts.append(self.input_processor.process(item, None))
            except InvalidRequestError as error:
                raise refer_to_input(error, index) from None
        return prompts

    async def lora_name(self, lora_request: LoRARequest | None) -> str | None:
        """The adapter a request names, loading its ``lora_path`` under its name unless it is loaded already.

        A path is loaded once per name: later requests with the same name and path skip the look-up. When the name
        is taken (loaded before, at start-up or by a concurrent request), the adapter loaded under it must come from
        the same path.

        Raises:
            InvalidRequestError: the adapter does not load, or the one under its name comes from another path.

        """
        if lora_request is None or lora_request.lora_path is None:
            return None if lora_request is None else lora_request.lora_name
        name, path = lora_request.lora_name, os.path.realpath(lora_request.lora_path)
        if self._lora_paths.get(name) != path:
            try:
                await self.call(LoadLora(name, lora_request.lora_path))
            except AlreadyExistsError:
                loaded = [adapter for adapter in await self.call(ListLoras()) if adapter.name == name]
                if not loaded:  # unloaded again since: the request goes on and hears NOT_FOUND
                    return name
                check_same_adapter(lora_request, loaded[0])
            self._lora_paths[name] = path
        return name

    def forget_lora(self, name: str) -> None:
        """The adapter ``name`` was unloaded: a request that names it with a path loads it again."""
        self._lora_paths.pop(name, None)

    def request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams | PoolingParams,
        lora_name: str | None = None,
        *,
        arrival_time: float | None = None,
        delta: bool = False,
        final_only: bool = False,
        priority: int = 0,
    ) -> tuple[EngineRequest, RequestState]:
        """The engine request and the request state of a prompt whose id and adapter are settled.

        A chat prompt with tools constrains ``params`` to its tool calls; with
        :class:`~spindle.shared.PoolingParams` it is an embedding request, which generates nothing.

        Raises:
            InvalidRequestError: ``priority`` is outside :data:`PRIORITY_RANGE`.

        """
        low, high = PRIORITY_RANGE
        if not low <= priority <= high:
            raise InvalidRequestError("priority", f"priority={priority} is outside [{low}, {high}] (lower runs first)")
        arrival_time = arrival_time or time.time()
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is None and prompt.tools is not None:
            params = prompt.tools.constrain(params)
        request = EngineRequest(
            request_id,
            prompt.prompt_token_ids,
            EMBEDDING_SAMPLING_PARAMS if pooling is not None else engine_params(params),
            arrival_time,
            priority,
            lora_name,
            pooling,
            images=prompt.images,
            prompt_embeds=prompt.prompt_embeds,
            grammar_after=self._reasoning_end(prompt.prompt_token_ids, params),
        )
        state = RequestState(
            request_id,
            prompt.prompt,
            prompt.prompt_token_ids,
            params,
            self.tokenizer,
            arrival_time,
            delta,
            tools=prompt.tools,
            final_only=final_only,
            reasoning=self.reasoning,
        )
        return request, state

    def _reasoning_end(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> list[int] | None:
        """The tokens after which a constrained request's grammar applies: the end of the thinking block, if any.

        ``None`` without a reasoning parser or a constraint, and when the prompt's last thinking block is closed
        already (Qwen3 with ``enable_thinking=False``: its template writes an empty one), as vLLM decides it.
        """
        if self.reasoning is None or isinstance(params, PoolingParams) or params.structured_output is None:
            return None
        start = self.tokenizer.encode(self.reasoning.start, add_special_tokens=False)
        end = self.tokenizer.encode(self.reasoning.end, add_special_tokens=False)
        return None if _last_index(prompt_token_ids, end) > _last_index(prompt_token_ids, start) else end

    def _input_processor(self) -> InputProcessor:
        files = self.info.tokenizer_files
        return InputProcessor(
            self.tokenizer, self.info.max_model_len, self.info.vocab_size, ImageProcessor.from_files(files)
        )


def _last_index(tokens: list[int], part: list[int]) -> int:
    """Where ``part`` last starts in ``tokens`` (-1 when it does not occur)."""
    return next((i for i in range(len(tokens) - len(part), -1, -1) if tokens[i : i + len(part)] == part), -1)


def engine_params(params: SamplingParams) -> SamplingParams:
    """The parameters the engine core runs a request with.

    Where the request keeps the best ``n`` of ``best_of`` completions (:class:`RequestState`), the engine runs
    ``best_of``, each with its tokens' log-probabilities, which rank them.
    """
    if not params.keeps_best_of:
        return params
    return msgspec.structs.replace(params, n=params.best_of, logprobs=params.logprobs or 0)


def check_request_id(request_id: str) -> None:
    """Refuse a caller's request id that is not at most :data:`MAX_REQUEST_ID_LENGTH` printable characters.

    An id goes into every log line about its request: one with a newline or another control character could forge
    lines of the log.

    Raises:
        InvalidRequestError: for the field ``request_id``.

    """
    if len(request_id) > MAX_REQUEST_ID_LENGTH or not request_id.isprintable():
        raise InvalidRequestError(
            "request_id",
            f"request id {request_id[:MAX_REQUEST_ID_LENGTH]!r} is not an id: give at most {MAX_REQUEST_ID_LENGTH} "
            f"printable characters (no newlines or other control characters), or none for a fresh one",
        )


def run_unsuspended(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run to its end, without an event loop, a coroutine whose awaits all finish at once; its result.

    :class:`Admission`'s steps that call the engine (loading an adapter) are coroutines, written once for both
    engines: ``AsyncLLMEngine`` awaits them, and ``LLMEngine``, whose calls answer before they return, runs them
    with this.

    Raises:
        RuntimeError: the coroutine waited for something (it needs an event loop).

    """
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine waited for something: it needs an event loop")
