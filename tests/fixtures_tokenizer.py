"""Tokenizer fixtures for the frontend tests; load them with ``pytest_plugins = ["fixtures_tokenizer"]``.

* ``hf_tokenizer`` / ``tokenizer_dir`` / ``tokenizer``: the embedded SmolLM2 GGUF's tokenizer (byte-level BPE),
  converted once per session by transformers (the reference) and loaded from the saved directory by ours.
* ``llama_style_dir`` / ``hf_llama_style`` / ``llama_style_tokenizer``: a small Llama-style BPE with byte
  fallback (``▁`` for spaces, ``<0xNN>`` byte tokens, a decoder that strips the text's leading space, a bos added
  by the post-processor), trained here because SmolLM2's byte-level BPE cannot exercise those code paths.
* ``tokenizer_pair``: (ours, transformers') for each of the two.
"""

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from spindle.backend.models.loader import embedded_gguf
from spindle.frontend.processing.tokenizer import Tokenizer

LLAMA_STYLE_CORPUS = [
    "Hello world, the cat sat on the mat.",
    "The quick brown fox jumps over the lazy dog!",
    "Stop strings end a completion; tokens stream as text.",
    "[INST] What is the capital of France? [/INST] Paris is the capital.",
]


@pytest.fixture(scope="session")
def hf_tokenizer() -> PreTrainedTokenizerBase:
    gguf = embedded_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: PreTrainedTokenizerBase) -> Path:
    path = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="session")
def llama_style_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trained = BackendTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trained.train_from_iterator(LLAMA_STYLE_CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    # Llama's layout: <unk>, <s>, </s>, the 256 byte tokens, then the learned pieces.
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += sorted(model["vocab"], key=model["vocab"].get)
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = [tuple(merge) for merge in model["merges"]]
    backend = BackendTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    path = tmp_path_factory.mktemp("llama_style_tokenizer")
    backend.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True, "__type": "AddedToken"},
        "unk_token": "<unk>",
        "add_bos_token": True,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def llama_style_tokenizer(llama_style_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(llama_style_dir)


@pytest.fixture(scope="session")
def hf_llama_style(llama_style_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(llama_style_dir)


@pytest.fixture(scope="session", params=["smollm2", "llama_style"])
def tokenizer_pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, PreTrainedTokenizerBase]:
    if request.param == "smollm2":
        return request.getfixturevalue("tokenizer"), request.getfixturevalue("hf_tokenizer")
    return request.getfixturevalue("llama_style_tokenizer"), request.getfixturevalue("hf_llama_style")
