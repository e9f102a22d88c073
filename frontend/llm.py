"""``LLM``: offline batch generation, as in vLLM."""

import warnings
from collections.abc import Callable, Sequence
from functools import partial

from tqdm import tqdm

from spindle.frontend.llm_engine import LLMEngine
from spindle.frontend.tokenizer import Tokenizer
from spindle.shared import PromptInputs, RequestOutput, SamplingParams
from spindle.shared.config import EngineConfig

ChatMessages = list[dict[str, str]]


class LLM:
    """Generate completions for a batch of prompts with continuous batching, in this process.

    Args:
        model: a Hugging Face model directory, a ``.gguf`` file, or ``None`` for the embedded SmolLM2-135M-Instruct.
        multiprocess: run the engine core in a backend child process (as ``spindle serve`` does) instead of here.
        **engine_args: any other :class:`~spindle.shared.config.EngineConfig` field (``dtype``, ``max_model_len``,
            ``kv_cache_memory``, ``gpu_memory_utilization``, ``block_size``, ``max_num_seqs``,
            ``max_num_batched_tokens``, ``enable_prefix_caching``, ``device``). Two default differently here, as an
            offline batch wants throughput, not the latency of its first streams: ``max_decode_slowdown`` is 0 (no
            bound) and ``max_num_batched_tokens`` 2048 (longer steps, fewer of them).

    Example::

        llm = LLM(kv_cache_memory="1GiB")
        outputs = llm.generate(["Hello, my name is", {"prompt_token_ids": [1, 504, 3458]}],
                               SamplingParams(temperature=0, max_tokens=16))

    """

    def __init__(self, model: str | None = None, multiprocess: bool = False, **engine_args: object) -> None:
        engine_args.setdefault("max_decode_slowdown", 0)
        # Measured on 2 cores, bf16 SmolLM2, 2048 against 512 (two runs each): a fresh 1k prompt 773-919 against
        # 631-732 tok/s, 4k 358-391 against 310-327; 32 prompts of varied lengths within the machine's noise.
        engine_args.setdefault("max_num_batched_tokens", 2048)
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_args), multiprocess)
        self._next_id = 0

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
        prompt: str | list[str] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        multi_modal_data: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for one prompt or a list of prompts; outputs come back in input order.

        Args:
            inputs: a string, ``{"prompt": ...}``, ``{"prompt_token_ids": [...]}`` (each optionally with
                ``multi_modal_data``), or a list of these.
            sampling_params: one :class:`SamplingParams` for all prompts or one per prompt (default
                ``SamplingParams()``).
            use_tqdm: show a progress bar.
            prompt: deprecated; pass ``inputs`` (a string or a list of strings) instead.
            prompt_token_ids: deprecated; pass ``{"prompt_token_ids": ids}`` (or a list of them) instead.
            multi_modal_data: deprecated; put ``multi_modal_data`` inside each prompt dict instead.

        """
        if prompt is not None or prompt_token_ids is not None or multi_modal_data is not None:
            if inputs is not None:
                raise TypeError("pass either inputs or the deprecated prompt/prompt_token_ids keywords, not both")
            inputs = _inputs_from_legacy(prompt, prompt_token_ids, multi_modal_data)
        if inputs is None:
            raise TypeError("LLM.generate() needs inputs: a prompt or a list of prompts")
        prompts = [inputs] if isinstance(inputs, str | dict) else list(inputs)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        add = self.llm_engine.add_request
        return self._run([partial(add, inputs=prompt) for prompt in prompts], params_list, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate replies."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params_list = self._params_per_prompt(sampling_params, len(conversations))
        add = partial(self.llm_engine.add_chat_request, add_generation_prompt=add_generation_prompt)
        return self._run([partial(add, messages=conv) for conv in conversations], params_list, use_tqdm)

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if not isinstance(sampling_params, Sequence):
            return [sampling_params or SamplingParams()] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts: give one, or one per prompt"
            )
        return list(sampling_params)

    def _run(
        self, adders: list[Callable[..., str]], params_list: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
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
        results: list[RequestOutput | None] = [None] * len(adders)
        bar = tqdm(total=len(adders), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        num_prompt_tokens = num_output_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    results[order[output.request_id]] = output
                    num_prompt_tokens += len(output.prompt_token_ids)
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


def _inputs_from_legacy(
    prompt: str | list[str] | None, prompt_token_ids: list[int] | list[list[int]] | None, multi_modal_data: dict | None
) -> list[PromptInputs]:
    """Translate the deprecated keywords into ``PromptInputs``, warning with the call to use instead."""
    if prompt is not None and prompt_token_ids is not None:
        raise TypeError("pass prompt= or prompt_token_ids=, not both (and better: pass inputs)")
    if prompt is not None:
        warnings.warn(
            "LLM.generate(prompt=...) is deprecated; call LLM.generate(prompt) or "
            "LLM.generate({'prompt': prompt}) instead",
            DeprecationWarning,
            stacklevel=3,
        )
        items: list[dict] = [{"prompt": p} for p in ([prompt] if isinstance(prompt, str) else prompt)]
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
        for item in items:
            item["multi_modal_data"] = multi_modal_data
    return items
