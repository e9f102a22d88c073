"""CLIP's vision transformer (transformers' ``CLIPVisionModel``): pixels to the hidden states of chosen layers.

It is a vision-language model's image encoder (LLaVA's).

Plain torch, so it runs wherever the model does (CPU or CUDA, any float dtype). An image is encoded once, when its
prompt is first scheduled, so nothing here is tuned for the per-step path: no paged cache, no CUDA graphs.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
"""What transformers' ``CLIPVisionConfig`` assumes for a field that a ``vision_config`` omits."""


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI CLIP's sigmoid approximation of GELU, which its checkpoints were trained with."""
    return x * torch.sigmoid(1.702 * x)


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    # transformers' gelu_new and gelu_fast are the tanh approximation written out; the same function.
    "gelu_pytorch_tanh": _tanh_gelu,
    "gelu_new": _tanh_gelu,
    "gelu_fast": _tanh_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
"""The ``hidden_act`` / ``projector_hidden_act`` names (transformers' ``ACT2FN`` keys) served, and their function."""


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function transformers names ``name``.

    Raises:
        ValueError: for a name not in :data:`ACTIVATIONS`.

    """
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Left uninitialised, as the decoder's: every weight comes from a checkpoint.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """A biased (or not) linear layer whose parameters are created uninitialised, unlike ``nn.Linear``'s."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.weight = _weight(out_features, in_features, dtype=dtype)
        self.bias = _weight(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` to ``[..., out_features]``."""
        return F.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    """Layer normalisation with a weight and a bias, created uninitialised."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _weight(size, dtype=dtype)
        self.bias = _weight(size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class ClipAttention(nn.Module):
    """Bidirectional multi-head self-attention over an image's patches, with a fused, biased q/k/v projection."""

    def __init__(self, hidden_size: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = num_heads
        # q, k and v stacked in that order (rows), as Linear(hidden, 3 * hidden): one matmul instead of three.
        self.qkv_proj = Linear(hidden_size, 3 * hidden_size, dtype)
        self.out_proj = Linear(hidden_size, hidden_size, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, S, hidden]`` (N images of S positions) to ``[N, S, hidden]``; every position sees all."""
        n, s, width = hidden.shape
        q, k, v = self.qkv_proj(hidden).view(n, s, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        # The default scale is head_dim ** -0.5, CLIP's; no mask: an image attends over all of its patches.
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, s, width))


class ClipEncoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + fc2(act(fc1(ln2(x))))``."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["layer_norm_eps"]
        self.layer_norm1 = LayerNorm(hidden, eps, dtype)
        self.self_attn = ClipAttention(hidden, config["num_attention_heads"], dtype)
        self.layer_norm2 = LayerNorm(hidden, eps, dtype)
        self.fc1 = Linear(hidden, config["intermediate_size"], dtype)
        self.fc2 = Linear(config["intermediate_size"], hidden, dtype)
        self.act = activation(config["hidden_act"])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """One block over ``hidden [N, S, hidden]``."""
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.fc2(self.act(self.fc1(self.layer_norm2(hidden))))


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer, up to the deepest layer a caller asks for.

    Hidden state ``i`` is transformers' ``hidden_states[i]``: 0 the patch and class embeddings after the
    pre-layernorm, ``i`` the output of encoder layer ``i``; negative indices count from the last
    (``-1`` = layer ``num_hidden_layers``). Only the layers up to the deepest requested state are built and run: LLaVA
    takes state ``-2``, so CLIP's last layer and its ``post_layernorm`` (which only feeds CLIP's pooled output) are
    never needed, and their checkpoint tensors are skipped (:meth:`checkpoint_slice`).

    Parameters are created uninitialised on the current default device and filled through
    :meth:`checkpoint_slice`; the q/k/v projections of a layer are fused into ``self_attn.qkv_proj``.

    Args:
        vision_config: the checkpoint's ``vision_config`` dict; absent fields take :data:`CLIP_VISION_DEFAULTS`.
        feature_layers: the hidden states :meth:`forward` returns, by index as above.
        dtype: the parameters' dtype.

    Raises:
        ValueError: for a feature layer outside the tower, or an activation it does not know.

    """

    def __init__(self, vision_config: dict[str, Any], feature_layers: Sequence[int], dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config = {**CLIP_VISION_DEFAULTS, **vision_config}
        depth = config["num_hidden_layers"]
        self.depth = depth
        self.feature_layers = [self._state_index(layer) for layer in feature_layers]
        hidden, patch = config["hidden_size"], config["patch_size"]
        self.image_size = config["image_size"]
        self.num_channels = config["num_channels"]
        self.patch_size = patch
        self.num_patches = (self.image_size // patch) ** 2
        self.class_embedding = _weight(hidden, dtype=dtype)
        self.patch_embedding = _weight(hidden, self.num_channels, patch, patch, dtype=dtype)  # a conv, no bias
        self.position_embedding = _weight(self.num_patches + 1, hidden, dtype=dtype)
        self.pre_layrnorm = LayerNorm(hidden, config["layer_norm_eps"], dtype)  # sic: CLIP's spelling
        self.layers = nn.ModuleList(ClipEncoderLayer(config, dtype) for _ in range(max(self.feature_layers)))

    def _state_index(self, layer: int) -> int:
        index = layer + self.depth + 1 if layer < 0 else layer
        if not 0 <= index <= self.depth:
            raise ValueError(f"vision feature layer {layer} is outside a CLIP tower of {self.depth} layers")
        return index

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Images ``[N, C, H, W]`` (the tower's dtype) to the requested hidden states, ``[N, patches + 1, hidden]``.

        The first of the ``patches + 1`` positions is the class token's. The states come in the order of
        ``feature_layers``.

        Raises:
            ValueError: when the images are not ``[N, num_channels, image_size, image_size]`` (no position
                embedding interpolation).

        """
        expected = (self.num_channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            shape = ", ".join(map(str, expected))
            raise ValueError(f"images of shape {tuple(pixel_values.shape)} are not [N, {shape}]")
        patches = F.conv2d(pixel_values, self.patch_embedding, stride=self.patch_size)  # [N, hidden, grid, grid]
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(len(pixel_values), 1, -1)
        hidden = self.pre_layrnorm(torch.cat([cls, patches], dim=1) + self.position_embedding)
        states = [hidden]
        for layer in self.layers:
            hidden = layer(hidden)
            states.append(hidden)
        return [states[index] for index in self.feature_layers]

    def checkpoint_slice(self, name: str) -> tuple[str, int, int | None] | None:
        """Where the checkpoint tensor ``name`` goes: ``(parameter name, first row, rows)``, None to skip it.

        ``name`` is relative to the tower, as transformers' ``CLIPVisionModel`` names it without ``vision_model.``
        (``encoder.layers.3.self_attn.k_proj.weight``, ``embeddings.class_embedding``, ``pre_layrnorm.bias``); rows
        is None for the whole parameter. Skipped are the tensors of the parts never built (layers past the deepest
        requested, ``post_layernorm``) and old checkpoints' ``position_ids`` buffer.

        Raises:
            ValueError: for a name that is no part of a CLIP vision tower of this config.

        """
        if name in _EMBEDDINGS:
            return _EMBEDDINGS[name], 0, None
        if name in ("pre_layrnorm.weight", "pre_layrnorm.bias"):
            return name, 0, None
        if name in ("embeddings.position_ids", "post_layernorm.weight", "post_layernorm.bias"):
            return None
        index, _, rest = name.removeprefix("encoder.layers.").partition(".")
        if name.startswith("encoder.layers.") and index.isdigit() and int(index) < self.depth:
            width = self.config["hidden_size"]
            for i, projection in enumerate(("q_proj", "k_proj", "v_proj")):
                for kind in ("weight", "bias"):
                    if rest == f"self_attn.{projection}.{kind}":
                        target = f"layers.{index}.self_attn.qkv_proj.{kind}", i * width, width
                        return target if int(index) < len(self.layers) else None
            if rest in _LAYER_PARAMETERS:
                return (f"layers.{index}.{_LAYER_PARAMETERS[rest]}", 0, None) if int(index) < len(self.layers) else None
        raise ValueError(f"checkpoint tensor {name} is no part of a CLIP vision tower of {self.depth} layers")


_EMBEDDINGS = {
    "embeddings.class_embedding": "class_embedding",
    "embeddings.patch_embedding.weight": "patch_embedding",
    "embeddings.position_embedding.weight": "position_embedding",
}
"""The embeddings' checkpoint names (under the tower) -> ours."""

_LAYER_PARAMETERS = {
    f"{module}.{kind}": f"{module.removeprefix('mlp.')}.{kind}"
    for module in ("layer_norm1", "layer_norm2", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
    for kind in ("weight", "bias")
}
"""An encoder layer's checkpoint names other than q/k/v (fused into ``self_attn.qkv_proj``) -> ours."""
