"""``LLMEngine``: the engine core driven in-process, with tokenization and detokenization around it."""

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from spindle.frontend.engine.admission import Admission, run_unsuspended
from spindle.frontend.engine.client import SyncEngineClient, make_sync_client
from spindle.frontend.processing.input_processor import InputProcessor, ProcessedPrompt
from spindle.frontend.processing.output_processor import OutputProcessor
from spindle.frontend.processing.reasoning import reasoning_parser
from spindle.frontend.processing.tokenizer import Tokenizer
from spindle.shared import EmbeddingRequestOutput, PoolingParams, PromptInputs, RequestOutput, SamplingParams
from spindle.shared.config import EngineConfig
from spindle.shared.errors import OutputProcessingError
from spindle.shared.lora import LoraAdapterInfo, LoRARequest, check_lora_name
from spindle.shared.protocol import Command, KVCacheReport, ListLoras, LoadLora, UnloadLora

if TYPE_CHECKING:
    from spindle.backend.engine_core import EngineCore


class LLMEngine:
    """A synchronous engine, as in vLLM: add requests, call :meth:`step` until they finish.

    One :meth:`step` schedules the waiting and running sequences under the token budget, runs one forward pass
    over the flat batch, samples a token for every sequence whose prompt is fully computed, appends it and
    ends sequences at eos, a stop token, a stop string or their length limit, freeing their KV blocks; it
    returns a :class:`~spindle.shared.RequestOutput` for every request that advanced.

    Example::

        engine = LLMEngine.from_args(kv_cache_memory="1GiB")
        engine.add_request("a", "The capital of France is", SamplingParams(temperature=0, max_tokens=8))
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    print(output.outputs[0].text)
    """

    def __init__(self, config: EngineConfig, multiprocess: bool = False, backend_address: str | None = None) -> None:
        self.config = config
        self.client: SyncEngineClient = make_sync_client(config, multiprocess, backend_address)
        self.admission = Admission(
            self.client.info, self._call, reasoning_parser(config.structured_output.reasoning_parser)
        )
        self.output_processor = OutputProcessor(self.admission.tokenizer)
        # Requests whose output could not be processed, aborted already: step() raises their errors one a call.
        self._failed: list[OutputProcessingError] = []

    @classmethod
    def from_args(cls, multiprocess: bool = False, backend_address: str | None = None, **kwargs: object) -> "LLMEngine":
        """Build an engine from :class:`~spindle.shared.config.EngineConfig` fields given as keywords.

        With ``multiprocess=True`` the engine core runs in a backend child process; with ``backend_address`` it is
        the backend already listening there.
        """
        return cls(EngineConfig.of(**kwargs), multiprocess, backend_address)

    @property
    def max_model_len(self) -> int:
        """The longest prompt + completion the engine accepts."""
        return self.client.info.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        """How many KV cache blocks cache initialisation allocated."""
        return self.client.info.num_kv_blocks

    @property
    def kv_cache_report(self) -> KVCacheReport | None:
        """How cache initialisation sized the KV cache (vLLM's ``_init_cache``): its inputs, blocks and arithmetic.

        The backend sizes and allocates the cache once, while the engine is built, before it takes a request:
        ``kv_cache_memory`` bytes on the CPU, and on CUDA ``gpu_memory_utilization`` of the device less the weights,
        the activations of one profiled maximal step, what the device lost outside torch and the decode CUDA graphs'
        pool, divided into blocks of ``block_size`` tokens over every layer. ``print(report.explain())`` writes the
        maths out (:doc:`cache`). None only from a backend that does not report it.
        """
        return self.client.info.kv_cache

    @property
    def engine_core(self) -> "EngineCore":
        """The engine core, when it runs in this process (for tests and benchmarks that look inside it).

        Raises:
            RuntimeError: it runs in a backend process (``multiprocess`` or ``backend_address``).

        """
        return self.client.engine_core

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.admission.tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        """What checks and tokenizes prompts and conversations for this engine."""
        return self.admission.input_processor

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.tokenizer

    def add_request(
        self,
        request_id: str | None,
        inputs: PromptInputs,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        *,
        delta: bool = False,
        final_only: bool = False,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and tokenize ``inputs`` and queue the request; returns its id (generated when ``None``).

        With :class:`~spindle.shared.PoolingParams` it is an embedding request, as in vLLM: its one output, when it
        finishes, is an :class:`~spindle.shared.EmbeddingRequestOutput` (:doc:`embeddings`).

        With ``delta=True`` each output carries only the text and tokens that are new since the previous one. With
        ``final_only=True`` (vLLM's ``RequestOutputKind.FINAL_ONLY``, what :class:`~spindle.frontend.engine.llm.LLM`
        asks for) the request has one output, when it finishes, and its text is decoded then unless stop strings
        need it sooner: no output is built for the steps in between. ``priority`` orders the request under
        ``scheduling_policy="priority"`` (lower runs first, as in vLLM); the ``fcfs`` policy ignores it.
        ``lora_request`` names the LoRA adapter to generate with (:doc:`lora`); one with a ``lora_path`` is loaded
        under its name first unless it is loaded already.
        Raises :class:`~spindle.shared.errors.InvalidRequestError` (a :class:`ValueError`) for bad inputs, a request
        id already in use, an adapter that does not load, or one loaded under this name from another path; nothing
        is queued then. An unknown adapter name is a :class:`~spindle.shared.errors.NotFoundError` (from a backend
        process, out of a later :meth:`step`, as its other refusals).
        """
        if isinstance(params, PoolingParams):
            prompt = self.input_processor.process(inputs, None)
        else:
            params = params or SamplingParams()
            prompt = self.input_processor.process(inputs, params)
        return self._enqueue(request_id, prompt, params, arrival_time, delta, final_only, priority, lora_request)

    def add_chat_request(
        self,
        request_id: str | None,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        add_generation_prompt: bool = True,
        delta: bool = False,
        final_only: bool = False,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = "auto",
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Like :meth:`add_request` for a conversation: the model's chat template renders it into the prompt.

        ``tools`` (OpenAI's function tools) reach the template, and ``tool_choice`` (``"auto"``, ``"none"``,
        ``"required"`` or a tool's name) says whether the reply may, must or must not call them; each finished
        completion of a request with tools carries the parsed calls in
        :attr:`~spindle.shared.CompletionOutput.tool_calls` (see :doc:`tool_calling`).
        """
        params = params or SamplingParams()
        prompt = self.input_processor.process_chat(messages, params, add_generation_prompt, tools, tool_choice)
        return self._enqueue(request_id, prompt, params, arrival_time, delta, final_only, priority, lora_request)

    def load_lora(self, name: str, path: str) -> LoraAdapterInfo:
        """Load the PEFT adapter directory ``path`` under ``name``, for the requests that name it.

        See :doc:`lora`.

        Raises:
            InvalidRequestError: an empty name, or no adapter the engine can serve at ``path``.
            AlreadyExistsError: an adapter is loaded under ``name`` already.

        """
        check_lora_name(name)
        return self.client.call(LoadLora(name, path))

    def unload_lora(self, name: str) -> None:
        """Unload the adapter ``name``; requests already running with it finish with it.

        Raises:
            NotFoundError: no adapter is loaded under ``name``.

        """
        self.client.call(UnloadLora(name))
        self.admission.forget_lora(name)

    def list_loras(self) -> list[LoraAdapterInfo]:
        """The adapters loaded: at start-up (``lora_modules``), with :meth:`load_lora` or by a request's path."""
        return self.client.call(ListLoras())

    def _enqueue(
        self,
        request_id: str | None,
        prompt: ProcessedPrompt,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None,
        delta: bool,
        final_only: bool,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> str:
        request, state = run_unsuspended(
            self.admission.admit(
                request_id,
                prompt,
                params,
                self.output_processor.requests,
                arrival_time=arrival_time,
                delta=delta,
                final_only=final_only,
                priority=priority,
                lora_request=lora_request,
            )
        )
        self.client.add_request(request)  # first: a request an in-process core refuses leaves no trace
        self.output_processor.add_request(state)
        return request.request_id

    async def _call(self, command: Command) -> Any:
        """Run a control-plane command in the engine core (it answers before returning: see run_unsuspended)."""
        return self.client.call(command)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort one or several requests at any point; their KV blocks are freed at once. Unknown ids are ignored."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.client.abort_requests(request_ids)
        self.output_processor.abort_requests(request_ids)

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Run one scheduling + forward + sampling step; return the outputs of the requests that advanced.

        An embedding request has one output, an :class:`~spindle.shared.EmbeddingRequestOutput`, in the step that
        completes its prompt.

        Raises:
            InvalidRequestError: the engine dropped a request it had accepted, because its structured-output spec
                did not compile (compiling happens off the step loop); a note names the request, which is gone.
                Nothing else is lost: the error comes before this call's step runs.
            EngineUnavailableError: a backend process refused a request because it is shutting down.
            OutputProcessingError: an earlier step's output of a request could not be processed (a bug); that
                request was aborted then, and nothing else is lost.

        """
        refused = self.client.pop_refused()
        if refused:
            self.output_processor.abort_requests([request_id for request_id, _ in refused])
            # One error at a time; the others (rare: several bad specs in one step) are already aborted.
            request_id, error = refused[0]
            error.add_note(f"(the refused request is {request_id!r})")
            raise error
        if self._failed:
            raise self._failed.pop(0)
        outputs, stopped, failed = self.output_processor.process(self.client.step())
        for request_id, index in stopped:
            self.client.finish_sequence(request_id, index)
        if failed:
            self.client.abort_requests([error.request_id for error in failed])
            self._failed += failed  # raised by the next calls, as refusals are: this step's outputs are not lost
        return outputs

    def shutdown(self) -> None:
        """Stop the backend process this engine started, or an in-process core's tensor-parallel workers."""
        self.client.close()

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still in flight (or failed with an error the next :meth:`step` raises)."""
        return bool(self.output_processor.requests or self._failed)

    def get_num_unfinished_requests(self) -> int:
        """How many requests are still in flight."""
        return len(self.output_processor.requests)
