"""``LLM``: offline batch generation, as in vLLM."""

import warnings
from collections.abc import Callable, Sequence, Sized
from functools import partial
from typing import Any

from tqdm import tqdm

from spindle.frontend.engine.beam_search import BeamSearch, beam_prompts, step_params, top_logprobs
from spindle.frontend.engine.llm_engine import LLMEngine
from spindle.frontend.processing.generation_config import default_sampling_params
from spindle.frontend.processing.tokenizer import Tokenizer
from spindle.shared import EmbeddingRequestOutput, PoolingParams, PromptInputs, RequestOutput, SamplingParams
from spindle.shared.beam_search import BeamSearchOutput, BeamSearchParams
from spindle.shared.config import EngineConfig
from spindle.shared.lora import LoRARequest

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate completions for a batch of prompts with continuous batching, in this process.

    Args:
        model: a Hugging Face model directory, a ``.gguf`` file, or ``None`` for the embedded SmolLM2-135M-Instruct.
        multiprocess: run the engine core in a backend child process (as ``spindle serve`` does) instead of here.
        generation_config: where :meth:`get_default_sampling_params` takes its defaults from, as vLLM's argument:
            ``auto`` (the model's ``generation_config.json``), ``vllm`` (none) or a directory holding one.
        override_generation_config: ``generation_config.json`` fields that replace the generation config's, e.g.
            ``{"temperature": 0.5}``.
        **engine_args: any other :class:`~spindle.shared.config.EngineConfig` field (``dtype``, ``max_model_len``,
            ``kv_cache_memory``, ``gpu_memory_utilization``, ``block_size``, ``max_num_seqs``,
            ``max_num_batched_tokens``, ``enable_prefix_caching``, ``device``). One defaults differently here, as an
            offline batch wants throughput, not the latency of its first streams: ``max_decode_slowdown`` is 0 (no
            bound).

    Example::

        llm = LLM(kv_cache_memory="1GiB")
        outputs = llm.generate(["Hello, my name is", {"prompt_token_ids": [1, 504, 3458]}],
                               SamplingParams(temperature=0, max_tokens=16))

    Raises:
        ValueError: a setting is refused, or the generation config's defaults are not valid sampling parameters.

    """

    def __init__(
        self,
        model: str | None = None,
        multiprocess: bool = False,
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        **engine_args: object,
    ) -> None:
        engine_args.setdefault("max_decode_slowdown", 0)
        self.llm_engine = LLMEngine(EngineConfig.of(model=model, **engine_args), multiprocess)
        self._next_id = 0
        try:
            files = self.llm_engine.client.info.tokenizer_files
            self._default_sampling = default_sampling_params(generation_config, files, override_generation_config)
        except ValueError:
            self.llm_engine.shutdown()
            raise

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a call that gives none, as vLLM's: the generation config's fields, overridden.

        ``SamplingParams()`` changed by the model's ``generation_config.json`` (``temperature``, ``top_p``,
        ``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as ``max_tokens``), unless
        ``generation_config="vllm"``.
        """
        return SamplingParams(**self._default_sampling)

    def shutdown(self) -> None:
        """Stop the backend process, when ``multiprocess=True`` started one."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        inputs: PromptInputs | Sequence[PromptInputs] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        prompt: str | list[str] | None = None,
        prompts: PromptInputs | Sequence[PromptInputs] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for one prompt or a list of prompts; outputs come back in input order.

        Args:
            inputs: a string, ``{"prompt": ...}``, ``{"prompt_token_ids": [...]}`` (each optionally with
                ``multi_modal_data``), or a list of these. A vision-language model's prompt takes images as
                ``"multi_modal_data": {"image": image}`` (or a list of images), each a PIL image or encoded image
                bytes (PNG, JPEG, ...), one ``<image>`` placeholder in the prompt for each, in order
                (:meth:`~spindle.frontend.processing.input_processor.InputProcessor.process`).
            sampling_params: one :class:`SamplingParams` for all prompts or one per prompt (default
                :meth:`get_default_sampling_params`).
            use_tqdm: show a progress bar. It is the third positional argument, where vLLM's old signature had
                ``prompt_token_ids``: token ids there raise a :class:`TypeError`.
            priority: one scheduling priority per prompt, under ``scheduling_policy="priority"`` (lower runs first,
                as in vLLM); the ``fcfs`` policy ignores it. Default: 0 for every prompt.
            lora_request: the LoRA adapter to generate with, one for all prompts or one (or ``None``) per prompt, as
                in vLLM. One with a ``lora_path`` is loaded under its ``lora_name`` on first use (:doc:`lora`).
            prompt: deprecated; pass ``inputs`` (a string or a list of strings) instead.
            prompts: deprecated (vLLM's old keyword); pass the same value as ``inputs``, the first argument.
            prompt_token_ids: deprecated; pass ``{"prompt_token_ids": ids}`` (or a list of them) instead.
            multi_modal_data: deprecated; put ``multi_modal_data`` inside each prompt dict instead. As in vLLM's old
                API, with several prompts each value is a batch with one entry per prompt, and prompt ``i`` gets
                ``value[i:i + 1]`` (entry ``i``, keeping a batch dimension of one).

        Raises:
            TypeError: no prompt, a prompt both as ``inputs`` and as a deprecated keyword, or a non-bool third
                positional argument.
            ValueError: a list of ``sampling_params``, ``priority`` or ``lora_request`` not one per prompt, a
                deprecated ``multi_modal_data`` value without one entry per prompt, or a prompt refused
                (:class:`~spindle.shared.errors.InvalidRequestError`: also an adapter that does not load, one loaded
                under its name from another path, or an unknown name, a
                :class:`~spindle.shared.errors.NotFoundError`). Nothing is queued then.

        """
        if not isinstance(use_tqdm, bool):
            raise TypeError(
                "LLM.generate()'s third positional argument is use_tqdm (a bool), not prompt_token_ids as in vLLM's "
                f"old signature (got a {type(use_tqdm).__name__}): pass token ids as the prompt, "
                "LLM.generate({'prompt_token_ids': ids}) (or a list of such dicts)"
            )
        if any(value is not None for value in (prompt, prompts, prompt_token_ids, multi_modal_data)):
            if inputs is not None:
                raise TypeError(
                    "pass either inputs or the deprecated prompt/prompts/prompt_token_ids/multi_modal_data keywords, "
                    "not both"
                )
            inputs = _inputs_from_legacy(prompt, prompts, prompt_token_ids, multi_modal_data)
        if inputs is None:
            raise TypeError("LLM.generate() needs inputs: a prompt or a list of prompts")
        prompt_list = [inputs] if isinstance(inputs, str | dict) else list(inputs)
        params_list = _params_per_prompt(sampling_params, len(prompt_list), self.get_default_sampling_params)
        adders = _adders(self.llm_engine.add_request, "inputs", prompt_list, priority, lora_request)
        return self._run(adders, params_list, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = "auto",
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate replies.

        Args:
            messages: a conversation (``{"role": ..., "content": ...}`` dicts; an assistant turn may carry
                ``tool_calls``, a tool turn a ``tool_call_id``), or a list of conversations. A content may be a list
                of parts: ``{"type": "text", "text": ...}`` and, for a vision-language model, images as
                ``{"type": "image", "image": image}`` (a PIL image or encoded image bytes) or OpenAI's
                ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
                (:meth:`~spindle.frontend.processing.input_processor.InputProcessor.process_chat`).
            sampling_params: one :class:`SamplingParams` for all conversations or one per conversation (default
                :meth:`get_default_sampling_params`).
            use_tqdm: show a progress bar.
            add_generation_prompt: end each prompt with the header that starts an assistant turn.
            tools: functions the model may call, in OpenAI's form (``{"type": "function", "function": {"name",
                "description", "parameters"}}``); the chat template receives them.
            tool_choice: ``"auto"`` (calls in the reply are parsed), ``"none"`` (no tools), ``"required"`` (the reply
                is constrained to one or more calls) or a tool's name (the reply is constrained to its arguments).
                Each finished completion then carries its calls in
                :attr:`~spindle.shared.CompletionOutput.tool_calls` (:doc:`tool_calling`).
            priority: one scheduling priority per conversation, as in :meth:`generate`.
            lora_request: the LoRA adapter to generate with, one for all or one per conversation, as in
                :meth:`generate`.

        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params_list = _params_per_prompt(sampling_params, len(conversations), self.get_default_sampling_params)
        add = partial(
            self.llm_engine.add_chat_request,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            tool_choice=tool_choice,
        )
        return self._run(_adders(add, "messages", conversations, priority, lora_request), params_list, use_tqdm)

    def embed(
        self,
        inputs: PromptInputs | Sequence[PromptInputs],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed one prompt or a list of prompts, as vLLM's ``LLM.embed``; outputs come back in input order.

        Each prompt is prefilled like a generation request's (in the same steps, in chunks when it is long) and its
        final hidden states are pooled as its ``pooling_params`` say; nothing is generated, and its KV blocks are
        freed as soon as it ends (:doc:`embeddings`). The embedding is ``outputs[i].outputs.embedding``.

        Args:
            inputs: a prompt or a list of prompts, as for :meth:`generate`.
            pooling_params: one :class:`~spindle.shared.PoolingParams` for all prompts or one per prompt (default
                ``PoolingParams()``: the last token's hidden state, normalized).
            use_tqdm: show a progress bar.
            priority: one scheduling priority per prompt, as in :meth:`generate`.

        Raises:
            ValueError: a list of ``pooling_params`` or ``priority`` not one per prompt, or a prompt refused
                (:class:`~spindle.shared.errors.InvalidRequestError`: also ``dimensions`` above the model's hidden
                size). Nothing is queued then.

        """
        prompt_list = [inputs] if isinstance(inputs, str | dict) else list(inputs)
        params_list = _params_per_prompt(pooling_params, len(prompt_list), PoolingParams)
        adders = _adders(self.llm_engine.add_request, "inputs", prompt_list, priority, None)
        return self._run(adders, params_list, use_tqdm)

    def beam_search(
        self,
        prompts: PromptInputs | Sequence[PromptInputs],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam-search each prompt's ``beam_width`` best completions, as vLLM's ``LLM.beam_search``.

        The beams, their scores and when the search stops are transformers' ``generate(num_beams=...)``'s without
        sampling (:class:`~spindle.shared.beam_search.BeamSearchParams`). Each step runs one token of every running
        beam of every prompt as one batch; a prompt's beams share its KV blocks through the prefix cache, so keep
        ``enable_prefix_caching`` on (the default) or every step recomputes every beam.

        Args:
            prompts: a prompt or a list of prompts: text, ``{"prompt": ...}`` or ``{"prompt_token_ids": ...}`` (no
                images).
            params: the search's parameters.
            use_tqdm: show a progress bar over the steps.
            lora_request: the LoRA adapter to search with.

        Returns:
            One :class:`~spindle.shared.beam_search.BeamSearchOutput` per prompt, in order: its beams, best first.

        Raises:
            ValueError: a prompt is refused (:class:`~spindle.shared.errors.InvalidRequestError`), or holds images, or
                ``beam_width`` needs more log-probabilities a step than the engine gives.

        """
        engine = self.llm_engine
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        token_ids = beam_prompts(engine.input_processor, prompt_list, params)
        search = BeamSearch(token_ids, params, engine.client.info.eos_token_ids, engine.max_model_len)
        step = step_params(search)
        with tqdm(total=params.max_tokens, desc="Beam search steps", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while beams := search.running():
                prompts = [{"prompt_token_ids": beam} for beam in beams]
                adders = _adders(engine.add_request, "inputs", prompts, None, lora_request)
                outputs = self._run(adders, [step] * len(beams), use_tqdm=False)
                search.advance([top_logprobs(output, search.num_candidates) for output in outputs])
                bar.update(1)
        return search.outputs(lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True))

    def _run(
        self, adders: list[Callable[..., str]], params_list: list[SamplingParams] | list[PoolingParams], use_tqdm: bool
    ) -> list[Any]:
        """Queue every request (all or none), then step until all finish; outputs in input order."""
        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for i, (add, params) in enumerate(zip(adders, params_list, strict=True)):
                request_id = str(self._next_id)
                self._next_id += 1
                add(request_id=request_id, params=params)
                order[request_id] = i
        except Exception:
            engine.abort_request(list(order))
            raise
        results: list[RequestOutput | EmbeddingRequestOutput | None] = [None] * len(adders)
        bar = tqdm(total=len(adders), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        num_prompt_tokens = num_output_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    results[order[output.request_id]] = output
                    num_prompt_tokens += len(output.prompt_token_ids)
                    if isinstance(output, RequestOutput):  # an embedding generates nothing
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    rates = num_prompt_tokens / elapsed, num_output_tokens / elapsed
                    bar.set_postfix_str("input: {:.0f} toks/s, output: {:.0f} toks/s".format(*rates))
                    bar.update(1)
        except BaseException:
            engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        return results


def _params_per_prompt(
    params: Any, num_prompts: int, default: Callable[[], SamplingParams] | Callable[[], PoolingParams]
) -> list[Any]:
    """One set of parameters per prompt: the same for all (``default()`` when None) unless a list gives each."""
    if not isinstance(params, Sequence):
        return [params or default()] * num_prompts
    if len(params) != num_prompts:
        kind = type(default()).__name__
        raise ValueError(f"got {len(params)} {kind} for {num_prompts} prompts: give one, or one per prompt")
    return list(params)


def _adders(
    add: Callable[..., str],
    key: str,
    prompts: Sequence[Any],
    priority: Sequence[int] | None,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
) -> list[Callable[..., str]]:
    """``add`` bound to each prompt (as the keyword ``key``), with its priority and its LoRA adapter.

    Each asks for its final output alone: :meth:`LLM._run` collects nothing else.
    """
    priorities = _priority_per_prompt(priority, len(prompts))
    loras = _lora_per_prompt(lora_request, len(prompts))
    return [
        partial(add, **{key: prompt}, final_only=True, priority=q, lora_request=lora)
        for prompt, q, lora in zip(prompts, priorities, loras, strict=True)
    ]


def _priority_per_prompt(priority: Sequence[int] | None, num_prompts: int) -> list[int]:
    """One scheduling priority per prompt: 0 for all by default."""
    if priority is None:
        return [0] * num_prompts
    if len(priority) != num_prompts:
        raise ValueError(f"got {len(priority)} priorities for {num_prompts} prompts: give one per prompt")
    return list(priority)


def _lora_per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter (or ``None``, the base model) per prompt: the same for all unless a list gives one each."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if len(lora_request) != num_prompts:
        raise ValueError(
            f"got {len(lora_request)} LoRA requests for {num_prompts} prompts: give one, or one per prompt"
        )
    return list(lora_request)


def _inputs_from_legacy(
    prompt: str | list[str] | None,
    prompts: PromptInputs | Sequence[PromptInputs] | None,
    prompt_token_ids: list[int] | list[list[int]] | None,
    multi_modal_data: dict[str, Any] | None,
) -> list[PromptInputs]:
    """Translate the deprecated keywords into ``PromptInputs``, warning with the call to use instead."""
    keywords = {"prompt=": prompt, "prompts=": prompts, "prompt_token_ids=": prompt_token_ids}
    given = [keyword for keyword, value in keywords.items() if value is not None]
    if len(given) > 1:
        raise TypeError(f"pass only one of {', '.join(given)} (and better: pass inputs)")
    if prompt is not None:
        warnings.warn(
            "LLM.generate(prompt=...) is deprecated; call LLM.generate(prompt) or "
            "LLM.generate({'prompt': prompt}) instead",
            DeprecationWarning,
            stacklevel=3,
        )
        items: list[PromptInputs] = [{"prompt": p} for p in ([prompt] if isinstance(prompt, str) else prompt)]
    elif prompts is not None:
        warnings.warn(
            "LLM.generate(prompts=...) is deprecated; call LLM.generate(prompts), with the prompts as the first "
            "argument, instead",
            DeprecationWarning,
            stacklevel=3,
        )
        # vLLM's old keyword took strings; anything else a prompt may be passes through as it is.
        batch = [prompts] if isinstance(prompts, str | dict) else prompts
        items = [{"prompt": p} if isinstance(p, str) else p for p in batch]
    elif prompt_token_ids is not None:
        warnings.warn(
            "LLM.generate(prompt_token_ids=...) is deprecated; call "
            "LLM.generate({'prompt_token_ids': ids}) (or a list of such dicts) instead",
            DeprecationWarning,
            stacklevel=3,
        )
        batch = prompt_token_ids if prompt_token_ids and isinstance(prompt_token_ids[0], list) else [prompt_token_ids]
        items = [{"prompt_token_ids": ids} for ids in batch]
    else:
        raise TypeError("multi_modal_data= needs a prompt; pass {'prompt': ..., 'multi_modal_data': ...} as inputs")
    if multi_modal_data is not None:
        warnings.warn(
            "LLM.generate(multi_modal_data=...) is deprecated; put it in the prompt: "
            "LLM.generate({'prompt': ..., 'multi_modal_data': data}) instead",
            DeprecationWarning,
            stacklevel=3,
        )
        per_prompt = _split_multi_modal_data(multi_modal_data, len(items))
        items = [{**item, "multi_modal_data": data} for item, data in zip(items, per_prompt, strict=True)]
    return items


def _split_multi_modal_data(data: dict[str, Any], num_prompts: int) -> list[dict[str, Any]]:
    """Each prompt's share of the deprecated batched ``multi_modal_data``, as vLLM's old API gave it.

    One prompt gets it all; with several, every value holds one entry per prompt along its first dimension, and
    prompt ``i`` gets ``value[i:i + 1]``: entry ``i``, in the value's own type (a list, a tensor) with a batch
    dimension of one.

    Raises:
        ValueError: with several prompts, a value is not a batch of one entry per prompt.

    """
    if num_prompts == 1:
        return [data]
    for key, value in data.items():
        length = len(value) if isinstance(value, Sized) and not isinstance(value, str | bytes) else None
        if length != num_prompts:
            held = "is not a batch" if length is None else f"holds {length} entries"
            raise ValueError(
                f"multi_modal_data[{key!r}] {held}, but the deprecated multi_modal_data= needs one entry per prompt "
                f"({num_prompts}) along its first dimension; better, put each prompt's own data in its dict: "
                "{'prompt': ..., 'multi_modal_data': data}"
            )
    return [{key: value[i : i + 1] for key, value in data.items()} for i in range(num_prompts)]
