"""bench/random_llama.py's Llama-2-style tokenizer, the one llama.cpp's convert script takes for the K-quant bench.

``convert_hf_to_gguf.py`` reads a Hugging Face tokenizer of this kind with ``gguf``'s ``LlamaHfVocab`` (the same
class in the ``gguf`` package as in llama.cpp's tree); the llama.cpp build itself is not needed here.
"""

import importlib.util
from pathlib import Path

import pytest
from gguf import TokenType
from gguf.vocab import LlamaHfVocab
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("random_llama", REPO / "bench" / "random_llama.py")
random_llama = importlib.util.module_from_spec(spec)
spec.loader.exec_module(random_llama)


@pytest.mark.parametrize("vocab_size", [1024, 32000])
def test_byte_fallback_tokenizer(tmp_path: Path, vocab_size: int) -> None:
    bos, eos = random_llama.write_byte_fallback_tokenizer(tmp_path, vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (bos, eos)
    text = "Hello wörld, 1+1=2 \U0001f999"  # ASCII pieces, and bytes outside the vocabulary (ö, the emoji)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[-4:]) == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert tokenizer.decode(ids) == text
    # Every id decodes to a text, the padding pieces included, as a random model samples any of them.
    assert tokenizer.decode([vocab_size - 1]).isalpha()

    vocab = LlamaHfVocab(tmp_path)
    types = [token_type for _, _, token_type in vocab.all_tokens()]
    assert len(types) == vocab_size
    assert types.count(TokenType.BYTE) == 256 and types.count(TokenType.CONTROL) == 3
