"""The frontend's image processor: transformers' CLIP preprocessing with PIL and numpy, its token count and limits."""

import io
import json
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import LLAVA_IMAGE_SIZE, LLAVA_IMAGE_TOKENS, LLAVA_PATCH_SIZE
from PIL import Image
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from spindle.frontend.processing import image_processor
from spindle.frontend.processing.image_processor import MAX_IMAGE_BYTES, ImageProcessor
from spindle.shared.errors import InvalidRequestError

MODEL_FILES = ("config.json", "preprocessor_config.json")


def model_files(model_dir: Path) -> dict[str, bytes]:
    """The files the backend's handshake carries that the image processor reads."""
    return {name: (model_dir / name).read_bytes() for name in MODEL_FILES if (model_dir / name).is_file()}


def with_json(files: dict[str, bytes], name: str, **changes: object) -> dict[str, bytes]:
    """``files`` with the JSON file ``name`` updated by ``changes`` (a dict value updates the nested dict)."""
    content = json.loads(files[name])
    for key, value in changes.items():
        content[key] = {**content[key], **value} if isinstance(value, dict) and key in content else value
    return {**files, name: json.dumps(content).encode()}


@pytest.fixture(scope="module")
def llava_files(tiny_llava_dir) -> dict[str, bytes]:
    return model_files(tiny_llava_dir)


@pytest.fixture(scope="module")
def processor(llava_files) -> ImageProcessor:
    return ImageProcessor.from_files(llava_files)


def random_image(size: tuple[int, int], mode: str, seed: int = 0) -> Image.Image:
    """A random image of ``size`` (width, height) in ``mode``; ``"P+transparency"`` is a palette with a clear color."""
    rgba = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 4), dtype=np.uint8)
    image = Image.fromarray(rgba, "RGBA")
    if mode == "P+transparency":
        image = image.convert("RGB").convert("P")
        image.info["transparency"] = 0
        return image
    return image.convert(mode)


def encode(image: Image.Image, format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return buffer.getvalue()


def png_header(width: int, height: int) -> bytes:
    """The start of a PNG of ``width`` x ``height`` RGB pixels: its header chunk and the start of a pixel chunk.

    PIL opens it (opening reads up to the pixel data), but loading its pixels fails: they are cut short.
    """

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    pixels = zlib.compress(b"\0" * 1000)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", pixels)
    )


SIZES = [(28, 28), (10, 13), (90, 50), (50, 90), (29, 31), (300, 17), (17, 300)]
MODES = ["RGB", "RGBA", "L", "LA", "P", "P+transparency", "I;16"]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", MODES)
def test_preprocessing_matches_transformers_clip_processor(tiny_llava_dir, processor, size, mode):
    image = random_image(size, mode)
    expected = CLIPImageProcessorPil.from_pretrained(tiny_llava_dir)(image, return_tensors="np")["pixel_values"][0]
    pixels = processor.preprocess(image)
    assert pixels.dtype == np.float32 and pixels.shape == (3, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE)
    np.testing.assert_allclose(pixels, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["hwc", "chw", "gray", "batch-of-one"], ids=lambda layout: layout.replace("-", " "))
def test_raw_pixel_arrays_are_preprocessed_as_transformers_does(tiny_llava_dir, processor, layout):
    """uint8 arrays (a CPU torch tensor alike) are raw images: the same pixels as the PIL image they hold."""
    torch = pytest.importorskip("torch")
    image = random_image((50, 90), "L" if layout == "gray" else "RGB")
    array = np.asarray(image)
    array = {"chw": np.moveaxis(array, -1, 0), "batch-of-one": array[None]}.get(layout, array)
    reference = image if layout == "gray" else array  # transformers takes no 2-D array as one image
    expected = CLIPImageProcessorPil.from_pretrained(tiny_llava_dir)(reference, return_tensors="np")["pixel_values"][0]
    for given in (array, torch.from_numpy(array.copy())):  # a copy: torch warns of read-only arrays
        np.testing.assert_allclose(processor.preprocess(given), expected, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(processor.preprocess(array), processor.preprocess(image))


def test_preprocessed_pixels_are_taken_as_they_are(tiny_llava_dir, processor):
    """Floating-point arrays are the model's input already (transformers' pixel_values), with or without the batch
    dimension of one image, as numpy or torch, in any float dtype numpy has."""
    torch = pytest.importorskip("torch")
    processed = CLIPImageProcessorPil.from_pretrained(tiny_llava_dir)(
        random_image((40, 60), "RGB"), return_tensors="pt"
    )
    pixel_values = processed["pixel_values"]  # [1, 3, 28, 28] float32
    for given in (pixel_values, pixel_values[0], pixel_values.double().numpy(), pixel_values[0].half()):
        pixels = processor.preprocess(given)
        assert pixels.dtype == np.float32 and pixels.flags.c_contiguous
        np.testing.assert_array_equal(pixels, torch.as_tensor(given).float().reshape(3, 28, 28).numpy())
    # numpy has no bfloat16, and the frontend does not import torch to convert it.
    refused(processor, pixel_values.bfloat16(), "does not convert to a numpy array: Got unsupported ScalarType")


@pytest.mark.parametrize(
    "settings",
    [
        {"size": {"height": 28, "width": 28}, "do_center_crop": False, "resample": 2},  # SigLIP-like: squash
        {"size": {"shortest_edge": 40}, "resample": 0, "do_normalize": False},
        {"size": {"shortest_edge": 20}, "do_rescale": False, "image_mean": 0.5, "image_std": 0.25},  # crop pads
        {"do_resize": False, "do_convert_rgb": True, "rescale_factor": 0.5},
    ],
    ids=["exact-size", "nearest-unnormalized", "padded-unrescaled", "no-resize"],
)
@pytest.mark.parametrize("size", [(60, 35), (12, 20)], ids=["wide", "small-tall"])
def test_other_processor_settings_match_transformers(tmp_path, llava_files, settings, size):
    reference = CLIPImageProcessorPil(crop_size={"height": 28, "width": 28}, **settings)
    reference.save_pretrained(tmp_path)
    processor = ImageProcessor.from_files(
        {**llava_files, "preprocessor_config.json": (tmp_path / "preprocessor_config.json").read_bytes()}
    )
    image = random_image(size, "RGBA", seed=1)
    expected = reference(image, return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(processor.preprocess(image), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("format", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_encoded_images_decode_as_pil_opens_them(processor, format):
    data = encode(random_image((40, 30), "RGB"), format)
    np.testing.assert_array_equal(processor.preprocess(data), processor.preprocess(Image.open(io.BytesIO(data))))
    np.testing.assert_array_equal(processor.preprocess(bytearray(data)), processor.preprocess(memoryview(data)))


def test_the_model_config_gives_the_image_token_and_count(processor):
    assert processor.image_token_id == 256
    assert processor.num_image_tokens == LLAVA_IMAGE_TOKENS == (LLAVA_IMAGE_SIZE // LLAVA_PATCH_SIZE) ** 2


@pytest.mark.parametrize(
    "changes,num_image_tokens",
    [
        ({"vision_feature_select_strategy": "full"}, LLAVA_IMAGE_TOKENS + 1),  # the CLS token is kept
        ({"vision_config": {"model_type": "siglip_vision_model"}, "vision_feature_select_strategy": "full"}, 16),
        ({"image_token_index": None, "image_token_id": 7}, LLAVA_IMAGE_TOKENS),
    ],
    ids=["full", "siglip-full", "image_token_id"],
)
def test_the_token_count_follows_the_feature_strategy_and_tower(llava_files, changes, num_image_tokens):
    processor = ImageProcessor.from_files(with_json(llava_files, "config.json", **changes))
    assert processor.num_image_tokens == num_image_tokens


def test_a_text_only_model_has_no_image_processor(tiny_llm_dir):
    assert ImageProcessor.from_files(model_files(tiny_llm_dir)) is None
    assert ImageProcessor.from_files({}) is None


@pytest.mark.parametrize(
    "name,changes,message",
    [
        ("config.json", {"vision_config": {"image_size": 32}}, "makes 28x28 images, but the vision tower takes"),
        ("preprocessor_config.json", {"crop_size": {"height": 28, "width": 30}}, "makes 28x30 images"),
        ("preprocessor_config.json", {"do_center_crop": False}, "leaves the image size to the input"),
        ("preprocessor_config.json", {"size": [28, 28]}, "size [28, 28] is not supported"),
        ("preprocessor_config.json", {"image_mean": [0.5, 0.5]}, "need 3 values (RGB)"),
        ("config.json", {"vision_feature_select_strategy": "cls"}, "unknown vision_feature_select_strategy 'cls'"),
        ("config.json", {"vision_config": {"model_type": "dino"}}, "unsupported vision tower 'dino'"),
        ("config.json", {"image_token_index": None}, "names no image token"),
        ("config.json", {"vision_config": {"patch_size": None}}, "vision_config needs an int patch_size, got None"),
    ],
    ids=["tower-size", "crop-size", "no-crop", "size-form", "mean", "strategy", "tower", "no-token", "no-patch"],
)
def test_a_model_the_processor_cannot_serve_fails_at_start(llava_files, name, changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ImageProcessor.from_files(with_json(llava_files, name, **changes))


def test_a_vision_model_needs_a_preprocessor_config(llava_files):
    with pytest.raises(ValueError, match="has no preprocessor_config.json"):
        ImageProcessor.from_files({"config.json": llava_files["config.json"]})


def refused(processor: ImageProcessor, image: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as error:
        processor.preprocess(image, "prompt.multi_modal_data[2]")
    assert error.value.fields == ("prompt.multi_modal_data[2]",)


@pytest.mark.parametrize(
    "image,message",
    [
        (b"not an image", "prompt.multi_modal_data[2] is not a PNG, JPEG, WEBP, GIF, BMP image"),
        (encode(random_image((8, 8), "RGB"), "TIFF"), "is not a PNG, JPEG, WEBP, GIF, BMP image"),  # not allowed
        (encode(random_image((64, 64), "RGB"))[:200], "is not a decodable PNG image"),  # truncated
        (b"\0" * (MAX_IMAGE_BYTES + 1), f"has {MAX_IMAGE_BYTES + 1} bytes, more than the {MAX_IMAGE_BYTES}"),
        (png_header(8000, 5001), "is 8000x5001 pixels, more than the 40000000"),  # refused before the pixels
        (png_header(20000, 20000), "more than the 40000000 (40 megapixels)"),  # PIL's decompression-bomb error
        # 60,000 pixels that a shortest edge of 28 would resize to 47 megapixels: refused before the resize
        (encode(Image.new("RGB", (1, 60000))), "is 1x60000 pixels, which this model resizes to 28x1680000, more than"),
        (encode(Image.new("RGB", (60000, 1))), "is 60000x1 pixels, which this model resizes to 1680000x28, more than"),
        ("cat.png", "must be a PIL image, encoded image bytes or a pixel array, not str"),
        (np.zeros((3, 20, 20)), "a float array of shape [3, 20, 20]: preprocessed pixels must be [3, 28x28]"),
        (np.zeros((28, 28)), "a float array of shape [28, 28]: preprocessed pixels must be [3, 28x28]"),
        (np.full((3, 28, 28), np.nan, dtype=np.float32), "has pixel values that are not finite"),
        (np.zeros((2, 3, 28, 28), dtype=np.float32), "is an array of shape [2, 3, 28, 28]: an image is 2 or 3"),
        (np.zeros((28, 28, 3), dtype=np.int64), "is an array of int64: raw pixels are uint8"),
        (np.zeros((28, 28, 5), dtype=np.uint8), "a uint8 array of shape [28, 28, 5]: raw pixels have 1, 3 or 4"),
    ],
    ids=[
        "garbage",
        "tiff",
        "truncated",
        "too-many-bytes",
        "too-many-pixels",
        "bomb",
        "too-tall-once-resized",
        "too-wide-once-resized",
        "str",
        "float-of-another-size",
        "float-without-channels",
        "float-nan",
        "batch-of-two",
        "int64",
        "five-channels",
    ],
)
def test_undecodable_oversized_or_mistyped_images_are_refused_naming_the_field(processor, image, message):
    refused(processor, image, message)


def test_a_header_within_the_pixel_limit_is_decoded(processor):
    refused(processor, png_header(100, 100), "is not a decodable PNG image")  # what the too-many-pixels case skips


def test_a_pil_image_over_the_pixel_limit_is_refused(processor, monkeypatch):
    monkeypatch.setattr(image_processor, "MAX_IMAGE_PIXELS", 28 * 28)
    processor.preprocess(random_image((28, 28), "RGB"))
    refused(processor, random_image((28, 29), "RGB"), "is 28x29 pixels, more than the 784")


def test_without_rgb_conversion_images_must_be_rgb(tiny_llava_dir, llava_files):
    processor = ImageProcessor.from_files(with_json(llava_files, "preprocessor_config.json", do_convert_rgb=False))
    reference = CLIPImageProcessorPil.from_pretrained(tiny_llava_dir, do_convert_rgb=False)
    image = random_image((30, 40), "RGB")
    expected = reference(image, return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(processor.preprocess(image), expected, atol=1e-5, rtol=0)
    refused(processor, random_image((30, 40), "L"), "is a L image, but this model's image processor does not convert")
