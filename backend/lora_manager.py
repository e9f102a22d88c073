"""LoRA adapters: reading PEFT directories, keeping every known adapter on the host, and the device's adapter slots.

An adapter is loaded once (``--lora-modules`` at start-up, or :meth:`LoraManager.add`) into host tensors in the
layout of the slots: per adapted projection of our model (fused ``qkv_proj`` and ``gate_up_proj``, ``o_proj``,
``down_proj``), ``A [K, in]`` and ``B.T [K, out]`` with ``K = parts x max_lora_rank``, each PEFT module's matrices in
its part's rank block and its rows of the fused output (zeros where it targets nothing; a module fused in the
checkpoint, Phi-3's, fills every part it fuses: :data:`FUSED_TARGETS`), and ``lora_alpha / r`` (``/ sqrt(r)`` with
rsLoRA) folded into ``B``.

The device holds ``max_loras`` slots: per projection ``lora_a [max_loras, K, in]`` and ``lora_b [max_loras, K,
out]``, allocated when the first adapter is loaded (at start-up when the engine is configured for LoRA, so that the
CUDA memory budget counts them) and installed into the model's ``lora`` dicts. Each step the model runner asks
:meth:`LoraManager.assign` for the slot of every scheduled sequence's adapter; an adapter that is not resident is
copied into a free slot, else into the least recently used one that no running sequence needs. The scheduler admits
a sequence only when its adapter can have a slot (``max_loras`` distinct adapters among the running sequences at
most), so there always is one.

An adapter unloaded by name (:meth:`LoraManager.remove`) keeps its weights while any unfinished sequence uses it,
waiting or running: each step's :class:`~spindle.backend.scheduler_output.SchedulerOutput` says which adapters those
are, and the others that were unloaded leave then (:meth:`LoraManager.release_unused`).

Loads are deduplicated by content: a directory whose ``adapter_config.json`` and weights hash the same as a loaded
adapter's is another name for it, sharing its host weights, its slot and its prefix-cache blocks (they are the same
weights), rather than a copy of them; it leaves when its last name is unloaded. At most ``max_loaded`` names are
loaded at once, so a client cannot fill the host's memory with adapters.
"""

import hashlib
import json
import math
import re
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from spindle.backend.models.checkpoint_config import CheckpointConfig
from spindle.kernels.lora import LoraSlots
from spindle.shared.errors import AlreadyExistsError, InvalidRequestError, NotFoundError, ResourceExhaustedError
from spindle.shared.lora import LoraAdapterInfo

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

TARGET_PARTS: dict[str, int] = {
    "q_proj": 0,
    "k_proj": 1,
    "v_proj": 2,
    "o_proj": 0,
    "gate_proj": 0,
    "up_proj": 1,
    "down_proj": 0,
}
"""The PEFT modules an adapter may target, and each one's part (rank block) in our fused projection."""

FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""Checkpoints' fused modules (Phi-3's) an adapter may target, and the modules of :data:`TARGET_PARTS` each fuses.

Their one ``A`` goes into every part's rank block and their ``B``'s rows are cut into the parts': ``B_q A x`` is the
q rows of ``B A x``, so the slots compute the fused adapter exactly (at the cost of its rank once per part).
"""

ADAPTABLE = [*TARGET_PARTS, *FUSED_TARGETS]
"""Every module name an adapter may target, in the order :class:`LoraAdapterInfo` lists them."""

NUM_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
"""Our adapted projections and how many PEFT modules each fuses."""

HostWeights = tuple[torch.Tensor, torch.Tensor, list[int]]
"""One adapted projection of an adapter on the host: ``(A [K, in], B.T [K, out], its rank in each part)``."""

_TENSOR_NAME = re.compile(r"base_model\.model\.(?P<module>.+\.(?P<target>\w+))\.lora_(?P<matrix>[AB])\.weight")


@dataclass
class LoraAdapter:
    """One loaded adapter: what the API reports of it, and its weights on the host.

    Attributes:
        adapter_id: unique for the engine's life (a name loaded again gets a new id: its prefix-cache blocks and its
            slot contents are those of the new weights).
        info: name, path, rank and target modules, as first loaded.
        content: the hash of its ``adapter_config.json`` and weights file (:func:`adapter_content`).
        weights: by projection name (``layers.3.self_attn.qkv_proj``), ``(A [K, in], B.T [K, out], part ranks)`` on
            the host in the model's dtype, in the slots' layout (module docstring); a part it does not adapt has
            rank 0. Projections it does not adapt are absent.
        removed: unloaded by name; it stays while unfinished sequences use it.

    """

    adapter_id: int
    info: LoraAdapterInfo
    content: str
    weights: dict[str, HostWeights]
    removed: bool = False


@dataclass
class _Slots:
    """The device slots by projection, and which adapter each slot holds."""

    weights: dict[str, LoraSlots]
    owner: list[int | None]
    # adapter id -> slot, least recently used first.
    resident: OrderedDict[int, int] = field(default_factory=OrderedDict)


class LoraManager:
    """Known adapters on the host, ``max_loras`` slots on the device, least-recently-used replacement.

    Args:
        model: the model; its projection modules (``LlamaForCausalLM.projections()``) need a ``lora`` dict each
            (Llama-family models have one).
        max_loras: device slots.
        max_rank: the largest rank an adapter may have; every slot is sized for it.
        device: where the slots live.
        dtype: the model's dtype.
        max_loaded: the most adapter names loaded at once.

    Attributes:
        num_slot_loads: adapters copied into a slot since start-up (one per miss).

    """

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        max_loaded: int = 64,
    ) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.max_loaded = max_loaded
        self.adapters: dict[int, LoraAdapter] = {}
        self.by_name: dict[str, int] = {}
        # Each name's info (its own name and path; an alias shares the adapter, not the info).
        self._infos: dict[str, LoraAdapterInfo] = {}
        # Content hash -> the adapter loaded with it (not yet unloaded by its last name).
        self._by_content: dict[str, int] = {}
        self.num_slot_loads = 0
        self._slots: _Slots | None = None
        self._ids = count(1)
        projections = getattr(model, "projections", None)
        found = projections() if callable(projections) else {}
        # Our projection name -> (module, attribute, out_features, in_features, each part's end column).
        self._targets: dict[str, tuple[nn.Module, str, int, int, list[int]]] = {}
        config = getattr(model, "config", None)
        if isinstance(config, CheckpointConfig) and callable(getattr(model, "parameter_slice", None)):
            for name, (module, attr) in found.items():
                if attr in NUM_PARTS and isinstance(getattr(module, "lora", None), dict):
                    self._targets[name] = (module, attr, *_projection_layout(config, attr))

    @property
    def supported(self) -> bool:
        """Whether the model has LoRA hooks (every Llama-family model does)."""
        return bool(self._targets)

    def allocate(self) -> None:
        """Allocate the device slots (zeros) and install them into the model; nothing when they already are."""
        if self._slots is not None or not self.supported:
            return
        weights: dict[str, LoraSlots] = {}
        for name, (module, attr, out_features, in_features, part_ends) in self._targets.items():
            k = NUM_PARTS[attr] * self.max_rank
            weights[name] = module.lora[attr] = LoraSlots(
                lora_a=torch.zeros(self.max_loras, k, in_features, dtype=self.dtype, device=self.device),
                lora_b=torch.zeros(self.max_loras, k, out_features, dtype=self.dtype, device=self.device),
                part_ends=part_ends,
                ranks=torch.zeros(self.max_loras, NUM_PARTS[attr], dtype=torch.int64),
            )
        self._slots = _Slots(weights, [None] * self.max_loras)

    @property
    def allocated(self) -> bool:
        """Whether the device slots are (the model runner's start-up compiles the LoRA kernels for them)."""
        return self._slots is not None

    def add(self, name: str, path: str) -> LoraAdapterInfo:
        """Read a PEFT adapter directory and keep its weights on the host under ``name``.

        A directory of the same content as a loaded adapter (:func:`adapter_content`) is not read again: ``name``
        becomes another name for that adapter, sharing its weights.

        Raises:
            AlreadyExistsError: ``name`` is taken (field ``name``).
            ResourceExhaustedError: ``max_loaded`` adapter names are loaded already (field ``name``).
            InvalidRequestError: the name is empty (field ``name``); the directory lacks ``adapter_config.json`` or
                ``adapter_model.safetensors``, the adapter's rank exceeds ``max_lora_rank``, it targets a module other
                than q/k/v/o/gate/up/down_proj or the fused qkv/gate_up_proj, uses an unsupported PEFT feature, or a
                matrix does not fit the model (field ``path``).

        """
        if not name:
            raise InvalidRequestError("name", "a LoRA adapter needs a non-empty name")
        if name in self.by_name:
            raise AlreadyExistsError("name", f"a LoRA adapter named {name!r} is already loaded: unload it first")
        if len(self.by_name) >= self.max_loaded:
            raise ResourceExhaustedError(
                "name",
                f"{len(self.by_name)} LoRA adapters are loaded, the most this engine allows (max_loaded_loras): "
                "unload one first",
            )
        if not self.supported:
            raise InvalidRequestError(
                "path", f"the model class {type(self.model).__name__} has no LoRA support (Llama-family models do)"
            )
        directory = Path(path)
        content = adapter_content(directory)
        adapter_id = self._by_content.get(content)
        if adapter_id is None:
            info, weights = self._read(name, directory)
            self.allocate()
            adapter = LoraAdapter(next(self._ids), info, content, weights)
            self.adapters[adapter.adapter_id] = adapter
            self._by_content[content] = adapter_id = adapter.adapter_id
        shared = self.adapters[adapter_id].info
        info = LoraAdapterInfo(name=name, path=str(directory), rank=shared.rank, target_modules=shared.target_modules)
        self.by_name[name] = adapter_id
        self._infos[name] = info
        return info

    def remove(self, name: str, in_use: Collection[int]) -> None:
        """Unload ``name``: new requests may no longer use it; the sequences using it (``in_use``) keep it.

        The adapter itself leaves with its last name.

        Raises:
            NotFoundError: no adapter of that name is loaded (field ``name``).

        """
        adapter_id = self.by_name.pop(name, None)
        if adapter_id is None:
            raise NotFoundError("name", f"no LoRA adapter named {name!r} is loaded; loaded: {self._loaded_names()}")
        del self._infos[name]
        if adapter_id in self.by_name.values():
            return  # another name still serves it
        adapter = self.adapters[adapter_id]
        adapter.removed = True
        del self._by_content[adapter.content]
        self.release_unused(in_use)

    def release_unused(self, in_use: Collection[int]) -> None:
        """Drop the unloaded adapters that no unfinished sequence uses any longer (not in ``in_use``)."""
        for adapter_id in [i for i, adapter in self.adapters.items() if adapter.removed and i not in in_use]:
            self._drop(adapter_id)

    def lookup(self, name: str) -> int:
        """The id of the loaded adapter ``name``.

        Raises:
            NotFoundError: no adapter of that name is loaded (field ``lora_name``).

        """
        adapter_id = self.by_name.get(name)
        if adapter_id is None:
            raise NotFoundError(
                "lora_name", f"unknown LoRA adapter {name!r}; loaded: {self._loaded_names()} (load it first)"
            )
        return adapter_id

    def list_adapters(self) -> list[LoraAdapterInfo]:
        """The loaded adapters, in loading order (unloaded ones still finishing requests excluded)."""
        return list(self._infos.values())

    def assign(self, adapter_ids: list[int | None], pinned: Collection[int] = ()) -> list[int]:
        """The slot of each entry's adapter (``-1`` for None, the base model), copying in those not resident.

        A missing adapter takes a free slot, else the least recently used one whose adapter is neither in
        ``adapter_ids`` nor ``pinned`` (the adapters of running sequences not in this step), else (only when the
        scheduler's bound was not kept) any not in ``adapter_ids``.

        Raises:
            RuntimeError: more distinct adapters than slots.

        """
        assert self._slots is not None, "no adapter was ever loaded"
        slots = self._slots
        needed = dict.fromkeys(i for i in adapter_ids if i is not None)
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step uses {len(needed)} adapters but there are {self.max_loras} slots")
        for adapter_id in needed:
            if adapter_id in slots.resident:
                slots.resident.move_to_end(adapter_id)
                continue
            free = next((slot for slot, owner in enumerate(slots.owner) if owner is None), None)
            if free is None:
                victims = [i for i in slots.resident if i not in needed]
                victim = next((i for i in victims if i not in pinned), victims[0])
                free = slots.resident.pop(victim)
            self._load(adapter_id, free)
        return [-1 if i is None else slots.resident[i] for i in adapter_ids]

    def slot_of(self, adapter_id: int) -> int | None:
        """The slot holding the adapter, or None when it is not resident."""
        return None if self._slots is None else self._slots.resident.get(adapter_id)

    def _load(self, adapter_id: int, slot: int) -> None:
        assert self._slots is not None
        weights = self.adapters[adapter_id].weights
        for name, slots in self._slots.weights.items():
            host = weights.get(name)
            if host is None:
                slots.lora_a[slot].zero_()
                slots.lora_b[slot].zero_()
                slots.ranks[slot] = 0
            else:
                slots.lora_a[slot].copy_(host[0], non_blocking=True)
                slots.lora_b[slot].copy_(host[1], non_blocking=True)
                slots.ranks[slot] = torch.tensor(host[2])
        self._slots.owner[slot] = adapter_id
        self._slots.resident[adapter_id] = slot
        self.num_slot_loads += 1

    def _drop(self, adapter_id: int) -> None:
        del self.adapters[adapter_id]
        if self._slots is not None and adapter_id in self._slots.resident:
            self._slots.owner[self._slots.resident.pop(adapter_id)] = None

    def _loaded_names(self) -> str:
        return ", ".join(sorted(self.by_name)) or "none"

    def _read(self, name: str, path: Path) -> tuple[LoraAdapterInfo, dict[str, HostWeights]]:
        """Read and check a PEFT adapter directory (:func:`adapter_content` checked that it holds both files).

        Returns its info and its host weights in the slots' layout.
        """
        config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS  # both there: adapter_content
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            raise InvalidRequestError("path", f"{config_file} is not readable JSON: {e}") from e
        rank, scale, targets = self._check_config(path, config)
        try:
            with safe_open(weights_file, framework="pt") as f:
                tensors = {tensor_name: f.get_tensor(tensor_name) for tensor_name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise InvalidRequestError("path", f"{weights_file} is not a readable safetensors file: {e}") from e
        weights: dict[str, HostWeights] = {}
        found_targets: set[str] = set()
        for tensor_name, tensor in tensors.items():
            match = _TENSOR_NAME.fullmatch(tensor_name)
            target = match and match["target"]
            if target not in ADAPTABLE:
                raise InvalidRequestError(
                    "path",
                    f"{weights_file} holds {tensor_name}, which is not a LoRA matrix of "
                    f"{'/'.join(ADAPTABLE)}: only those modules can be adapted",
                )
            assert match is not None
            prefix = match["module"].removesuffix(target)
            parts = FUSED_TARGETS.get(target, (target,))
            slices = [self.model.parameter_slice(f"{prefix}{part}.weight") for part in parts]
            projection = slices[0][0]
            if projection not in self._targets or any(s[0] != projection for s in slices):
                raise InvalidRequestError("path", f"{tensor_name} in {weights_file} names no layer of this model")
            _, attr, out_features, in_features, _ = self._targets[projection]
            a, b, ranks = weights.get(projection) or self._zeros(attr, out_features, in_features)
            part_rows = [out_features if rows is None else rows for _, _, rows in slices]
            expected = (rank, in_features) if match["matrix"] == "A" else (sum(part_rows), rank)
            if tuple(tensor.shape) != expected:
                raise InvalidRequestError(
                    "path",
                    f"{tensor_name} in {weights_file} is {list(tensor.shape)}, but a rank-{rank} adapter of this "
                    f"model's {target} needs {list(expected)}: was it made for another base model?",
                )
            pieces = tensor.split(part_rows) if match["matrix"] == "B" else [tensor] * len(parts)
            for part, (_, offset, _), piece in zip(parts, slices, pieces, strict=True):
                block = slice(TARGET_PARTS[part] * self.max_rank, TARGET_PARTS[part] * self.max_rank + rank)
                if match["matrix"] == "A":
                    a[block] = piece.to(self.dtype)
                else:
                    # The scale folded in float32, then rounded once to the model's dtype.
                    b[block, offset : offset + piece.shape[0]] = (piece.float() * scale).T.to(self.dtype)
                ranks[TARGET_PARTS[part]] = rank
            weights[projection] = (a, b, ranks)
            found_targets.add(target)
        if not found_targets:
            raise InvalidRequestError("path", f"{weights_file} holds no LoRA matrices")
        names = sorted(targets or found_targets, key=ADAPTABLE.index)
        return LoraAdapterInfo(name=name, path=str(path), rank=rank, target_modules=names), weights

    def _zeros(self, attr: str, out_features: int, in_features: int) -> HostWeights:
        k = NUM_PARTS[attr] * self.max_rank
        a, b = torch.zeros(k, in_features, dtype=self.dtype), torch.zeros(k, out_features, dtype=self.dtype)
        return a, b, [0] * NUM_PARTS[attr]

    def _check_config(self, path: Path, config: dict) -> tuple[int, float, list[str]]:
        """``(rank, scale, target modules)`` of an ``adapter_config.json``, refusing what the slots cannot serve."""

        def refuse(reason: str) -> InvalidRequestError:
            return InvalidRequestError("path", f"the LoRA adapter in {path} {reason}")

        if config.get("peft_type", "LORA") != "LORA":
            raise refuse(f"is a {config['peft_type']} adapter: only LORA adapters are supported")
        rank = config.get("r")
        if not isinstance(rank, int) or rank < 1:
            raise refuse(f"has r={rank!r}: the rank must be a positive integer")
        if rank > self.max_rank:
            raise refuse(f"has rank {rank}, above max_lora_rank={self.max_rank}: start the engine with a larger one")
        unsupported = [
            ("use_dora", config.get("use_dora"), "DoRA"),
            ("rank_pattern", config.get("rank_pattern"), "per-module ranks"),
            ("alpha_pattern", config.get("alpha_pattern"), "per-module alphas"),
            ("modules_to_save", config.get("modules_to_save"), "fully trained modules"),
            ("fan_in_fan_out", config.get("fan_in_fan_out"), "transposed (Conv1D) weights"),
            ("lora_bias", config.get("lora_bias"), "LoRA biases"),
        ]
        for key, value, what in unsupported:
            if value:
                raise refuse(f"sets {key}: {what} are not supported")
        if config.get("bias", "none") != "none":
            raise refuse(f"sets bias={config['bias']!r}: only bias='none' is supported")
        targets = config.get("target_modules")
        # A string is a regular expression over module names: the matrices the file holds tell what it targets.
        names = [targets] if isinstance(targets, str) and targets in ADAPTABLE else targets
        if isinstance(names, list):
            bad = [t for t in names if t not in ADAPTABLE]
            if bad:
                raise refuse(f"targets {bad}: only {', '.join(ADAPTABLE)} can be adapted")
        alpha = config.get("lora_alpha", rank)
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        return rank, scale, names if isinstance(names, list) else []


def adapter_content(directory: Path) -> str:
    """The hash of an adapter directory's ``adapter_config.json`` and weights file: what makes two loads the same.

    Raises:
        InvalidRequestError: ``directory`` is not a directory holding both files, or one cannot be read (field
            ``path``).

    """
    if not directory.is_dir():
        raise InvalidRequestError("path", f"{directory} is not a directory (a PEFT adapter directory is expected)")
    config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    missing = [file.name for file in (config_file, weights_file) if not file.is_file()]
    if missing:
        raise InvalidRequestError(
            "path", f"{directory} is not a PEFT adapter directory: it lacks {' and '.join(missing)}"
        )
    digest = hashlib.sha256()
    try:
        for file in (config_file, weights_file):
            with file.open("rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
    except OSError as e:
        raise InvalidRequestError("path", f"{directory}: {e}") from e
    return digest.hexdigest()


def _projection_layout(config: CheckpointConfig, attr: str) -> tuple[int, int, list[int]]:
    """``(out_features, in_features, each part's end column)`` of one of our adapted projections."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "qkv_proj": (q_size + 2 * kv_size, hidden, [q_size, q_size + kv_size, q_size + 2 * kv_size]),
        "o_proj": (hidden, q_size, [hidden]),
        "gate_up_proj": (2 * intermediate, hidden, [intermediate, 2 * intermediate]),
        "down_proj": (hidden, intermediate, [hidden]),
    }[attr]
