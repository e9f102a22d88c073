"""Why a request was refused, as types: both processes raise them, the gRPC server maps each to one status code.

A refused request left nothing queued. :class:`InvalidRequestError` is a :class:`ValueError` (the request itself is
wrong: fix it before sending it again), :class:`EngineUnavailableError` a :class:`RuntimeError` (the request may be
fine, but this engine takes no new ones: send it to another replica).

Field names follow the gRPC API: an :attr:`InvalidRequestError.field` is the path of the field in a
``GenerateRequest`` or ``ChatRequest``, with ``[i]`` for an element of a repeated field, as ``google.rpc.BadRequest``
field violations write it: ``prompt``, ``prompt.text``, ``prompt.token_ids[3]``, ``prompt.multi_modal_data``,
``messages``, ``messages[0].content``, ``sampling_params.temperature``, ``request_id``. The Python API's arguments
map to them one to one: ``prompt.text`` is a :class:`~spindle.shared.TextPrompt`'s ``prompt``, ``prompt.token_ids`` a
:class:`~spindle.shared.TokensPrompt`'s ``prompt_token_ids``, ``sampling_params.X`` is ``SamplingParams.X``.
"""

from collections.abc import Sequence


class RequestRefusedError(Exception):
    """The engine did not accept a request; nothing of it was queued. The base of the two kinds below."""


class InvalidRequestError(RequestRefusedError, ValueError):
    """A request field has a value the engine cannot take; ``str(error)`` says which, why, and how to fix it.

    Args:
        field: the field at fault, named as the gRPC API names it (see the module docstring).
        reason: the human message: the field, the value given and what would be accepted.
        also: further fields that share the fault (``sampling_params.max_tokens`` next to a ``prompt`` too long
            for the context with it).

    Attributes:
        field: the field at fault.
        reason: the human message (also ``str(error)``).
        fields: ``field`` followed by ``also``: one ``google.rpc.BadRequest`` field violation each.

    """

    def __init__(self, field: str, reason: str, *, also: Sequence[str] = ()) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason
        self.fields = (field, *also)

    def __reduce__(self) -> tuple:
        # Exceptions pickle (and copy) by calling the class with ``args``; ours takes more than the message.
        return _rebuild_invalid, (self.fields, self.reason)


def _rebuild_invalid(fields: tuple[str, ...], reason: str) -> InvalidRequestError:
    return InvalidRequestError(fields[0], reason, also=fields[1:])


class EngineUnavailableError(RequestRefusedError, RuntimeError):
    """The engine is draining or shutting down and takes no new requests: retry them on another replica."""


class NotFoundError(InvalidRequestError, LookupError):
    """A request names something the engine does not have (a LoRA adapter): gRPC ``NOT_FOUND``.

    An :class:`InvalidRequestError` too, naming the field that holds the name (``lora_name``), so that code
    catching invalid requests catches it.
    """


class AlreadyExistsError(InvalidRequestError):
    """A request would create something under a name already taken (a LoRA adapter): gRPC ``ALREADY_EXISTS``."""


class ResourceExhaustedError(InvalidRequestError):
    """A request would take the engine past one of its limits (loaded LoRA adapters): gRPC ``RESOURCE_EXHAUSTED``.

    An :class:`InvalidRequestError` too, naming the field of what would not fit (``name`` of an adapter to load), so
    that code catching invalid requests catches it; the request may succeed once something is freed.
    """


class OutputProcessingError(RuntimeError):
    """The frontend could not turn one request's model output into its outputs: a bug, which ends that request alone.

    The request was aborted in the engine (its KV blocks freed) and the error logged with its id and traceback; the
    other requests of the step went on. The gRPC server answers ``INTERNAL``. The message leaves the id out, as the
    caller knows its request by its own id (the gRPC server scopes ids to the caller's connection).

    Args:
        request_id: the request that failed.
        cause: what its processing raised.

    Attributes:
        request_id: the request that failed.

    """

    def __init__(self, request_id: str, cause: Exception) -> None:
        super().__init__(
            f"the output of this request could not be processed ({type(cause).__name__}: {cause}), so it "
            "was aborted; other requests were not affected. This is a bug in Spindle: please report it with the "
            "server's log, which has its traceback under the request's id"
        )
        self.request_id = request_id
        self.__cause__ = cause
