import asyncio
import base64
import functools
import re
import threading

import pytest
from conftest import LLAVA_IMAGE_SIZE, LLAVA_IMAGE_TOKENS
from test_image_processor import encode, model_files, random_image
from transformers import AutoTokenizer

from spindle import SamplingParams
from spindle.frontend.processing.image_processor import ImageProcessor
from spindle.frontend.processing.input_processor import OFF_LOOP_CHARACTERS, InputProcessor, ProcessedPrompt
from spindle.frontend.processing.tokenizer import Tokenizer
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


@pytest.mark.parametrize(
    ("length", "off_loop"), [(OFF_LOOP_CHARACTERS, False), (OFF_LOOP_CHARACTERS + 1, True)], ids=["short", "long"]
)
@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
def test_long_texts_are_tokenized_off_the_event_loop(processor, monkeypatch, length, off_loop, chat):
    threads = []
    encode = processor.tokenizer.encode
    monkeypatch.setattr(
        processor.tokenizer, "encode", lambda *a, **k: threads.append(threading.get_ident()) or encode(*a, **k)
    )
    text, params = "a" * length, SamplingParams(max_tokens=1)

    async def process() -> int:
        call = (
            processor.process_chat_async([{"role": "user", "content": text}], params)
            if chat
            else processor.process_async(text, params)
        )
        with pytest.raises(InvalidRequestError, match="more than max_model_len"):  # tokenized, then refused
            await call
        return threading.get_ident()

    loop_thread = asyncio.run(process())
    assert len(threads) == 1 and (threads[0] != loop_thread) == off_loop


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
        ({}, "prompt", "exactly one of 'prompt', 'prompt_token_ids' and 'prompt_embeds', got []"),
        (
            {"prompt": "a", "prompt_token_ids": [1]},
            "prompt",
            "exactly one of 'prompt', 'prompt_token_ids' and 'prompt_embeds'",
        ),
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
            [{"role": "user", "content": 42}],
            "messages[0].content",
            "messages[0] needs a str 'content', got 42: give text, or a list of parts",
        ),
        (
            [{"role": "user", "content": ["parts"]}],
            "messages[0].parts[0]",
            "messages[0].parts[0] must be {'type': 'text', 'text': str}, {'type': 'image', 'image': PIL image or "
            "bytes} or {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}, not 'parts'",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "image": b"png"}]}],
            "messages[0].parts[1]",
            "this model takes text only: messages[0].parts[1] is an image part",
        ),
    ],
)
def test_malformed_conversations_are_refused(processor, messages, field, message):
    refused(lambda: processor.process_chat(messages, SamplingParams()), (field,), message)


def test_a_text_only_model_gets_text_parts_joined_by_newlines(processor):
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    processor = InputProcessor(processor.tokenizer, 1000, processor.vocab_size)
    params = SamplingParams(max_tokens=1)
    joined = processor.process_chat([{"role": "user", "content": "Hi\nthere"}], params)
    assert processor.process_chat([{"role": "user", "content": parts}], params) == joined


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


@pytest.mark.parametrize(
    "field,value",
    [("logit_bias", {100: 1.0}), ("stop_token_ids", [5, 100, 120]), ("allowed_token_ids", [5, 99, 100])],
)
def test_sampling_token_ids_must_be_in_the_vocabulary(tokenizer, field, value):
    processor = InputProcessor(tokenizer, MAX_MODEL_LEN, vocab_size=100)
    params = SamplingParams(max_tokens=1, **{field: value})
    refused(
        lambda: processor.process({"prompt_token_ids": [1]}, params),
        (f"sampling_params.{field}",),
        f"SamplingParams.{field} names token ids",
    )


LONG_TEXT = "The quick brown fox jumps over the lazy dog, twice: the quick brown fox jumps over the lazy dog."
LONG_CHAT = [{"role": "user", "content": LONG_TEXT}]


@pytest.mark.parametrize("keep", [1, 5, 11])
@pytest.mark.parametrize("form", ["text", "token_ids", "chat"])
def test_truncation_keeps_the_last_tokens_before_the_length_checks(processor, hf_tokenizer, keep, form):
    processor = InputProcessor(processor.tokenizer, 20, processor.vocab_size)
    params = SamplingParams(max_tokens=10, truncate_prompt_tokens=keep)
    if form == "chat":
        rendered = hf_tokenizer.apply_chat_template(LONG_CHAT, tokenize=False, add_generation_prompt=True)
        full = hf_tokenizer.encode(rendered, add_special_tokens=False)
        call = functools.partial(processor.process_chat, LONG_CHAT, params)
    else:
        full = hf_tokenizer.encode(LONG_TEXT)
        inputs = {"prompt": LONG_TEXT} if form == "text" else {"prompt_token_ids": full}
        call = functools.partial(processor.process, inputs, params)
    assert len(full) > 20  # refused whole
    if keep + 10 > 20:  # kept, the prompt still leaves no room for max_tokens
        refused(call, ("prompt", "sampling_params.max_tokens"), f"the prompt has {keep} tokens and max_tokens=10")
    else:
        assert call().prompt_token_ids == full[-keep:]


def test_truncation_to_minus_one_keeps_the_context_length(processor):
    short = {"prompt_token_ids": [7] * 5}
    params = SamplingParams(max_tokens=None, truncate_prompt_tokens=-1)
    assert processor.process(short, params).prompt_token_ids == short["prompt_token_ids"]
    # As in vLLM: cut to max_model_len, the prompt leaves no room to generate.
    refused(
        lambda: processor.process({"prompt_token_ids": list(range(100, 140))}, params),
        ("prompt",),
        f"the prompt has {MAX_MODEL_LEN} tokens, which leaves no room to generate",
    )


@pytest.mark.parametrize("words", [["hello"], ["  world", "cat sat", "😀"]], ids=["one", "several"])
def test_bad_words_become_their_token_sequences_with_and_without_a_space(tokenizer_pair, words):
    ours, hf = tokenizer_pair
    processor = InputProcessor(ours, MAX_MODEL_LEN, ours.vocab_size)
    params = SamplingParams(max_tokens=1, bad_words=words)
    processor.process({"prompt_token_ids": [1]}, params)
    expected = []
    for word in words:
        plain = hf.encode(word.lstrip(), add_special_tokens=False)
        spaced = hf.encode(" " + word.lstrip(), add_special_tokens=False)
        expected += [plain] if spaced == plain else [plain, spaced]
    assert params.bad_words_token_ids == expected


def test_bad_words_outside_the_vocabulary_are_refused(tokenizer):
    processor = InputProcessor(tokenizer, MAX_MODEL_LEN, vocab_size=100)
    params = SamplingParams(max_tokens=1, bad_words=["hello"])
    refused(
        lambda: processor.process({"prompt_token_ids": [1]}, params),
        ("sampling_params.bad_words",),
        "SamplingParams.bad_words tokenize to token ids",
    )


# A vision-language model: the tiny LLaVA, whose <image> (token 256) stands for 16 image tokens.

IMAGE = 256
LLAVA_MAX_MODEL_LEN = 200
IMAGES = [random_image((30, 20), "RGB", seed) for seed in range(3)]


@pytest.fixture(scope="module")
def llava(tiny_llava_dir) -> InputProcessor:
    tokenizer = Tokenizer.from_dir(tiny_llava_dir)
    image_processor = ImageProcessor.from_files(model_files(tiny_llava_dir))
    return InputProcessor(tokenizer, LLAVA_MAX_MODEL_LEN, tokenizer.vocab_size, image_processor)


def expanded(llava: InputProcessor, pieces: list[str | None]) -> tuple[list[int], list[int]]:
    """The token ids of text ``pieces`` with each ``None`` an image's run of image tokens, and the runs' offsets."""
    token_ids, offsets = [], []
    for piece in pieces:
        if piece is None:
            offsets.append(len(token_ids))
            token_ids += [IMAGE] * LLAVA_IMAGE_TOKENS
        else:
            token_ids += llava.tokenizer.encode(piece)
    return token_ids, offsets


def assert_images(llava: InputProcessor, processed: ProcessedPrompt, images: list, offsets: list[int]) -> None:
    """``processed`` carries ``images``, preprocessed, at ``offsets``."""
    assert [(image.offset, image.length) for image in processed.images] == [(o, LLAVA_IMAGE_TOKENS) for o in offsets]
    for image, given in zip(processed.images, images, strict=True):
        assert image.shape == [3, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE]
        assert (image.array() == llava.image_processor.preprocess(given)).all()


PIECES = ["USER: ", None, "\nCompare with ", None, " ASSISTANT:"]


@pytest.mark.parametrize("second", [IMAGES[1], encode(IMAGES[1])], ids=["pil", "png-bytes"])
def test_each_image_token_of_a_text_prompt_expands_to_an_image(llava, second):
    prompt = "USER: <image>\nCompare with <image> ASSISTANT:"
    processed = llava.process({"prompt": prompt, "multi_modal_data": {"image": [IMAGES[0], second]}}, SamplingParams())
    token_ids, offsets = expanded(llava, PIECES)
    assert processed.prompt == prompt and processed.prompt_token_ids == token_ids
    assert_images(llava, processed, [IMAGES[0], second], offsets)


@pytest.mark.parametrize("run", [1, LLAVA_IMAGE_TOKENS], ids=["one-token", "full-run"])
def test_an_image_run_of_a_token_prompt_expands_to_an_image(llava, run):
    text_ids, offsets = expanded(llava, PIECES)
    pieces = [[IMAGE] * run if piece is None else llava.tokenizer.encode(piece) for piece in PIECES]
    inputs = {"prompt_token_ids": sum(pieces, []), "multi_modal_data": {"image": IMAGES[:2]}}
    processed = llava.process(inputs, SamplingParams())
    assert processed.prompt is None and processed.prompt_token_ids == text_ids
    assert_images(llava, processed, IMAGES[:2], offsets)


@pytest.mark.parametrize("images", [IMAGES[0], (IMAGES[0],), [IMAGES[0]]], ids=["one", "tuple", "list"])
def test_one_image_may_come_alone_or_in_a_sequence(llava, images):
    processed = llava.process({"prompt": "<image>hi", "multi_modal_data": {"image": images}}, None)
    assert_images(llava, processed, [IMAGES[0]], [0])


def test_equal_images_hash_equal_and_different_ones_differ(llava):
    inputs = {
        "prompt": "<image><image><image>",
        "multi_modal_data": {"image": [IMAGES[0], encode(IMAGES[0]), IMAGES[1]]},
    }
    first, same, other = (image.content_hash for image in llava.process(inputs, SamplingParams()).images)
    assert first == same != other


def data_url(image, media_type: str = "image/png") -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": f"data:{media_type};base64,{base64.b64encode(encode(image)).decode()}"},
    }


def test_chat_image_parts_render_as_the_template_places_them(llava, tiny_llava_dir):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": IMAGES[0]}]},
        {"role": "user", "content": [data_url(IMAGES[1]), {"type": "text", "text": "with it."}]},
    ]
    processed = llava.process_chat(messages, SamplingParams())
    as_the_template_sees_it = [
        messages[0],
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "with it."}]},
    ]
    expected = AutoTokenizer.from_pretrained(tiny_llava_dir).apply_chat_template(
        as_the_template_sees_it, tokenize=False, add_generation_prompt=True
    )
    assert (
        processed.prompt
        == expected
        == "SYSTEM: Be brief.\nUSER: Compare <image>\n\nUSER: <image>\nwith it.\nASSISTANT:"
    )
    token_ids, offsets = expanded(
        llava, ["SYSTEM: Be brief.\nUSER: Compare ", None, "\n\nUSER: ", None, "\nwith it.\nASSISTANT:"]
    )
    assert processed.prompt_token_ids == token_ids
    assert_images(llava, processed, IMAGES[:2], offsets)


def test_the_context_limit_counts_the_expanded_prompt(llava):
    room = LLAVA_MAX_MODEL_LEN - LLAVA_IMAGE_TOKENS - 2
    inputs = {"prompt": "<image>ab", "multi_modal_data": {"image": IMAGES[0]}}
    assert len(llava.process(inputs, SamplingParams(max_tokens=room)).prompt_token_ids) == LLAVA_IMAGE_TOKENS + 2
    refused(
        lambda: llava.process(inputs, SamplingParams(max_tokens=room + 1)),
        ("prompt", "sampling_params.max_tokens"),
        f"the prompt has {LLAVA_IMAGE_TOKENS + 2} tokens and max_tokens={room + 1}",
    )


def test_a_prompt_with_images_is_not_truncated(llava):
    inputs = {"prompt": "<image>ab", "multi_modal_data": {"image": IMAGES[0]}}
    length = LLAVA_IMAGE_TOKENS + 2
    assert len(llava.process(inputs, SamplingParams(truncate_prompt_tokens=length)).prompt_token_ids) == length
    refused(
        lambda: llava.process(inputs, SamplingParams(truncate_prompt_tokens=length - 1)),
        ("sampling_params.truncate_prompt_tokens",),
        "a prompt with images is not truncated",
    )


def with_images(prompt: str | list[int], *images) -> dict:
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt, "multi_modal_data": {"image": list(images)}}


@pytest.mark.parametrize(
    "inputs,fields,message",
    [
        (
            {"prompt": "<image>", "multi_modal_data": {"audio": b"wav"}},
            ("prompt.multi_modal_data",),
            "this model takes images only: multi_modal_data must be {'image': an image or a list of images}, "
            "got the keys ['audio']",
        ),
        ({"prompt": "<image>", "multi_modal_data": [IMAGES[0]]}, ("prompt.multi_modal_data",), "got a list"),
        (with_images("<image>", "cat.png"), ("prompt.multi_modal_data[0]",), "not str"),
        (
            with_images("<image><image>", IMAGES[0]),
            ("prompt.multi_modal_data", "prompt.text"),
            "the prompt has 2 image placeholders (<image>) but 1 images were given: put one <image> where each image "
            "goes, in the images' order",
        ),
        (with_images("no placeholder", IMAGES[0]), ("prompt.multi_modal_data", "prompt.text"), "has 0 image"),
        ({"prompt": "<image>"}, ("prompt.multi_modal_data", "prompt.text"), "1 image placeholders (<image>) but 0"),
        (
            with_images([IMAGE, 5, IMAGE], IMAGES[0]),
            ("prompt.multi_modal_data", "prompt.token_ids"),
            "the prompt has 2 image placeholders",
        ),
        (
            with_images([1, IMAGE, IMAGE, 2], IMAGES[0]),
            ("prompt.token_ids[1]",),
            "prompt_token_ids[1:3] is a run of 2 image tokens (256): an image's placeholder is 1 image token or all "
            "16 of the image's",
        ),
        (with_images("<image><image>", IMAGES[0], b"junk"), ("prompt.multi_modal_data[1]",), "is not a PNG, JPEG"),
    ],
    ids=[
        "other-modality",
        "not-a-dict",
        "not-an-image",
        "too-few-images",
        "no-placeholder",
        "no-images",
        "token-placeholders",
        "partial-run",
        "undecodable",
    ],
)
def test_image_prompts_are_refused_naming_the_field(llava, inputs, fields, message):
    refused(lambda: llava.process(inputs, SamplingParams()), fields, message)


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


TEXT_PART = {"type": "text", "text": "Look: "}


@pytest.mark.parametrize(
    "messages,field,message",
    [
        (
            user(TEXT_PART, {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}),
            "messages[0].parts[1]",
            "messages[0].parts[1] is an https URL, and the server fetches nothing: send the image inline",
        ),
        (
            user(TEXT_PART, {"type": "image_url", "image_url": {"url": "data:image/png,raw"}}),
            "messages[0].parts[1]",
            "url must be a base64 image data URL (data:image/png;base64,...), got 'data:image/png,raw'",
        ),
        (user(data_url(IMAGES[0], "text/plain")), "messages[0].parts[0]", "must be a base64 image data URL"),
        (
            user({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}),
            "messages[0].parts[0]",
            "data URL is not valid base64",
        ),
        (user({"type": "image_url", "image_url": "cat.png"}), "messages[0].parts[0]", "needs an 'image_url' of"),
        (user({"type": "image"}), "messages[0].parts[0]", "messages[0].parts[0] must be {'type': 'text'"),
        (user({"type": "audio", "audio": b""}), "messages[0].parts[0]", "must be {'type': 'text'"),
        (user({"type": "image", "image": b"junk"}), "messages[0].parts[0]", "is not a PNG, JPEG"),
        (user({"type": "text", "text": "<image>"}), "messages", "the prompt has 1 image placeholders (<image>) but 0"),
    ],
    ids=["http", "not-base64", "not-an-image", "bad-base64", "url-not-a-dict", "no-image", "unknown", "junk", "count"],
)
def test_chat_image_parts_are_refused_naming_the_part(llava, messages, field, message):
    refused(lambda: llava.process_chat(messages, SamplingParams()), (field,), message)
