"""Gemma 2 and Gemma 3 (text) against transformers: Gemma 3's two rope tables, and prompts of several windows.

Greedy tokens in one batch with chunked prefill, the prefix-cache rerun, LoRA against PEFT, TP=2 and the Triton path
are checked by tests/test_model_families.py, and the logits over every schedule by tests/test_model_parity.py, both
parametrized over the ``gemma2`` and ``gemma3`` tiny checkpoints (a sliding layer then a global one, window 8).
"""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from test_lora import generate, tiny_core
from test_model_families import hf_greedy
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from spindle.backend.models import CheckpointConfig
from spindle.backend.models.gemma import Gemma3ForCausalLM


def test_gemma3_rope_tables_match_transformers_in_both_layouts(make_tiny_model: Callable[[str], Path]) -> None:
    """The published (v4) configs keep the global rope at the top level and the local base in
    ``rope_local_base_freq``; v5 saves one ``rope_parameters`` entry per layer type. Read either way, the global
    table (linear factor 8, base 1e6) and the local one (base 1e4) hold transformers' cos and sin."""
    model_dir = make_tiny_model("gemma3")
    v5 = json.loads((model_dir / "config.json").read_text())
    ropes = v5["rope_parameters"]
    v4 = {key: value for key, value in v5.items() if key not in ("rope_parameters", "layer_types")}
    v4 |= {
        "rope_theta": ropes["full_attention"]["rope_theta"],
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": ropes["sliding_attention"]["rope_theta"],
        "sliding_window_pattern": 2,
    }
    assert CheckpointConfig.from_dict(v4) == CheckpointConfig.from_dict(v5)
    config = CheckpointConfig.from_dict(v4)
    assert (config.layer_windows, config.rope_theta, config.rope_scaling) == (
        [8, None],
        1e6,
        {"rope_type": "linear", "factor": 8.0},
    )
    rotary = Gemma3RotaryEmbedding(transformers.AutoConfig.from_pretrained(model_dir))
    positions = torch.arange(config.max_position_embeddings)[None]
    for layout in (v4, v5):
        tables = Gemma3ForCausalLM(CheckpointConfig.from_dict(layout), torch.float32).cos_sin_cache
        for table, layer_type in zip(tables, ("full_attention", "sliding_attention"), strict=True):
            cos, sin = rotary(torch.zeros(1), positions, layer_type)
            half = config.head_dim // 2
            torch.testing.assert_close(table, torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1))


@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_prompts_of_several_windows_in_small_chunks_match_transformers(
    variant: str, make_tiny_model: Callable[[str], Path]
) -> None:
    """Prompts of 3 to 5 windows prefilled 6 tokens a step (each chunk attends into the previous ones' keys on the
    sliding layer, over all of them on the global one), then decoded past another window: transformers' eager
    attention, with its sliding mask and soft-capped scores, picks the same tokens."""
    model_dir = make_tiny_model(variant)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (40, 27)]
    core = tiny_core(model_dir, max_num_batched_tokens=6)

    got, _ = generate(core, [(ids, None) for ids in prompts])

    assert got == hf_greedy(model_dir, prompts, attn_implementation="eager")
