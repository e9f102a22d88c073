import re

import pytest

from spindle import SamplingParams
from spindle.frontend.input_processor import InputProcessor, ProcessedPrompt
from spindle.frontend.tokenizer import Tokenizer
from spindle.shared.errors import InvalidRequestError

pytest_plugins = ["fixtures_tokenizer"]

MAX_MODEL_LEN = 16
TEXT = "Hello there, 😀 你好!"


@pytest.fixture
def processor(tokenizer) -> InputProcessor:
    return InputProcessor(tokenizer, MAX_MODEL_LEN, tokenizer.vocab_size)


@pytest.mark.parametrize("inputs", [TEXT, {"prompt": TEXT}], ids=["str", "text_prompt"])
def test_text_prompts_are_tokenized_like_transformers(processor, hf_tokenizer, inputs):
    processed = processor.process(inputs, SamplingParams(max_tokens=1))
    assert processed == ProcessedPrompt(TEXT, hf_tokenizer.encode(TEXT))


def test_token_prompts_pass_through_unchanged(processor):
    ids = [0, 17, 49151]
    processed = processor.process({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    assert processed == ProcessedPrompt(None, ids)


def refused(call, fields: tuple[str, ...], message: str) -> InvalidRequestError:
    """``call()`` raises an InvalidRequestError (a ValueError) for ``fields``, with ``message`` in its text."""
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as error:
        call()
    assert isinstance(error.value, ValueError) and error.value.fields == fields
    return error.value


@pytest.mark.parametrize(
    "inputs,field,message",
    [
        (42, "prompt", "a prompt must be a str, {'prompt': str} or {'prompt_token_ids': list[int]}, not int"),
        (["a list"], "prompt", "not list"),
        ({}, "prompt", "exactly one of 'prompt' and 'prompt_token_ids', got []"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt", "exactly one of 'prompt' and 'prompt_token_ids'"),
        ({"prompt": "a", "max_tokens": 5}, "prompt", "unknown prompt keys ['max_tokens']: the allowed keys are"),
        ({"prompt": b"bytes"}, "prompt.text", "'prompt' must be a str, not bytes"),
        ({"prompt_token_ids": "1 2"}, "prompt.token_ids", "'prompt_token_ids' must be a list of ints, not str"),
        ({"prompt_token_ids": [1, 2.0]}, "prompt.token_ids[1]", "prompt_token_ids[1] = 2.0 is not an int"),
        ({"prompt_token_ids": [True]}, "prompt.token_ids[0]", "prompt_token_ids[0] = True is not an int"),
        ({"prompt_token_ids": [5, -1]}, "prompt.token_ids[1]", "prompt_token_ids[1] = -1 is outside the vocabulary"),
        ({"prompt_token_ids": [49152]}, "prompt.token_ids[0]", "token ids must be in [0, 49152)"),
        ("", "prompt", "the prompt is empty"),
        ({"prompt_token_ids": []}, "prompt", "the prompt is empty"),
        (
            {"prompt": "hi", "multi_modal_data": {"image": "cat.png"}},
            "prompt.multi_modal_data",
            "takes text only: remove 'multi_modal_data'",
        ),
    ],
)
def test_malformed_prompts_are_refused(processor, inputs, field, message):
    refused(lambda: processor.process(inputs, SamplingParams()), (field,), message)


def test_a_multimodal_model_keeps_the_data(tokenizer):
    processor = InputProcessor(tokenizer, MAX_MODEL_LEN, tokenizer.vocab_size, supports_multimodal=True)
    data = {"image": "cat.png"}
    processed = processor.process({"prompt_token_ids": [1, 2], "multi_modal_data": data}, SamplingParams(max_tokens=1))
    assert processed == ProcessedPrompt(None, [1, 2], data)


@pytest.mark.parametrize(
    "num_prompt_tokens,max_tokens,fields,message",
    [
        (10, 6, (), None),
        (
            10,
            7,
            ("prompt", "sampling_params.max_tokens"),
            "the prompt has 10 tokens and max_tokens=7, together 17, more than max_model_len=16: shorten the "
            "prompt or lower max_tokens to at most 6",
        ),
        (
            16,
            1,
            ("prompt", "sampling_params.max_tokens"),
            "the prompt has 16 tokens and max_tokens=1, together 17, more than max_model_len=16: shorten the prompt",
        ),
        (15, None, (), None),
        (
            16,
            None,
            ("prompt",),
            "the prompt has 16 tokens, which leaves no room to generate in the model's context of "
            "max_model_len=16 tokens: shorten the prompt",
        ),
    ],
)
def test_prompt_and_max_tokens_must_fit_the_context(processor, num_prompt_tokens, max_tokens, fields, message):
    inputs = {"prompt_token_ids": [7] * num_prompt_tokens}
    params = SamplingParams(max_tokens=max_tokens)
    if message is None:
        assert len(processor.process(inputs, params).prompt_token_ids) == num_prompt_tokens
    else:
        assert str(refused(lambda: processor.process(inputs, params), fields, message)) == message


def test_the_vocab_size_given_bounds_the_ids(tokenizer):
    processor = InputProcessor(tokenizer, MAX_MODEL_LEN, vocab_size=100)
    assert processor.process({"prompt_token_ids": [99]}, SamplingParams(max_tokens=1)).prompt_token_ids == [99]
    with pytest.raises(ValueError, match=re.escape("token ids must be in [0, 100)")):
        processor.process({"prompt_token_ids": [100]}, SamplingParams())


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_renders_the_template_like_transformers(processor, hf_tokenizer, add_generation_prompt):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!", "name": "ana"}]
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    processor = InputProcessor(processor.tokenizer, 1000, processor.vocab_size)
    processed = processor.process_chat(messages, SamplingParams(max_tokens=1), add_generation_prompt)
    assert processed.prompt == expected
    assert processed.prompt_token_ids == hf_tokenizer.encode(expected, add_special_tokens=False)


def test_chat_prompts_get_no_second_bos(llama_style_tokenizer):
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = Tokenizer(llama_style_tokenizer.backend, template, llama_style_tokenizer.special_tokens)
    processor = InputProcessor(tokenizer, MAX_MODEL_LEN, tokenizer.vocab_size)
    bos = tokenizer.bos_token_id
    assert tokenizer.encode("hi")[0] == bos  # plain prompts get the bos from the post-processor
    ids = processor.process_chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1)).prompt_token_ids
    assert ids[0] == bos and ids.count(bos) == 1


@pytest.mark.parametrize(
    "messages,field,message",
    [
        ([], "messages", "messages must be a non-empty list of {'role': str, 'content': str} dicts"),
        ("hi", "messages", "messages must be a non-empty list"),
        (["hi"], "messages[0]", "messages[0] must be a dict with 'role' and 'content', not 'hi'"),
        (
            [{"role": "user", "content": "a"}, {"role": "user"}],
            "messages[1].content",
            "messages[1] needs a str 'content', got None",
        ),
        ([{"role": 3, "content": "a"}], "messages[0].role", "messages[0] needs a str 'role', got 3"),
        (
            [{"role": "user", "content": ["parts"]}],
            "messages[0].content",
            "messages[0] needs a str 'content', got ['parts']",
        ),
    ],
)
def test_malformed_conversations_are_refused(processor, messages, field, message):
    refused(lambda: processor.process_chat(messages, SamplingParams()), (field,), message)


@pytest.mark.parametrize(
    "template,message",
    [(None, "no chat template"), ("{{ raise_exception('no system role') }}", "rejected the conversation: no system")],
    ids=["no-template", "template-refuses"],
)
def test_chat_the_template_cannot_render_is_refused(llama_style_tokenizer, template, message):
    tokenizer = Tokenizer(llama_style_tokenizer.backend, template, llama_style_tokenizer.special_tokens)
    processor = InputProcessor(tokenizer, MAX_MODEL_LEN, tokenizer.vocab_size)
    refused(
        lambda: processor.process_chat([{"role": "user", "content": "hi"}], SamplingParams()), ("messages",), message
    )


@pytest.mark.parametrize("field,value", [("logit_bias", {100: 1.0}), ("stop_token_ids", [5, 100, 120])])
def test_sampling_token_ids_must_be_in_the_vocabulary(tokenizer, field, value):
    processor = InputProcessor(tokenizer, MAX_MODEL_LEN, vocab_size=100)
    params = SamplingParams(max_tokens=1, **{field: value})
    refused(
        lambda: processor.process({"prompt_token_ids": [1]}, params),
        (f"sampling_params.{field}",),
        f"SamplingParams.{field} names token ids",
    )
