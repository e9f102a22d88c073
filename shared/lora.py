"""LoRA adapters as requests name them: which adapter a request uses, what an engine has loaded, where it may read.

:func:`confine_adapter_path` is the check behind the gRPC ``LoadLoraAdapter`` call: a caller names a directory, and
the server reads it only if it lies in the operator's ``lora_dir``. The backend process runs it, since it is the one
that reads the files (the frontend may run in another container, where the same path resolves to something else).
"""

import os
from pathlib import Path

import msgspec

from spindle.shared.errors import InvalidRequestError


class LoRARequest(msgspec.Struct):
    """The LoRA adapter a request generates with, as in vLLM (``LLM.generate(..., lora_request=...)``).

    vLLM's positional form, ``LoRARequest("sql", 1, "/adapters/sql")``, works as it is.

    Attributes:
        lora_name: the adapter's name; requests naming it share its weights.
        lora_int_id: accepted for vLLM's signature and otherwise unused: Spindle knows adapters by name.
        lora_path: a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``). The Python
            engines load it under ``lora_name`` on first use; ``None`` names an adapter loaded already (at start-up
            with ``lora_modules``, or with ``load_lora``).

    """

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None

    def __post_init__(self) -> None:
        check_lora_name(self.lora_name, "lora_name")


class LoraAdapterInfo(msgspec.Struct, array_like=True):
    """One adapter an engine has loaded.

    Attributes:
        name: what requests call it.
        path: where it was loaded from, as the backend sees it.
        rank: its rank ``r``.
        target_modules: the projections it adapts (``q_proj``, ``down_proj``, ...).

    """

    name: str
    path: str
    rank: int
    target_modules: list[str]


def check_lora_name(name: str, field: str = "name") -> None:
    """Refuse an empty adapter name (it would mean the base model where requests name adapters).

    Raises:
        InvalidRequestError: ``name`` is empty or only whitespace (the fault is in ``field``).

    """
    if not name.strip():
        raise InvalidRequestError(field, f"{field} is empty: name the LoRA adapter")


def check_same_adapter(request: LoRARequest, adapter: LoraAdapterInfo) -> None:
    """Refuse ``request`` if its ``lora_path`` is not where the adapter of its name was loaded from.

    Raises:
        InvalidRequestError: the paths differ once resolved (field ``lora_name``: the name is taken).

    """
    if request.lora_path is not None and os.path.realpath(request.lora_path) != os.path.realpath(adapter.path):
        raise InvalidRequestError(
            "lora_name",
            f"LoRA adapter {adapter.name!r} is loaded from {adapter.path}, not {request.lora_path}: give this adapter "
            "another name, or unload the other one first",
        )


def confine_adapter_path(path: str, lora_dir: str) -> Path:
    """``path`` resolved, symbolic links and all, if it lies in ``lora_dir``; a relative ``path`` is taken from there.

    Resolving first is what makes the check hold: ``../other`` or a link inside the directory that points out of
    it resolves to a path outside, and is refused. The result has no links left, so the files read are the ones
    checked.

    Args:
        path: the adapter directory a caller named, relative to ``lora_dir`` or absolute.
        lora_dir: the directory the operator allows adapters to be read from.

    Raises:
        InvalidRequestError: ``path`` is empty or resolves outside ``lora_dir`` (field ``path``). The message does not
            say where it resolves to: that would tell a caller about the server's files.

    """
    if not path.strip():
        raise InvalidRequestError("path", "path is empty: name the adapter's directory, relative to the adapter dir")
    root = Path(lora_dir).resolve()
    resolved = (root / path).resolve()  # an absolute path replaces the root in the join
    if not resolved.is_relative_to(root):
        raise InvalidRequestError(
            "path",
            f"path {path!r} is outside the server's adapter directory: give a path relative to it (or absolute "
            "inside it), without '..' or symbolic links that lead out of it",
        )
    return resolved
