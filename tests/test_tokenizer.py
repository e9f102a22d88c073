import json
import random
import shutil
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
import tokenizers
from gil_probe import lets_other_threads_run
from transformers import AutoTokenizer, GenerationConfig

from spindle.frontend.processing.tokenizer import Tokenizer

pytest_plugins = ["fixtures_tokenizer"]

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "Unicode: naïve café, 😀🎉, 你好世界, 日本語のテキスト",
    "def f(x):\n\treturn x ** 2  # code\n\n",
    "special tokens in text: <|im_start|>user\nhi<|im_end|> <s> </s>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in 中文?"},
    ],
]

# Exercises what transformers gives templates: bos/eos variables, raise_exception, tojson (not HTML-escaped),
# strftime_now, loop controls, the {% generation %} marker, and trim_blocks/lstrip_blocks whitespace handling.
FEATURE_TEMPLATE = """{{ bos_token }}
{% if messages[0]['role'] == 'tool' %}
    {{ raise_exception('a conversation cannot start with a tool message') }}
{% endif %}
Year {{ strftime_now('%Y') }}, extra={{ extra | default('none') }}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    <{{ message['role'] }}>{{ message | tojson }}
    {% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.fixture
def smollm2_config(tokenizer_dir: Path) -> dict:
    return json.loads((tokenizer_dir / "tokenizer_config.json").read_text())


@pytest.fixture
def variant_dir(tmp_path: Path, tokenizer_dir: Path) -> Callable[..., Path]:
    """Copy the SmolLM2 tokenizer directory, then write files (dicts as JSON) into it and remove others."""

    def make(files: dict[str, dict | str], remove: tuple[str, ...] = ()) -> Path:
        path = tmp_path / f"variant{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tokenizer_dir, path)
        for name in remove:
            (path / name).unlink()
        for name, content in files.items():
            (path / name).write_text(content if isinstance(content, str) else json.dumps(content))
        return path

    return make


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer_pair, text, add_special_tokens):
    ours, hf = tokenizer_pair
    assert ours.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens)


def test_a_long_encode_lets_other_threads_run(tokenizer):
    """Encoding releases the GIL: a megabyte prompt tokenized off the event loop leaves the loop (and the heartbeat
    thread, whose silence would cost the frontend its session with the backend) running."""
    text = "lorem ipsum dolor " * 60_000
    assert lets_other_threads_run(lambda: tokenizer.encode(text))


def test_post_processor_adds_the_bos(llama_style_tokenizer):
    ids = llama_style_tokenizer.encode("Hello")
    assert ids[0] == llama_style_tokenizer.bos_token_id
    assert llama_style_tokenizer.encode("Hello", add_special_tokens=False) == ids[1:]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizer_pair, skip_special_tokens):
    ours, hf = tokenizer_pair
    rng = random.Random(0)
    sequences = [hf.encode(text) for text in TEXTS]
    sequences += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 30))] for _ in range(50)]
    for ids in sequences:
        assert ours.decode(ids, skip_special_tokens) == hf.decode(ids, skip_special_tokens=skip_special_tokens)


def test_vocabulary_properties_match_transformers(tokenizer_pair):
    ours, hf = tokenizer_pair
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_ids == [hf.eos_token_id]
    assert isinstance(ours.backend, tokenizers.Tokenizer)
    ids = list(range(0, len(hf), 97)) + ours.all_special_ids
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    # logprobs' decoded_token is each token decoded on its own, special tokens included (as vLLM does).
    assert [ours.id_to_text(i) for i in ids] == [hf.decode([i]) for i in ids]


def test_all_special_ids_are_exactly_the_tokens_decode_skips(tokenizer_pair):
    ours, hf = tokenizer_pair
    assert set(hf.all_special_ids) <= set(ours.all_special_ids)
    # A lone "▁" decodes to "" either way (the decoder strips a leading space): only skipping drops specials.
    skipped = {i for i in range(len(hf)) if hf.decode([i], skip_special_tokens=True) != hf.decode([i])}
    assert set(ours.all_special_ids) == skipped


def test_unknown_ids_are_rejected_by_convert_ids_to_tokens(tokenizer):
    with pytest.raises(ValueError, match=rf"\[{tokenizer.vocab_size}\].*{tokenizer.vocab_size} tokens"):
        tokenizer.convert_ids_to_tokens([5, tokenizer.vocab_size])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    assert tokenizer.has_chat_template
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt) == expected


NAMED_TEMPLATES = [{"name": "tool_use", "template": "tools only"}, {"name": "default", "template": FEATURE_TEMPLATE}]


@pytest.mark.parametrize(
    "file_name,content",
    [
        ("chat_template.jinja", FEATURE_TEMPLATE),
        ("chat_template.json", {"chat_template": FEATURE_TEMPLATE}),
        ("tokenizer_config.json", {"chat_template": FEATURE_TEMPLATE}),
        ("tokenizer_config.json", {"chat_template": NAMED_TEMPLATES}),
    ],
    ids=["jinja_file", "chat_template_json", "tokenizer_config", "named_templates"],
)
def test_template_features_and_locations_match_transformers(
    variant_dir, smollm2_config, hf_tokenizer, file_name, content
):
    if file_name == "tokenizer_config.json":
        content = {**smollm2_config, **content}
    ours = Tokenizer.from_dir(variant_dir({file_name: content}, remove=("chat_template.jinja",)))
    messages = [*CONVERSATIONS[2], {"role": "assistant", "content": 'Rot & <grün> "quoted"'}]
    for add_generation_prompt in (True, False):
        expected = hf_tokenizer.apply_chat_template(
            messages,
            chat_template=FEATURE_TEMPLATE,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            extra=[1, "二"],
        )
        assert ours.apply_chat_template(messages, add_generation_prompt, extra=[1, "二"]) == expected
    assert f"Year {datetime.now().year}" in expected and "\\u" not in expected and "&lt;" not in expected


def test_template_errors_become_value_errors(variant_dir):
    ours = Tokenizer.from_dir(variant_dir({"chat_template.jinja": FEATURE_TEMPLATE}))
    with pytest.raises(ValueError, match="cannot start with a tool message"):
        ours.apply_chat_template([{"role": "tool", "content": "42"}])
    broken = Tokenizer.from_dir(variant_dir({"chat_template.jinja": "{% for m in messages %}"}))
    with pytest.raises(ValueError, match="chat template"):
        broken.apply_chat_template(CONVERSATIONS[0])


def test_jinja_file_takes_precedence_like_transformers(variant_dir, smollm2_config):
    path = variant_dir({"tokenizer_config.json": {**smollm2_config, "chat_template": "from the config"}})
    expected = AutoTokenizer.from_pretrained(path).apply_chat_template(CONVERSATIONS[0], tokenize=False)
    assert Tokenizer.from_dir(path).apply_chat_template(CONVERSATIONS[0], add_generation_prompt=False) == expected
    assert "from the config" not in expected


def test_a_model_without_template_raises_a_clear_error(llama_style_tokenizer):
    assert not llama_style_tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        llama_style_tokenizer.apply_chat_template(CONVERSATIONS[0])


def test_eos_ids_gather_the_generation_config_and_config(variant_dir, hf_tokenizer):
    path = variant_dir({"generation_config.json": {"eos_token_id": [2, 16]}, "config.json": {"eos_token_id": 0}})
    generation_eos = GenerationConfig.from_pretrained(path).eos_token_id
    expected = list(dict.fromkeys([hf_tokenizer.eos_token_id, *generation_eos, 0]))
    assert Tokenizer.from_dir(path).eos_token_ids == expected == [2, 16, 0]


def test_legacy_special_tokens_map_is_read_like_transformers(variant_dir, smollm2_config):
    moved = {name: smollm2_config.pop(name) for name in ("bos_token", "eos_token")}
    path = variant_dir({"tokenizer_config.json": smollm2_config, "special_tokens_map.json": moved})
    hf = AutoTokenizer.from_pretrained(path)
    ours = Tokenizer.from_dir(path)
    assert (ours.bos_token_id, ours.eos_token_ids) == (hf.bos_token_id, [hf.eos_token_id]) == (1, [2])


def test_a_directory_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
