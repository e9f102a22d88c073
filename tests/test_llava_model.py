"""Our LLaVA (CLIP tower, projector, Llama decoder over the paged cache) gives transformers' image features and
logits, loads every checkpoint spelling, and its config reads the decoder from ``text_config``."""

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from conftest import LLAVA_IMAGE_SIZE, LLAVA_IMAGE_TOKENS, compute_as_served
from test_model_parity import run_schedule

from spindle.backend.models import SUPPORTED_ARCHITECTURES, CheckpointConfig, load_model, model_class
from spindle.backend.models.llava import LlavaForConditionalGeneration
from spindle.backend.models.loader import quantized_weights
from spindle.backend.worker import check_tensor_parallel
from spindle.kernels.linear import MAX_QUANTIZED_TOKENS, weight_only
from spindle.shared.config import EngineConfig
from spindle.shared.model_registry import ModelRegistry

ARCHITECTURE = "LlavaForConditionalGeneration"
IMAGE_TOKEN = 256
IMAGE_START = 6
"""Position of the first placeholder in the image prompt."""


def pixels(count: int, seed: int = 0) -> torch.Tensor:
    """Random normalised pixel values ``[count, 3, 28, 28]``, as CLIP's image processor makes them."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 3, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE, generator=generator)


def copy_checkpoint(source: Path, target: Path, config_edits: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of the checkpoint ``source`` in ``target``, its config.json updated and its tensors replaced if given."""
    shutil.copytree(source, target)
    if config_edits:
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(config | config_edits))
    if tensors is not None:
        safetensors.torch.save_file(tensors, target / "model.safetensors", {"format": "pt"})
    return target


def saved_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def llava(tiny_llava_dir: Path) -> LlavaForConditionalGeneration:
    """Our fp32 tiny LLaVA on CPU, prepared as the runner prepares it."""
    model = load_model(tiny_llava_dir, torch.float32, torch.device("cpu"))
    model.prepare_weights()
    return model


@pytest.fixture(scope="module")
def hf_llava(tiny_llava_dir: Path) -> transformers.LlavaForConditionalGeneration:
    return transformers.LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("feature_layer", [-2, [-2, -3]], ids=["layer-2", "layers-2-3"])
@pytest.mark.parametrize("strategy", ["default", "full"])
def test_embed_images_matches_transformers(
    strategy: str, feature_layer: int | list[int], tiny_llava_dir: Path, tmp_path: Path
) -> None:
    edits = {"vision_feature_select_strategy": strategy, "vision_feature_layer": feature_layer}
    tensors = saved_tensors(tiny_llava_dir)
    if isinstance(feature_layer, list):
        # The projector takes the layers' states concatenated: a wider first matrix, drawn afresh.
        generator = torch.Generator().manual_seed(2)
        tensors["multi_modal_projector.linear_1.weight"] = torch.randn(64, 32 * len(feature_layer), generator=generator)
    model_dir = copy_checkpoint(tiny_llava_dir, tmp_path / "variant", edits, tensors)
    ours = load_model(model_dir, torch.float32, torch.device("cpu"))
    ours.prepare_weights()
    theirs = transformers.LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    images = pixels(3)
    with torch.inference_mode():
        expected = theirs.get_image_features(
            images, vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy
        ).pooler_output
        embeds = ours.embed_images(images)
        from_doubles = ours.embed_images(images.double())  # any float dtype: cast to the model's
    assert ours.num_image_tokens == LLAVA_IMAGE_TOKENS + (strategy == "full")
    assert embeds.shape == (3, ours.num_image_tokens, 64) and embeds.dtype == torch.float32
    # Measured max |diff| 0 to 1e-6 (features have std ~0.3): the same fp32 maths.
    torch.testing.assert_close(embeds, torch.stack(list(expected)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(from_doubles, embeds)


def test_embed_images_refuses_other_image_sizes(llava: LlavaForConditionalGeneration) -> None:
    assert llava.image_shape == (3, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE)
    with pytest.raises(ValueError, match=r"are not \[N, 3, 28, 28\]"):
        llava.embed_images(torch.zeros(1, 3, 32, 32))


class WithImages:
    """The LLaVA as :func:`test_model_parity.run_schedule` drives a model, with the image put in each step.

    Every step passes the rows of its placeholders (none in a text-only step: an empty index) and the rows of the
    image's embeddings they stand for: a chunk that starts or ends inside the image takes its part of it.
    """

    def __init__(self, model: LlavaForConditionalGeneration, image_embeds: torch.Tensor) -> None:
        self.model = model
        self.config = model.config
        self.embed_tokens = model.language_model.embed_tokens
        self.image_embeds = image_embeds
        self.image_row_counts: list[int] = []

    def __call__(self, input_ids, positions, meta, kv_caches) -> torch.Tensor:  # noqa: ANN001 - PagedRunner's call
        rows = (input_ids == self.model.image_token_id).nonzero().squeeze(1)
        self.image_row_counts.append(len(rows))
        # Only the image prompt holds placeholders, so a placeholder's position tells which image row it is.
        embeds = self.image_embeds[positions[rows] - IMAGE_START]
        return self.model(input_ids, positions, meta, kv_caches, image_rows=rows, image_embeds=embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def llava_prompts() -> list[list[int]]:
    """An image prompt (text, 16 placeholders at :data:`IMAGE_START`, text: 29 tokens) and a text-only one (11)."""
    generator = torch.Generator().manual_seed(3)
    text = torch.randint(3, 256, (18,), generator=generator).tolist()
    image_prompt = [1, *text[: IMAGE_START - 1], *[IMAGE_TOKEN] * LLAVA_IMAGE_TOKENS, *text[IMAGE_START - 1 : 12]]
    return [image_prompt, [1, *text[8:18]]]


LLAVA_SCHEDULES = {
    "one_batch": [[(0, 29), (1, 11)]],
    # Chunk boundaries at positions 10 and 19, both inside the image (positions 6-21).
    "chunks_inside_image": [[(0, 10), (1, 6)], [(0, 9), (1, 5)], [(0, 10)]],
    "chunk_then_decode": [[(0, 14), (1, 11)], [(0, 12)], [(0, 1)], [(0, 1)], [(0, 1)]],
}


@pytest.mark.parametrize("schedule", LLAVA_SCHEDULES)
def test_logits_with_an_image_match_transformers(
    schedule: str, llava: LlavaForConditionalGeneration, hf_llava: transformers.LlavaForConditionalGeneration
) -> None:
    prompts = llava_prompts()
    assert len(prompts[0]) == 29 and prompts[0][IMAGE_START : IMAGE_START + LLAVA_IMAGE_TOKENS] == [IMAGE_TOKEN] * 16
    image = pixels(1, seed=4)
    with torch.inference_mode():
        expected = [
            hf_llava(input_ids=torch.tensor([prompts[0]]), pixel_values=image).logits[0],
            hf_llava(input_ids=torch.tensor([prompts[1]])).logits[0],
        ]
        model = WithImages(llava, llava.embed_images(image)[0])
    ours = run_schedule(model, prompts, LLAVA_SCHEDULES[schedule])
    assert sum(model.image_row_counts) == LLAVA_IMAGE_TOKENS
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The image matters: the same prompt with the placeholders' own embeddings gives other logits after it.
    placeholder = llava.language_model.embed_tokens[IMAGE_TOKEN].expand(LLAVA_IMAGE_TOKENS, -1)
    plain = run_schedule(WithImages(llava, placeholder), prompts, LLAVA_SCHEDULES["one_batch"])
    assert (plain[0][IMAGE_START:] - expected[0][IMAGE_START:]).abs().max() > 0.1


def renamed(tensors: dict[str, torch.Tensor], spelling: str) -> dict[str, torch.Tensor]:
    """The tiny LLaVA's tensors (transformers 5's saved names) in another spelling."""

    def rename(name: str) -> str:
        if spelling == "llava_hf":  # llava-hf's repositories: CLIPVisionModel's vision_model level kept
            return name.replace("vision_tower.", "vision_tower.vision_model.", 1)
        # transformers' in-memory names: model.{vision_tower,multi_modal_projector,language_model}, lm_head outside
        if name == "language_model.lm_head.weight":
            return "lm_head.weight"
        return "model." + name.replace("language_model.model.", "language_model.", 1)

    return {rename(name): tensor for name, tensor in tensors.items()}


@pytest.mark.parametrize("spelling", ["llava_hf", "in_memory"])
def test_every_checkpoint_spelling_loads(spelling: str, tiny_llava_dir: Path, tmp_path: Path) -> None:
    tensors = renamed(saved_tensors(tiny_llava_dir), spelling)
    assert any(
        name.startswith("vision_tower.vision_model." if spelling == "llava_hf" else "model.") for name in tensors
    )
    model = load_model(copy_checkpoint(tiny_llava_dir, tmp_path / spelling, tensors=tensors), torch.float32, "cpu")
    reference = dict(load_model(tiny_llava_dir, torch.float32, torch.device("cpu")).named_parameters())
    assert {name for name, _ in model.named_parameters()} == set(reference)
    for name, param in model.named_parameters():
        assert torch.equal(param, reference[name]), name


@pytest.mark.parametrize(
    "drop",
    [
        "vision_tower.encoder.layers.0.self_attn.k_proj.bias",
        "vision_tower.embeddings.class_embedding",
        "multi_modal_projector.linear_2.weight",
        "language_model.model.layers.1.self_attn.k_proj.weight",
    ],
)
def test_load_weights_refuses_a_missing_tensor(drop: str, tiny_llava_dir: Path) -> None:
    model = LlavaForConditionalGeneration(CheckpointConfig.from_dir(tiny_llava_dir), torch.float32)
    with pytest.raises(ValueError, match="unloaded"):
        model.load_weights((k, v) for k, v in saved_tensors(tiny_llava_dir).items() if k != drop)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("vision_tower.encoder.layers.0.mlp.extra.weight", "no part of a CLIP"),
        ("vision_tower.encoder.layers.3.mlp.fc1.weight", "no part of a CLIP"),  # the tower has layers 0-2
        ("multi_modal_projector.linear_3.weight", "no part of a LLaVA"),
        ("image_newline", "no part of a LLaVA"),
        ("language_model.model.layers.0.mlp.extra.weight", "does not fit"),
        ("vision_tower.embeddings.class_embedding", "does not fit"),  # a known name of the wrong shape
    ],
)
def test_load_weights_refuses_unknown_tensors(extra: str, message: str, tiny_llava_dir: Path) -> None:
    model = LlavaForConditionalGeneration(CheckpointConfig.from_dir(tiny_llava_dir), torch.float32)
    tensors = saved_tensors(tiny_llava_dir)
    tensors.pop(extra, None)
    with pytest.raises(ValueError, match=message):
        model.load_weights([*tensors.items(), (extra, torch.zeros(2))])


def test_registry_and_config_read_a_llava(tiny_llava_dir: Path) -> None:
    assert ModelRegistry.get_model_cls_target(ARCHITECTURE) == "spindle.backend.models.llava:" + ARCHITECTURE
    assert model_class(ARCHITECTURE) is LlavaForConditionalGeneration
    assert ARCHITECTURE not in SUPPORTED_ARCHITECTURES  # GGUF files are converted for the Llama family only
    config = CheckpointConfig.from_dir(tiny_llava_dir)
    decoder = (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers)
    heads = (config.num_heads, config.num_kv_heads, config.head_dim)
    assert (config.architecture, decoder, heads) == (ARCHITECTURE, (257, 64, 128, 2), (4, 2, 16))
    assert (config.eos_token_ids, config.bos_token_id, config.dtype, config.qkv_bias) == ([2], 1, "float32", False)
    assert config.hf_config["vision_config"]["hidden_size"] == 32
    model = LlavaForConditionalGeneration(config, torch.float32)
    assert (model.supports_images, model.supports_tensor_parallel) == (True, False)
    assert (model.image_token_id, model.num_image_tokens, model.image_shape) == (256, 16, (3, 28, 28))
    # The vision tower stops at the feature layer -2 of 3: two layers built, no post_layernorm.
    assert len(model.vision_tower.layers) == 2
    assert not any("post_layernorm" in name for name, _ in model.named_parameters())


def test_config_fills_what_a_sparse_text_config_omits() -> None:
    """llava-hf/llava-1.5-7b-hf's config.json writes only the text fields that differ from LlamaConfig's defaults."""
    llava_15 = {
        "architectures": [ARCHITECTURE],
        "image_token_index": 32000,
        "text_config": {
            "model_type": "llama",
            "vocab_size": 32064,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vision_config": {"hidden_size": 1024, "image_size": 336, "num_hidden_layers": 24, "patch_size": 14},
    }
    config = CheckpointConfig.from_dict(llava_15, {"eos_token_id": 2})
    fields = (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers, config.num_kv_heads)
    assert fields == (32064, 4096, 11008, 32, 32)
    assert (config.head_dim, config.rms_norm_eps, config.max_position_embeddings) == (128, 1e-5, 4096)
    assert (config.tie_word_embeddings, config.eos_token_ids, config.dtype) == (False, [2], "float16")
    # A field the text config lacks comes from the top level; the text config's own wins.
    assert CheckpointConfig.from_dict(llava_15 | {"tie_word_embeddings": True}).tie_word_embeddings
    qwen = llava_15 | {"text_config": {"model_type": "qwen2", "num_key_value_heads": 4}}
    config = CheckpointConfig.from_dict(qwen)
    assert (config.qkv_bias, config.vocab_size, config.num_kv_heads) == (True, 151936, 4)
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    gemma = CheckpointConfig.from_dict(
        llava_15 | {"text_config": {**llava_15["text_config"], **sizes, "model_type": "gemma"}}
    )
    with pytest.raises(ValueError, match="decoder is a 'gemma' model; Spindle's LLaVA runs llama, mistral, qwen2"):
        LlavaForConditionalGeneration(gemma, torch.float32)
    siglip = CheckpointConfig.from_dict(llava_15 | {"vision_config": {"model_type": "siglip_vision_model"}})
    with pytest.raises(ValueError, match="vision tower is a 'siglip_vision_model' model"):
        LlavaForConditionalGeneration(siglip, torch.float32)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_applies_to_the_decoder(
    bits: int, tiny_llava_dir: Path, llava: LlavaForConditionalGeneration, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--quantization`` quantizes the decoder's projections (the vision side stays as it was), as for a Llama.

    With every call on the quantized kernels, the logits are those of the dequantized decoder weights run dense. The
    activations stay float (``weight_only``): quantized ones (the CPU default) make the logits move by a level's
    worth where a float32 summation difference between the two sides crosses an int8 rounding boundary, which these
    tight bounds would read as a failure (the kernels' own tests hold them to their references).
    """
    for key in MAX_QUANTIZED_TOKENS:
        monkeypatch.setitem(MAX_QUANTIZED_TOKENS, key, 10**9)
    model = load_model(tiny_llava_dir, torch.float32, torch.device("cpu"))
    weights = quantized_weights(model, tiny_llava_dir, bits)
    assert set(weights) == set(llava.projections()) and all(name.startswith(("layers.", "lm_head")) for name in weights)
    assert weights["lm_head"].bits == 8 and weights["layers.0.down_proj"].bits == bits
    with weight_only():
        model.prepare_weights(weights)
    dequantized = load_model(tiny_llava_dir, torch.float32, torch.device("cpu"))
    compute_as_served(dequantized, model, weights)
    prompts = llava_prompts()
    with torch.inference_mode():
        image = llava.embed_images(pixels(1, seed=4))[0]
        torch.testing.assert_close(model.embed_images(pixels(1, seed=4))[0], image)  # the vision side is untouched
        ours = run_schedule(WithImages(model, image), prompts, LLAVA_SCHEDULES["chunks_inside_image"])
        expected = run_schedule(WithImages(dequantized, image), prompts, LLAVA_SCHEDULES["chunks_inside_image"])
        unquantized = run_schedule(WithImages(llava, image), prompts, LLAVA_SCHEDULES["chunks_inside_image"])
    for got, want, full in zip(ours, expected, unquantized, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert (got - full).abs().max() > 1e-3  # the quantized weights did run


def test_tensor_parallel_is_refused_at_start_up(tiny_llava_dir: Path) -> None:
    config = EngineConfig.of(model=str(tiny_llava_dir), tensor_parallel_size=2)
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2: the class serving {ARCHITECTURE} does not shard"):
        check_tensor_parallel(config, CheckpointConfig.from_dir(tiny_llava_dir))


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))],
)
def test_bfloat16_images_stay_close_to_float32(device: str, tiny_llava_dir: Path, llava):  # noqa: ANN001
    model = load_model(tiny_llava_dir, torch.bfloat16, torch.device(device))
    model.prepare_weights()
    images = pixels(2, seed=5)
    with torch.inference_mode():
        embeds = model.embed_images(images)
        reference = llava.embed_images(images)
    assert embeds.dtype == torch.bfloat16 and embeds.device.type == device
    torch.testing.assert_close(embeds.float().cpu(), reference, atol=0.05, rtol=0.05)
