"""Decodes and preprocesses a vision-language model's images with PIL and numpy, as transformers' CLIP processor does.

The frontend must not import torch or transformers, so this module reads the model's ``config.json`` (the image
token and the vision tower's input size) and ``preprocessor_config.json`` (a CLIP-style image processor's fields)
itself, and reproduces what transformers' ``CLIPImageProcessor`` (its PIL backend) does with an image: convert to
RGB, resize, center-crop, rescale and normalize, to a ``[3, height, width]`` float32 array.
"""

import io
import json
import math
from typing import Any

import numpy as np
from PIL import Image

from spindle.shared.errors import InvalidRequestError

MAX_IMAGE_BYTES = 20 * 2**20
"""The most bytes an encoded image may have (20 MiB)."""

MAX_IMAGE_PIXELS = 40_000_000
"""The most pixels an image may have (40 megapixels), checked before its pixels are decoded, and again for the size
it is resized to, before it is resized (a 1x6000 image resized to a shortest edge of 224 would have 300 megapixels)."""

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""The formats encoded images may be in; PIL tries no other decoder (some run external programs)."""

# transformers' CLIPImageProcessor defaults, for the fields a preprocessor_config.json leaves out.
_CLIP_DEFAULTS: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_resize": True,
    "size": {"shortest_edge": 224},
    "resample": Image.Resampling.BICUBIC,
    "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}

# Whether a vision tower's output starts with a CLS token (which the "default" feature strategy drops).
_TOWER_HAS_CLS = {"clip_vision_model": True, "siglip_vision_model": False}


class ImageProcessor:
    """Turns one image into a vision-language model's pixel input, and knows how many tokens stand for it.

    Build it with :meth:`from_files`. Each image of a prompt takes ``num_image_tokens`` placeholder tokens, all
    ``image_token_id``; the model replaces them with the image's embeddings.

    Args:
        image_token_id: the placeholder token's id.
        num_image_tokens: the placeholder tokens per image: one per embedding the vision encoder gives an image.
        convert_rgb: convert images to RGB, compositing transparency onto white; without, images must be RGB.
        resize: the size to resize to: an int is the shortest edge (the aspect ratio kept), a ``(height, width)``
            pair an exact size; ``None`` keeps the size.
        resample: PIL's resampling filter for the resize.
        crop_size: the ``(height, width)`` of the center crop (zero-padded where the image is smaller); ``None``
            crops nothing.
        rescale_factor: what pixel values (0 to 255) are multiplied by; ``None`` leaves them.
        image_mean: the per-channel mean subtracted in normalization; ``None`` normalizes nothing.
        image_std: the per-channel standard deviation divided by in normalization.

    Attributes:
        image_token_id: the placeholder token's id.
        num_image_tokens: the placeholder tokens per image.

    """

    def __init__(
        self,
        image_token_id: int,
        num_image_tokens: int,
        *,
        convert_rgb: bool = True,
        resize: int | tuple[int, int] | None = None,
        resample: Image.Resampling = Image.Resampling.BICUBIC,
        crop_size: tuple[int, int] | None = None,
        rescale_factor: float | None = None,
        image_mean: list[float] | None = None,
        image_std: list[float] | None = None,
    ) -> None:
        self.image_token_id = image_token_id
        self.num_image_tokens = num_image_tokens
        self._convert_rgb = convert_rgb
        self._resize = resize
        self._resample = resample
        self._crop_size = crop_size
        self._rescale_factor = rescale_factor
        # float32, as transformers normalizes float32 pixels with the mean and std cast to their dtype.
        self._mean = None if image_mean is None else np.asarray(image_mean, dtype=np.float32).reshape(-1, 1, 1)
        self._std = None if image_std is None else np.asarray(image_std, dtype=np.float32).reshape(-1, 1, 1)
        # The [height, width] of every preprocessed image (None: whatever the resize leaves).
        self.input_size = crop_size or (resize if isinstance(resize, tuple) else None)

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> "ImageProcessor | None":
        """The image processor of a model from the contents of its files (the backend's handshake carries them).

        Reads ``config.json``: the image token (``image_token_index`` or ``image_token_id``), the vision tower's
        ``image_size``, ``patch_size`` and ``model_type`` in ``vision_config``, and ``vision_feature_select_strategy``
        (``"default"`` drops the tower's CLS token, ``"full"`` keeps it); and ``preprocessor_config.json``: a
        CLIP-style processor's ``do_convert_rgb``, ``do_resize``, ``size`` (``{"shortest_edge"}`` or ``{"height",
        "width"}``), ``resample``, ``do_center_crop``, ``crop_size``, ``do_rescale``, ``rescale_factor``,
        ``do_normalize``, ``image_mean`` and ``image_std``, a field left out taking ``CLIPImageProcessor``'s default.

        Args:
            files: file name to content: ``config.json``, and ``preprocessor_config.json`` for a vision model.

        Returns:
            The processor, or ``None`` for a text-only model (no ``vision_config`` in ``config.json``, or no
            ``config.json``).

        Raises:
            ValueError: the files describe a vision model this processor cannot serve: no preprocessor config, no
                image token, an unknown vision tower or feature strategy, a ``size`` of another form, an image size
                that varies with the input (no crop after a shortest-edge resize), or one other than the tower's.

        """
        config = json.loads(files.get("config.json", b"{}"))
        vision = config.get("vision_config")
        if vision is None:
            return None
        if "preprocessor_config.json" not in files:
            raise ValueError("this is a vision-language model, but it has no preprocessor_config.json")
        processor = _CLIP_DEFAULTS | json.loads(files["preprocessor_config.json"])
        image_token_id = config.get("image_token_index")
        if image_token_id is None:  # the newer name
            image_token_id = config.get("image_token_id")
        if not isinstance(image_token_id, int):
            raise ValueError("config.json names no image token: it needs an int image_token_index or image_token_id")
        resize = _resize_size(processor["size"]) if processor["do_resize"] else None
        crop_size = _crop_size(processor["crop_size"]) if processor["do_center_crop"] else None
        input_size = crop_size or (resize if isinstance(resize, tuple) else None)
        if input_size is None:
            raise ValueError(
                "preprocessor_config.json leaves the image size to the input (no center crop after a shortest-edge "
                "resize, or no resize): only processors that give every image one size are supported"
            )
        tower_size = vision.get("image_size")
        tower_size = (tower_size, tower_size) if isinstance(tower_size, int) else tuple(tower_size or ())
        if input_size != tower_size:
            raise ValueError(
                f"preprocessor_config.json makes {input_size[0]}x{input_size[1]} images, but the vision tower takes "
                f"image_size={vision.get('image_size')} (config.json's vision_config): the two must agree"
            )
        tower = vision.get("model_type", "clip_vision_model")  # LlavaConfig's default tower
        if tower not in _TOWER_HAS_CLS:
            raise ValueError(f"unsupported vision tower {tower!r}: the supported ones are {sorted(_TOWER_HAS_CLS)}")
        strategy = config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}: expected 'default' or 'full'")
        patch = vision.get("patch_size")
        if not isinstance(patch, int):
            raise ValueError(f"config.json's vision_config needs an int patch_size, got {patch!r}")
        encoder_tokens = (input_size[0] // patch) * (input_size[1] // patch) + _TOWER_HAS_CLS[tower]
        num_image_tokens = encoder_tokens - 1 if strategy == "default" else encoder_tokens
        return cls(
            image_token_id,
            num_image_tokens,
            convert_rgb=processor["do_convert_rgb"],
            resize=resize,
            resample=Image.Resampling(processor["resample"]),
            crop_size=crop_size,
            rescale_factor=processor["rescale_factor"] if processor["do_rescale"] else None,
            image_mean=_per_channel(processor["image_mean"]) if processor["do_normalize"] else None,
            image_std=_per_channel(processor["image_std"]) if processor["do_normalize"] else None,
        )

    def preprocess(self, image: object, field: str = "image") -> np.ndarray:
        """Decode (if encoded) and preprocess one image into the model's pixel input.

        Args:
            image: a PIL image; an encoded image (bytes, bytearray or memoryview) in one of :data:`IMAGE_FORMATS`, at
                most :data:`MAX_IMAGE_BYTES` long; a ``uint8`` array of raw pixels (``[height, width]``, ``[height,
                width, channels]`` or ``[channels, height, width]``, as transformers' image processors take them),
                preprocessed like an image; or a floating-point array of pixels already preprocessed, the model's
                input as its image processor gives it (``[3, height, width]`` at the model's image size, or with a
                batch dimension of one, as ``pixel_values`` of one image), used as it is. Arrays are numpy arrays or
                anything ``numpy.asarray`` reads, such as a CPU ``torch.Tensor``. Images of every form have at most
                :data:`MAX_IMAGE_PIXELS` pixels.
            field: the request field that holds the image, which an error names.

        Returns:
            The ``[3, height, width]`` float32 pixels.

        Raises:
            InvalidRequestError: ``image`` is of another type, too large (or too narrow: it would resize to more than
                :data:`MAX_IMAGE_PIXELS`), not decodable, (without RGB conversion) not RGB; or an array of another
                dtype or shape, of another size than the model's, or with values that are not finite.

        """
        if not isinstance(image, bytes | bytearray | memoryview | Image.Image) and hasattr(image, "__array__"):
            pixels = _pixel_array(image, field)
            if pixels.dtype != np.uint8:
                return self._preprocessed(pixels, field)
            image = Image.fromarray(pixels)
        image = _open(image, field)
        size = self._resize_to(image, field)  # checked before the conversion and resize spend any memory
        image = self._rgb(image, field)
        pixels = np.asarray(image if size is None else image.resize(size, resample=self._resample))
        pixels = np.moveaxis(pixels, -1, 0)  # PIL gives [height, width, channels]
        if self._crop_size is not None:
            pixels = _center_crop(pixels, *self._crop_size)
        if self._rescale_factor is not None:
            # In float64, then float32, as transformers rescales.
            pixels = (pixels.astype(np.float64) * self._rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32, copy=False)
        if self._mean is not None:
            pixels = (pixels - self._mean) / self._std
        return np.ascontiguousarray(pixels)

    def _preprocessed(self, pixels: np.ndarray, field: str) -> np.ndarray:
        """Floating-point pixels the model takes as they are, checked: ``[3, height, width]``, finite, its size."""
        size = tuple(pixels.shape[1:])
        if pixels.ndim != 3 or pixels.shape[0] != 3 or (self.input_size is not None and size != self.input_size):
            expected = "x".join(map(str, self.input_size)) if self.input_size else "height x width"
            raise InvalidRequestError(
                field,
                f"{field} is a float array of shape {list(pixels.shape)}: preprocessed pixels must be [3, {expected}] "
                "(or [1, 3, ...]), this model's input; send raw pixels as a uint8 array, or an image",
            )
        if not np.isfinite(pixels).all():
            raise InvalidRequestError(field, f"{field} has pixel values that are not finite (NaN or infinity)")
        return np.ascontiguousarray(pixels, dtype=np.float32)

    def _rgb(self, image: Image.Image, field: str) -> Image.Image:
        """``image`` in RGB, transparency composited onto white as transformers' ``convert_to_rgb`` does."""
        if not self._convert_rgb:
            if image.mode != "RGB":
                raise InvalidRequestError(
                    field,
                    f"{field} is a {image.mode} image, but this model's image processor does not convert images to "
                    "RGB (do_convert_rgb is false): send an RGB image",
                )
            return image
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            background = Image.new("RGBA", image.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
        return image.convert("RGB")

    def _resize_to(self, image: Image.Image, field: str) -> tuple[int, int] | None:
        """The ``(width, height)`` to resize ``image`` to (``None``: keep its size), at most :data:`MAX_IMAGE_PIXELS`.

        As transformers' PIL backend sizes it: a shortest edge keeps the aspect ratio, truncating the long edge. A
        size over the limit raises :class:`InvalidRequestError` naming ``field``.
        """
        if self._resize is None:
            return None
        if isinstance(self._resize, tuple):
            height, width = self._resize
            return width, height
        short, long = sorted(image.size)
        new_long = int(self._resize * long / short)
        size = (self._resize, new_long) if image.width <= image.height else (new_long, self._resize)
        if size[0] * size[1] > MAX_IMAGE_PIXELS:
            raise InvalidRequestError(
                field,
                f"{field} is {image.width}x{image.height} pixels, which this model resizes to {size[0]}x{size[1]}, "
                f"more than the {MAX_IMAGE_PIXELS} (40 megapixels) an image may have: crop it to a less extreme "
                "aspect ratio",
            )
        return size


def _open(image: object, field: str) -> Image.Image:
    """A PIL image of ``image`` (itself, or decoded), after checking its size; raises naming ``field``."""
    if isinstance(image, bytes | bytearray | memoryview):
        size = memoryview(image).nbytes
        if size > MAX_IMAGE_BYTES:
            raise InvalidRequestError(
                field, f"{field} has {size} bytes, more than the {MAX_IMAGE_BYTES} (20 MiB) an image may have"
            )
        formats = ", ".join(IMAGE_FORMATS)
        try:
            # open() reads the header only, so the pixel count is checked before the pixels are decoded.
            decoded = Image.open(io.BytesIO(image), formats=IMAGE_FORMATS)
        except Image.UnidentifiedImageError as error:
            raise InvalidRequestError(field, f"{field} is not a {formats} image") from error
        except Image.DecompressionBombError as error:  # far beyond MAX_IMAGE_PIXELS: PIL refuses to open it
            raise InvalidRequestError(
                field, f"{field} has more than the {MAX_IMAGE_PIXELS} (40 megapixels) an image may have ({error})"
            ) from error
        except (OSError, SyntaxError, ValueError, EOFError) as error:
            raise InvalidRequestError(field, f"{field} is not a decodable image: {error}") from error
        _check_pixels(decoded, field)
        try:
            decoded.load()
        except (OSError, SyntaxError, ValueError, EOFError) as error:  # truncated or corrupt pixel data
            raise InvalidRequestError(field, f"{field} is not a decodable {decoded.format} image: {error}") from error
        return decoded
    if isinstance(image, Image.Image):
        _check_pixels(image, field)
        return image
    raise InvalidRequestError(
        field, f"{field} must be a PIL image, encoded image bytes or a pixel array, not {type(image).__name__}"
    )


def _pixel_array(image: object, field: str) -> np.ndarray:
    """The array ``image`` holds, checked and without a batch dimension of one.

    ``uint8`` raw pixels come back channels last (``[height, width]`` or ``[height, width, 3 or 4]``), floating-point
    ones as they are; either at most :data:`MAX_IMAGE_PIXELS` pixels.
    """
    try:
        pixels = np.asarray(image)
    except (TypeError, ValueError, RuntimeError) as error:  # e.g. a tensor on a GPU, or one that needs grad
        raise InvalidRequestError(field, f"{field} does not convert to a numpy array: {error}") from error
    if pixels.ndim == 4 and pixels.shape[0] == 1:
        pixels = pixels[0]
    kind = pixels.dtype.kind
    if kind != "f" and pixels.dtype != np.uint8:
        raise InvalidRequestError(
            field,
            f"{field} is an array of {pixels.dtype}: raw pixels are uint8 (0-255), preprocessed pixels floating point",
        )
    if pixels.ndim not in (2, 3):
        raise InvalidRequestError(
            field,
            f"{field} is an array of shape {list(pixels.shape)}: an image is 2 or 3 dimensions (a batch of several "
            "images is several images: pass each on its own)",
        )
    if kind == "u" and pixels.ndim == 3 and pixels.shape[0] in (1, 3, 4) and pixels.shape[-1] not in (1, 3, 4):
        pixels = np.moveaxis(pixels, 0, -1)  # channels first, as transformers infers the layout
    if kind == "u" and pixels.ndim == 3 and pixels.shape[-1] not in (1, 3, 4):
        raise InvalidRequestError(
            field, f"{field} is a uint8 array of shape {list(pixels.shape)}: raw pixels have 1, 3 or 4 channels"
        )
    height, width = pixels.shape[:2] if kind == "u" else pixels.shape[-2:]
    if height * width > MAX_IMAGE_PIXELS:
        raise InvalidRequestError(
            field,
            f"{field} is {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS} (40 megapixels) an image may have",
        )
    if kind == "u" and pixels.ndim == 3 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    return np.ascontiguousarray(pixels)


def _check_pixels(image: Image.Image, field: str) -> None:
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise InvalidRequestError(
            field,
            f"{field} is {image.width}x{image.height} pixels, more than the {MAX_IMAGE_PIXELS} (40 megapixels) an "
            "image may have: scale it down",
        )


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centered ``height`` x ``width`` window of ``[channels, h, w]`` pixels, zero-padded where they are smaller.

    As transformers' ``center_crop``: the window starts at ``(h - height) // 2``; a smaller image is first centered
    on a zero canvas (the extra row or column, if odd, on top or left), then cropped.
    """
    channels, image_height, image_width = pixels.shape
    top, left = (image_height - height) // 2, (image_width - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + height, left : left + width]
    canvas_height, canvas_width = max(height, image_height), max(width, image_width)
    pad_top, pad_left = math.ceil((canvas_height - image_height) / 2), math.ceil((canvas_width - image_width) / 2)
    canvas = np.zeros((channels, canvas_height, canvas_width), dtype=pixels.dtype)
    canvas[:, pad_top : pad_top + image_height, pad_left : pad_left + image_width] = pixels
    top, left = top + pad_top, left + pad_left
    return canvas[:, max(0, top) : min(canvas_height, top + height), max(0, left) : min(canvas_width, left + width)]


def _resize_size(size: object) -> int | tuple[int, int]:
    """A processor's ``size`` as :class:`ImageProcessor` takes it: an int (shortest edge) or ``(height, width)``."""
    if isinstance(size, int):  # older CLIP configs: an int is the shortest edge
        return size
    if isinstance(size, dict) and set(size) == {"shortest_edge"}:
        return size["shortest_edge"]
    if isinstance(size, dict) and set(size) == {"height", "width"}:
        return size["height"], size["width"]
    raise ValueError(
        f"preprocessor_config.json's size {size!r} is not supported: expected {{'shortest_edge': int}} or "
        "{'height': int, 'width': int}"
    )


def _crop_size(size: object) -> tuple[int, int]:
    """A processor's ``crop_size`` as ``(height, width)`` (an int is a square)."""
    if isinstance(size, int):
        return size, size
    if isinstance(size, dict) and set(size) == {"height", "width"}:
        return size["height"], size["width"]
    raise ValueError(f"preprocessor_config.json's crop_size {size!r} is not supported: expected an int or height/width")


def _per_channel(value: float | list[float]) -> list[float]:
    """A mean or std for the three RGB channels (a single number applies to each)."""
    values = [value] * 3 if isinstance(value, int | float) else list(value)
    if len(values) != 3:
        raise ValueError(f"preprocessor_config.json's image_mean and image_std need 3 values (RGB), got {value!r}")
    return values
