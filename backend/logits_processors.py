"""Logits processors: code the server registers by name, which requests select with JSON arguments.

No code crosses the wire: a request names a processor and gives its arguments
(:class:`~spindle.shared.sampling_params.LogitsProcessorSpec`), and the backend builds it from the class registered
under that name. A processor class is built with the arguments as keywords, once per request, and then called on each
of the request's rows at every step, after the token restrictions and the logprobs, before the logit bias and the
penalties: ``processor(prompt_token_ids, output_token_ids, logits) -> logits``, ``logits`` a row over the vocabulary
(float32, on the model's device), which it may change in place and return.

Classes come from three places, later ones replacing earlier ones of the same name: Spindle's own
(:data:`BUILTIN_LOGITS_PROCESSORS`), the ``spindle.logits_processors`` entry point group of installed packages, and
``--logits-processor NAME=module:Class`` (``logits_processors`` in :class:`~spindle.shared.config.SamplingConfig`).
"""

import importlib
import logging
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Protocol

import torch

from spindle.shared.errors import InvalidRequestError
from spindle.shared.sampling_params import LogitsProcessorSpec

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "spindle.logits_processors"
"""The entry point group whose entries (``name = "module:Class"``) register logits processors."""


class LogitsProcessor(Protocol):
    """What a registered class's instances are: called on one row's logits at each step of its request."""

    def __call__(self, prompt_token_ids: list[int], output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The row's logits, processed (``logits`` may be changed in place and returned)."""


class NoRepeatNGram:
    """Never repeat an n-gram of the prompt and output, as transformers' ``no_repeat_ngram_size`` does.

    Args:
        ngram_size: the n-gram length (at least 1): a token that would complete an n-gram already in the sequence
            gets ``-inf``.

    """

    def __init__(self, ngram_size: int) -> None:
        if not isinstance(ngram_size, int) or isinstance(ngram_size, bool) or ngram_size < 1:
            raise ValueError(f"ngram_size must be an integer >= 1, not {ngram_size!r}")
        self.ngram_size = ngram_size

    def __call__(self, prompt_token_ids: list[int], output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Mask the tokens that follow the sequence's last ``ngram_size - 1`` tokens wherever they occurred before."""
        tokens = prompt_token_ids + output_token_ids
        n = self.ngram_size
        if len(tokens) + 1 < n:
            return logits
        prefix = tuple(tokens[len(tokens) - n + 1 :]) if n > 1 else ()
        banned = {tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tuple(tokens[i : i + n - 1]) == prefix}
        if banned:
            logits[list(banned)] = float("-inf")
        return logits


BUILTIN_LOGITS_PROCESSORS: dict[str, Callable[..., LogitsProcessor]] = {"no_repeat_ngram": NoRepeatNGram}
"""Spindle's own processors, by name."""


def load_class(path: str, name: str) -> Callable[..., LogitsProcessor]:
    """The class ``module:Class`` names.

    Raises:
        ValueError: ``path`` is not ``module:Class``, or does not import.

    """
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"logits processor {name!r}: {path!r} is not module:Class")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"logits processor {name!r}: {path} does not import ({error})") from error


class LogitsProcessors:
    """The registered processors, and the instances of the requests that use them (the sampler's).

    Args:
        configured: ``name -> "module:Class"`` given to the server (``--logits-processor``).

    Raises:
        ValueError: a configured or entry point class does not import.

    """

    def __init__(self, configured: Mapping[str, str] | None = None) -> None:
        self.classes: dict[str, Callable[..., LogitsProcessor]] = dict(BUILTIN_LOGITS_PROCESSORS)
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            self.classes[entry.name] = load_class(entry.value, entry.name)
        for name, path in (configured or {}).items():
            self.classes[name] = load_class(path, name)
        # The classes whose processors have failed: each is logged once (a broken class fails every request).
        self._failed: set[type] = set()

    def build(self, specs: list[LogitsProcessorSpec]) -> list[LogitsProcessor]:
        """Instances of the processors ``specs`` select, in order.

        Raises:
            InvalidRequestError: a name no class is registered under, or arguments its class refuses (field
                ``sampling_params.logits_processors[i]``).

        """
        processors = []
        for i, spec in enumerate(specs):
            field = f"sampling_params.logits_processors[{i}]"
            cls = self.classes.get(spec.name)
            if cls is None:
                known = ", ".join(sorted(self.classes))
                raise InvalidRequestError(field, f"no logits processor is registered as {spec.name!r} (known: {known})")
            try:
                processors.append(cls(**spec.args))
            except Exception as error:  # the arguments, as the class sees them: the request's fault
                raise InvalidRequestError(
                    field, f"logits processor {spec.name!r} refused its arguments {spec.args}: {error}"
                ) from None
        return processors

    def apply(
        self, processors: list[LogitsProcessor], prompt: list[int], output: list[int], logits: torch.Tensor
    ) -> torch.Tensor:
        """One row's logits through its request's processors.

        A processor that raises leaves the row as it was, and the first failure of its class is logged: its request
        samples on, unprocessed, and the batch's other rows are not touched.
        """
        for processor in processors:
            try:
                logits = processor(prompt, output, logits)
            except Exception:
                if type(processor) not in self._failed:
                    self._failed.add(type(processor))
                    logger.exception(
                        "Logits processor %s failed: the row is left unprocessed", type(processor).__name__
                    )
        return logits
