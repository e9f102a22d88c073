"""The request defaults a model's ``generation_config.json`` sets, as vLLM's ``--generation-config`` reads them.

vLLM takes six fields of the file (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, and
``max_new_tokens`` as ``max_tokens``) as the defaults of requests that leave them unset, after
``--override-generation-config`` changed them; every other field (``do_sample``, ``eos_token_id``, ...) is ignored
here (the tokenizer reads the eos ids). This module reads and checks them; it runs in the frontend and never imports
torch.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from spindle.shared import SamplingParams

FILE_NAME = "generation_config.json"

GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""Each ``generation_config.json`` field that becomes a request default, and the ``SamplingParams`` field it sets."""


def parse_override(text: str | None) -> dict[str, Any]:
    """The ``--override-generation-config`` JSON object (``{}`` when unset).

    Its keys are ``generation_config.json`` field names (:data:`GENERATION_CONFIG_FIELDS`); an unknown one is refused
    rather than dropped, so that a typo does not go unnoticed.

    Raises:
        ValueError: the text is not a JSON object, or it has another key.

    """
    if text is None:
        return {}
    try:
        override = json.loads(text)
    except ValueError as error:
        raise ValueError(
            f"--override-generation-config is not JSON ({error}): give e.g. '{{\"temperature\": 0.5}}'"
        ) from error
    if not isinstance(override, dict):
        raise ValueError(f"--override-generation-config must be a JSON object, not {text!r}")
    unknown = sorted(set(override) - set(GENERATION_CONFIG_FIELDS))
    if unknown:
        raise ValueError(
            f"--override-generation-config has {unknown[0]!r}, which is not a default it can set "
            f"(it takes {', '.join(GENERATION_CONFIG_FIELDS)})"
        )
    return override


def read_generation_config(source: str, model_files: Mapping[str, bytes]) -> dict[str, Any]:
    """The generation config that ``--generation-config source`` names, as a dict (``{}`` for none).

    Args:
        source: ``auto`` (the model's own file, from ``model_files``; none is ``{}``), ``vllm`` (none: Spindle's
            own defaults) or a directory whose ``generation_config.json`` is read.
        model_files: the model directory's files by name (the tokenizer files of the backend's handshake).

    Raises:
        ValueError: the directory has no ``generation_config.json``, or a file is not a JSON object.

    """
    if source == "vllm":
        return {}
    if source == "auto":
        raw, origin = model_files.get(FILE_NAME), f"the model's {FILE_NAME}"
        if raw is None:
            return {}
    else:
        path = Path(source) / FILE_NAME
        if not path.is_file():
            raise ValueError(f"--generation-config {source!r}: there is no {path} (give auto, vllm or a directory)")
        raw, origin = path.read_bytes(), str(path)
    try:
        config = json.loads(raw)
    except ValueError as error:
        raise ValueError(f"{origin} is not JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{origin} is not a JSON object")
    return config


def default_sampling_params(
    source: str, model_files: Mapping[str, bytes], override: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``SamplingParams`` defaults of requests: the generation config's fields, ``override`` applied on top.

    Args:
        source: where the generation config comes from (see :func:`read_generation_config`).
        model_files: the model directory's files by name.
        override: generation config fields that replace the file's (``--override-generation-config``).

    Returns:
        ``SamplingParams`` field name to value, for the fields set (a ``null`` in the file or the override sets
        none).

    Raises:
        ValueError: the generation config cannot be read, or a value is not one ``SamplingParams`` takes.

    """
    config = read_generation_config(source, model_files) | dict(override or {})
    defaults = {name: config[key] for key, name in GENERATION_CONFIG_FIELDS.items() if config.get(key) is not None}
    try:  # msgspec checks the types (a JSON 1 is a float here, "hot" is not), then SamplingParams the ranges
        params = msgspec.convert(defaults, SamplingParams)
    except (msgspec.ValidationError, ValueError) as error:
        raise ValueError(
            f"the generation config's defaults {defaults} are not valid sampling parameters: {error}"
        ) from error
    return {name: getattr(params, name) for name in defaults}
