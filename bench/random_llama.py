"""Write a Llama-family checkpoint of random weights, for benchmarks on hardware where no real checkpoint is at hand.

The shapes are a real model's (``--config llama3-8b``: 32 layers, hidden 4096, 32 query and 8 KV heads of 128,
MLP 14336), the weights normal with a small standard deviation (bf16 safetensors, one shard), and the tokenizer is
the embedded SmolLM2's, so the vocabulary is its 49,152 tokens rather than Llama-3's 128,256: the lm head is smaller
than the real model's, everything else is the same work. ``--config small`` writes a ~125M-parameter model whose
heads tensor parallel 2 and 4 divide; ``--config tiny`` writes a two-layer model in a second, to
try the script anywhere. The weights are drawn on the GPU when there is one (16 GB for the 8B shapes)::

    python -m bench.random_llama /tmp/llama3-8b-random --config llama3-8b
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from spindle.backend.models.loader import resolve_model

CONFIGS = {
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
    ),
    # ~125M parameters (untied lm head), 8 query and 4 KV heads: tensor parallel 2 and 4 divide it (bench.scale).
    "small": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=4
    ),
    "tiny": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def write(out_dir: Path, name: str) -> None:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files of a random ``name`` model."""
    shapes = CONFIGS[name]
    smollm2 = resolve_model(None)
    vocab = json.loads((smollm2 / "config.json").read_text())["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        **shapes,
    }
    hidden, inter = shapes["hidden_size"], shapes["intermediate_size"]
    head = hidden // shapes["num_attention_heads"]
    kv = shapes["num_key_value_heads"] * head
    per_layer = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "lm_head.weight": normal(vocab, hidden)}
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    for layer in range(shapes["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors |= {prefix + part: normal(*shape) for part, shape in per_layer.items()}
        tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", {"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for file in TOKENIZER_FILES:
        if (smollm2 / file).is_file():
            shutil.copyfile(smollm2 / file, out_dir / file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--config", choices=CONFIGS, default="llama3-8b")
    args = parser.parse_args()
    write(args.out_dir, args.config)
    print(f"wrote a random {args.config} checkpoint to {args.out_dir}")


if __name__ == "__main__":
    main()
