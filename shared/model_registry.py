"""Which class serves which model architecture: the built-in ones, plugins' and the user's own, by name.

A checkpoint's ``config.json`` names its architecture (``"architectures": ["LlamaForCausalLM"]``); the backend
serves it with the class registered under that name. A class is recorded as a ``"module:Class"`` string and imported
only when a model of its architecture is loaded, so this module imports no torch: the frontend records
registrations here, and forwards them to a backend process it starts as ``--register-model ARCH=module:Class``
flags (:meth:`ModelRegistry.backend_args`).
"""

import argparse
import importlib
import importlib.metadata
import logging
import os
import re
import sys

logger = logging.getLogger(__name__)

BUILTIN_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "spindle.backend.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "spindle.backend.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "spindle.backend.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "spindle.backend.models.qwen3:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "spindle.backend.models.phi3:Phi3ForCausalLM",
    "Gemma2ForCausalLM": "spindle.backend.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "spindle.backend.models.gemma:Gemma3ForCausalLM",
    "LlamaModel": "spindle.backend.models.llama:LlamaModel",
    "MixtralForCausalLM": "spindle.backend.models.mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "spindle.backend.models.qwen3_moe:Qwen3MoeForCausalLM",
    "LlavaForConditionalGeneration": "spindle.backend.models.llava:LlavaForConditionalGeneration",
}
"""The architectures Spindle ships, and the class that serves each (Qwen3's and Phi-3's subclass the Llama one);
``LlamaModel`` (no LM head) serves embeddings only, ``LlavaForConditionalGeneration`` (a CLIP vision tower before a
Llama-family decoder) takes images too."""

ENTRY_POINT_GROUP = "spindle.models"
"""The entry-point group of model plugins: each entry's name is an architecture, its value ``"module:Class"``."""

_NAME = r"(?!\d)\w+"
_TARGET = re.compile(rf"{_NAME}(?:\.{_NAME})*:{_NAME}(?:\.{_NAME})*")


class ModelRegistry:
    """The model classes by architecture name, as vLLM's ``ModelRegistry``: register your own to serve it.

    An architecture resolves to the class registered with :meth:`register_model` (in this process, or in a backend
    process by its ``--register-model ARCH=module:Class`` flag), else to a plugin's entry in the
    :data:`ENTRY_POINT_GROUP` entry-point group, else to a built-in class (:data:`BUILTIN_MODELS`).

    The model runner builds and drives a registered class as it does
    :class:`~spindle.backend.models.llama.LlamaForCausalLM`, so subclassing that is the easy path. The contract
    (:class:`~spindle.backend.models.interface.CausalLM`):

    - ``__init__(config, dtype)``: ``config`` is the
      :class:`~spindle.backend.models.checkpoint_config.CheckpointConfig` read from the checkpoint (the whole
      ``config.json`` is its ``hf_config`` dict); create the parameters in ``dtype`` on the current default device.
    - ``load_weights(weights)``: fill the parameters from the checkpoint's ``(name, tensor)`` pairs.
    - ``prepare_weights(quantized)``: called once after loading, before the first step; with ``--quantization``,
      ``projections()`` and ``parameter_slice(name)`` tell the loader which matrices to quantize.
    - ``forward(input_ids, positions, meta, kv_caches)``: the flat batch of new tokens ``[T]`` to hidden states
      ``[T, hidden_size]``, writing their keys and values into ``kv_caches``: one ``(k_cache, v_cache)`` a layer,
      ``[num_blocks, block_size, num_kv_heads, head_dim]`` each, sized from the config's ``num_layers``,
      ``num_kv_heads`` and ``head_dim``.
    - ``compute_logits(hidden)``: hidden states ``[N, hidden_size]`` to float32 logits ``[N, vocab_size]``.

    The registry is process-wide state, kept on the class; every method is a class method.
    """

    _registered: dict[str, str] = {}
    _classes: dict[str, type] = {}  # the class objects given to register_model, so this process never re-imports
    _plugins: dict[str, str] | None = None  # the entry points, read when first needed

    @classmethod
    def register_model(cls, architecture: str, model_cls: str | type) -> None:
        """Serve ``architecture`` with ``model_cls``, replacing what served it before (with a warning).

        Args:
            architecture: the name in the checkpoint's ``config.json`` ``architectures`` list.
            model_cls: ``"module:Class"`` (``"my_models.tiny:TinyForCausalLM"``), imported only when a model of
                this architecture is loaded; or the class itself, which this process uses as it is and another
                process imports by its ``module:qualname``.

        Raises:
            ValueError: for a string that is not ``"module:Class"``.

        """
        # A class object's name is not checked: it serves this process as it is, whatever its name.
        target, model_object = (model_cls, None) if isinstance(model_cls, str) else (_target_of(model_cls), model_cls)
        if model_object is None and not _TARGET.fullmatch(target):
            raise ValueError(
                f"cannot register architecture {architecture!r} as {target!r}: write the class as 'module:Class', "
                "e.g. 'my_models.tiny:TinyForCausalLM'"
            )
        previous = cls._lookup(architecture)
        if previous is not None and previous != target:
            logger.warning("Architecture %s, served by %s, will be served by %s", architecture, previous, target)
        cls._registered[architecture] = target
        if model_object is None:
            cls._classes.pop(architecture, None)
        else:
            cls._classes[architecture] = model_object

    @classmethod
    def get_supported_archs(cls) -> list[str]:
        """Every architecture that resolves to a class: the built-in ones, then plugins', then registered ones."""
        names = [*BUILTIN_MODELS, *cls._plugin_targets(), *cls._registered]
        return list(dict.fromkeys(names))

    @classmethod
    def get_model_cls_target(cls, architecture: str) -> str:
        """The ``"module:Class"`` that serves ``architecture``, without importing it.

        Raises:
            ValueError: for an architecture that nothing serves; the message lists those that are served.

        """
        target = cls._lookup(architecture)
        if target is None:
            raise ValueError(
                f"unsupported architecture {architecture!r}: Spindle serves {', '.join(cls.get_supported_archs())}; "
                "serve another with spindle.ModelRegistry.register_model (see the docs' 'Adding a model "
                "architecture')"
            )
        return target

    @classmethod
    def load_model_cls(cls, architecture: str) -> type:
        """Import and return the class that serves ``architecture`` (the backend's loader calls it).

        Raises:
            ValueError: for an architecture that nothing serves.
            ImportError: when the module or the class of its ``"module:Class"`` cannot be imported; the message
                names the architecture and the string.
            TypeError: when the string names something other than a class.

        """
        target = cls.get_model_cls_target(architecture)
        if architecture in cls._classes:
            return cls._classes[architecture]
        module_name, _, qualname = target.partition(":")
        where = f"architecture {architecture!r} is served by {target!r}"
        if not _TARGET.fullmatch(target):  # a plugin's value, which nothing checked before
            raise ImportError(f"{where}, which is not 'module:Class'")
        try:
            found: object = importlib.import_module(module_name)
            for name in qualname.split("."):
                found = getattr(found, name)
        except (ImportError, AttributeError) as error:
            raise ImportError(f"{where}, which cannot be imported: {error}") from error
        if not isinstance(found, type):
            raise TypeError(f"{where}, which is a {type(found).__name__}, not a class")
        return found

    @classmethod
    def register_models(cls, specs: list[str]) -> None:
        """Register each ``"ARCH=module:Class"`` of ``specs`` (the values of ``--register-model`` flags).

        Raises:
            ValueError: for a spec without ``=`` or a class that is not ``"module:Class"``.

        """
        for spec in specs:
            architecture, equals, target = spec.partition("=")
            if not equals or not architecture.strip():
                raise ValueError(f"--register-model {spec!r} is not ARCH=module:Class")
            cls.register_model(architecture.strip(), target.strip())

    @classmethod
    def backend_args(cls) -> list[str]:
        """The flags that give a ``spindle backend`` process this process's registrations (built-ins need none).

        Raises:
            ValueError: for a class that another process cannot import: one defined in a script run as a file
                (module ``__main__``) or inside a function.

        """
        argv = []
        for architecture, target in cls._registered.items():
            module_name, _, qualname = target.partition(":")
            if module_name == "__main__" or "<locals>" in qualname:
                raise ValueError(
                    f"architecture {architecture!r} is served by {target!r}, which a backend process cannot import: "
                    "define the class at the top of an importable module"
                )
            argv += ["--register-model", f"{architecture}={target}"]
        return argv

    @classmethod
    def _lookup(cls, architecture: str) -> str | None:
        registered = cls._registered.get(architecture) or cls._plugin_targets().get(architecture)
        return registered or BUILTIN_MODELS.get(architecture)

    @classmethod
    def _plugin_targets(cls) -> dict[str, str]:
        if cls._plugins is None:
            cls._plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        return cls._plugins


def _target_of(model_cls: type) -> str:
    """``"module:qualname"`` of a class; a script run with ``python -m`` names its module rather than ``__main__``."""
    module_name = model_cls.__module__
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if module_name == "__main__" and main_spec is not None:
        module_name = main_spec.name
    return f"{module_name}:{model_cls.__qualname__}"


def add_register_model_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--register-model ARCH=module:Class`` (repeatable; ``SPINDLE_REGISTER_MODEL``, comma-separated)."""
    default = [spec.strip() for spec in os.environ.get("SPINDLE_REGISTER_MODEL", "").split(",") if spec.strip()]
    parser.add_argument(
        "--register-model",
        action="append",
        default=default,
        metavar="ARCH=module:Class",
        help="serve architecture ARCH with the class module:Class (importable by the backend); repeatable",
    )
