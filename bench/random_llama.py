"""Write a Llama-family checkpoint of random weights, for benchmarks on hardware where no real checkpoint is at hand.

The shapes are a real model's (``--config llama3-8b``: 32 layers, hidden 4096, 32 query and 8 KV heads of 128,
MLP 14336, Llama-3's vocabulary of 128,256), the weights normal with a small standard deviation (bf16 safetensors,
one shard). The tokenizer is made here, so nothing beyond ``tokenizers`` is needed (a machine without the embedded
SmolLM2's package can write it): byte-level, every text encodes byte by byte, and the rest of the vocabulary is
padding pieces that decode to their bytes, so that every token the random model samples has a text.
``--config small`` writes a ~125M-parameter model (SmolLM2's vocabulary size, 49,152) whose heads tensor parallel 2
and 4 divide; ``--config medium`` a ~0.5B-parameter one of Llama 2's vocabulary size (32,000), quantized by
``bench.kquant_vs_llamacpp``; ``--config moe`` a Mixtral of the same vocabulary (~0.4B parameters, 8 experts of
which each token takes 2, ~0.13B active), in the per-expert tensors llama.cpp's converter reads; ``--config tiny``
writes a two-layer model in a second, to try a script anywhere.

``--tokenizer byte-fallback`` writes Llama 2's kind of tokenizer instead (a BPE over characters whose other bytes fall
back to byte pieces): llama.cpp's ``convert_hf_to_gguf.py`` converts it, where it refuses the byte-level one, whose
pre-tokenizer is none of the real models' it recognizes.

The weights are drawn on the device (CUDA when there is one) one tensor at a time and streamed into the file behind
a header computed from the shapes, so the host never holds the whole model (16 GB for the 8B shapes)::

    python -m bench.random_llama /tmp/llama3-8b-random --config llama3-8b
"""

import argparse
import itertools
import json
import struct
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

CONFIGS = {
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    # ~125M parameters (untied lm head), 8 query and 4 KV heads: tensor parallel 2 and 4 divide it (bench.scale).
    "small": dict(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    # ~0.5B parameters (501M, untied lm head), heads of 128; every row a multiple of 256, as K-quant blocks need.
    "medium": dict(
        vocab_size=32000,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
    # A Mixtral: 8 experts of 1536, top-2, 8 layers of hidden 1024 (heads of 128); rows multiples of 256 as well.
    "moe": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "tiny": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
BOS, EOS, UNK = "<s>", "</s>", "<unk>"


def write_tokenizer(out_dir: Path, vocab_size: int) -> tuple[int, int]:
    """Write a byte-level tokenizer of ``vocab_size`` tokens into ``out_dir``; returns its (bos, eos) ids.

    Ids 0-255 are the bytes, then bos and eos, then padding pieces of two and three byte characters. There are no
    merges, so encoding never produces a padding piece, but each one decodes to its bytes.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    padding = ("".join(chars) for n in (2, 3) for chars in itertools.product(alphabet, repeat=n))
    pieces = [*alphabet, BOS, EOS, *itertools.islice(padding, vocab_size - len(alphabet) - 2)]
    tokenizer = Tokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(pieces)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return len(alphabet), len(alphabet) + 1


def write_byte_fallback_tokenizer(out_dir: Path, vocab_size: int) -> tuple[int, int]:
    """Write a Llama-2-style tokenizer of ``vocab_size`` tokens into ``out_dir``; returns its (bos, eos) ids.

    Ids 0-2 are unk, bos and eos, 3-258 the byte pieces ``<0x00>``-``<0xFF>``, then the word-start mark and the
    printable ASCII characters, then padding pieces of two to four letters. There are no merges: ASCII text
    encodes character by character, any other byte as its byte piece, and every piece decodes to its text.
    """
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    padding = ("".join(chars) for n in (2, 3, 4) for chars in itertools.product(letters, repeat=n))
    pieces = [UNK, BOS, EOS, *(f"<0x{b:02X}>" for b in range(256)), "\u2581", *map(chr, range(0x21, 0x7F))]
    pieces += itertools.islice(padding, vocab_size - len(pieces))
    model = models.BPE(vocab={piece: i for i, piece in enumerate(pieces)}, merges=[], unk_token=UNK, byte_fallback=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens([UNK, BOS, EOS])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return 1, 2


TOKENIZERS = {"byte-level": write_tokenizer, "byte-fallback": write_byte_fallback_tokenizer}
"""``--tokenizer`` names and their writers."""


def tensor_shapes(shapes: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama checkpoint of ``shapes`` and its shape, in the file's order.

    With ``num_local_experts``, a Mixtral's: each layer's MLP is a router and that many experts (``w1`` gate, ``w3``
    up, ``w2`` down).
    """
    hidden, inter, vocab = shapes["hidden_size"], shapes["intermediate_size"], shapes["vocab_size"]
    kv = shapes["num_key_value_heads"] * hidden // shapes["num_attention_heads"]
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "post_attention_layernorm.weight": (hidden,),
    }
    experts = shapes.get("num_local_experts")
    if experts is None:
        per_layer |= {
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        }
    else:
        per_layer["block_sparse_moe.gate.weight"] = (experts, hidden)
        for e in range(experts):
            prefix = f"block_sparse_moe.experts.{e}"
            per_layer |= {f"{prefix}.w1.weight": (inter, hidden), f"{prefix}.w2.weight": (hidden, inter)}
            per_layer[f"{prefix}.w3.weight"] = (inter, hidden)
    tensors = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(shapes["num_hidden_layers"]):
        tensors |= {f"model.layers.{layer}.{part}": shape for part, shape in per_layer.items()}
    return tensors | {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}


def write_weights(path: Path, tensors: dict[str, tuple[int, ...]], device: torch.device) -> None:
    """Stream random bf16 ``tensors`` into a safetensors file at ``path``: norms ones, the rest N(0, 0.02)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        size = 2 * torch.Size(shape).numel()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    generator = torch.Generator(device).manual_seed(0)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, shape in tensors.items():
            if name.endswith("norm.weight"):
                weight = torch.ones(shape, dtype=torch.bfloat16)
            else:
                weight = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16).mul_(0.02)
            f.write(weight.cpu().view(torch.int16).numpy().data)


def write(out_dir: Path, name: str, device: str | None = None, tokenizer: str = "byte-level") -> None:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files of a random ``name`` model.

    ``device`` draws the weights (default: CUDA when there is one, else the CPU); ``tokenizer`` names the
    tokenizer's kind (:data:`TOKENIZERS`).
    """
    shapes = CONFIGS[name]
    out_dir.mkdir(parents=True, exist_ok=True)
    bos, eos = TOKENIZERS[tokenizer](out_dir, shapes["vocab_size"])
    moe = "num_local_experts" in shapes
    config = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
        **shapes,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    write_weights(out_dir / "model.safetensors", tensor_shapes(shapes), device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--config", choices=CONFIGS, default="llama3-8b")
    parser.add_argument("--device", help="where the weights are drawn (default: cuda when available, else cpu)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="byte-level")
    args = parser.parse_args()
    start = time.perf_counter()
    write(args.out_dir, args.config, args.device, args.tokenizer)
    size = (args.out_dir / "model.safetensors").stat().st_size
    print(
        f"wrote a random {args.config} checkpoint ({size / 1e9:.2f} GB) to {args.out_dir} in "
        f"{time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
