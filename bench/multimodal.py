"""Image prompts: offline throughput of a batch of image + text prompts against transformers' LLaVA.

The model is a LLaVA built here once (cached beside the embedded model): SmolLM2-135M-Instruct's decoder behind a
CLIP ViT-B/16 vision tower at 224x224 pixels (196 image tokens an image) and a projector, both randomly initialised
(no LLaVA checkpoint of that size ships; the work per image is a real ViT-B/16's). Its image token is SmolLM2's
``<empty_output>``.

``--prompts`` prompts, each with its own image (sizes vary, so each is resized and cropped), ask for
``--max-tokens`` tokens each (ignore_eos). Spindle gets them as PNG bytes through ``LLM.generate`` (decoding and
preprocessing included); transformers' ``LlavaForConditionalGeneration.generate`` gets one left-padded batch of the
same expanded token ids and its own ``CLIPImageProcessor``'s pixels (preprocessing excluded). Then Spindle runs the
same prompts again, finding the images' blocks in its prefix cache. Prints output tokens per second (medians of
``--repeats``) and the ratios.

    .venv/bin/python -m bench.multimodal
"""

import argparse
import io
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import transformers
from PIL import Image

from spindle import LLM, SamplingParams
from spindle.backend.models.loader import cache_root, resolve_dtype, resolve_model
from spindle.frontend.processing.tokenizer import Tokenizer

IMAGE_TOKEN = "<empty_output>"
IMAGE_SIZE, PATCH_SIZE = 224, 16
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
PROMPT = (
    f"<|im_start|>user\nRun {{run}}. {IMAGE_TOKEN}\nDescribe the picture in detail.<|im_end|>\n<|im_start|>assistant\n"
)


def llava_dir() -> Path:
    """The benchmark's LLaVA checkpoint: built on first use from the embedded SmolLM2 and a random CLIP tower."""
    path = cache_root() / "bench-llava-smollm2-vitb16"
    if (path / "model.safetensors").is_file():
        return path
    text_dir = resolve_model(None)
    text_config = transformers.LlamaConfig.from_pretrained(text_dir)
    vision_config = transformers.CLIPVisionConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_act="quick_gelu",
    )
    tokenizer = Tokenizer.from_dir(text_dir)
    config = transformers.LlavaConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_index=tokenizer.encode(IMAGE_TOKEN, add_special_tokens=False)[0],
        vision_feature_layer=-2,
        tie_word_embeddings=text_config.tie_word_embeddings,
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    decoder = {
        name.removeprefix("model."): tensor
        for name, tensor in safetensors.torch.load_file(text_dir / "model.safetensors").items()
        if name.startswith("model.")
    }
    model.model.language_model.load_state_dict(decoder)
    scratch = path.with_name(path.name + ".partial")
    model.save_pretrained(scratch)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text_dir / name, scratch / name)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(scratch)
    scratch.rename(path)
    return path


def images(count: int) -> list[Image.Image]:
    """Smooth random pictures of varied sizes (from 160 to 639 pixels a side)."""
    rng = np.random.default_rng(0)
    pictures = []
    for _ in range(count):
        small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        size = tuple(int(s) for s in rng.integers(160, 640, 2))
        pictures.append(Image.fromarray(small).resize(size, Image.Resampling.BILINEAR))
    return pictures


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def spindle_rate(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(out.outputs[0].token_ids) for out in outputs) / elapsed


def transformers_rate(
    model: transformers.LlavaForConditionalGeneration, ids: list[list[int]], pixels: torch.Tensor, max_tokens: int
) -> float:
    width = max(map(len, ids))
    input_ids = torch.tensor([[0] * (width - len(row)) + row for row in ids])  # left padding
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=mask,
            pixel_values=pixels,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(ids) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="auto: what LLM picks on this CPU")
    args = parser.parse_args()
    path = llava_dir()
    dtype = resolve_dtype(args.dtype, "cpu")
    pictures = images(args.prompts)
    encoded = [png(picture) for picture in pictures]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    processor = transformers.CLIPImageProcessor.from_pretrained(path)
    tokenizer = Tokenizer.from_dir(path)
    image_token = model.config.image_token_id
    expanded = []
    for token in tokenizer.encode(PROMPT.format(run=1)):
        expanded += [image_token] * NUM_IMAGE_TOKENS if token == image_token else [token]
    ids = [expanded] * args.prompts
    pixels = processor(pictures, return_tensors="pt")["pixel_values"].to(dtype)
    transformers_rate(model, ids[:2], pixels[:2], 2)  # warm-up
    theirs = statistics.median(transformers_rate(model, ids, pixels, args.max_tokens) for _ in range(args.repeats))
    del model

    llm = LLM(str(path), dtype=str(dtype).removeprefix("torch."), kv_cache_memory="1GiB")
    fresh, cached = [], []
    for repeat in range(args.repeats + 1):
        # Text before the image that differs per repeat: each repeat's first run finds none of its images' blocks
        # cached, its second finds them all (but each prompt's last block).
        prompts = [{"prompt": PROMPT.format(run=repeat), "multi_modal_data": {"image": data}} for data in encoded]
        first = spindle_rate(llm, prompts, params)
        second = spindle_rate(llm, prompts, params)
        if repeat:  # the first repeat warms up
            fresh.append(first)
            cached.append(second)
    ours, ours_cached = statistics.median(fresh), statistics.median(cached)
    llm.shutdown()
    print(
        f"multimodal, {dtype}, threads={torch.get_num_threads()}: {args.prompts} prompts, each one image "
        f"({NUM_IMAGE_TOKENS} image tokens, ViT-B/16 at {IMAGE_SIZE}px) + {len(expanded) - NUM_IMAGE_TOKENS} text "
        f"tokens, {args.max_tokens} output tokens each"
    )
    print(f"  transformers generate (one padded batch)   {theirs:7.1f} tok/s")
    print(f"  spindle, images new to the cache            {ours:7.1f} tok/s  ratio {ours / theirs:4.2f}x")
    print(f"  spindle, same prompts again (prefix cache)  {ours_cached:7.1f} tok/s  ratio {ours_cached / theirs:4.2f}x")
    print(f"  (medians of {args.repeats})")


if __name__ == "__main__":
    main()
