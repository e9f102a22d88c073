"""What the frontend and the engine core exchange: requests in, per-step token deltas out (token ids only).

In one process, ``LLMEngine`` calls :class:`~spindle.backend.engine_core.EngineCore` with these structs directly; across
processes they travel over one ZeroMQ DEALER (frontend) / ROUTER (backend) socket pair as msgpack (msgspec tagged
unions, never pickle). Token ids stay plain msgpack integer arrays: measured with msgspec, encoding a 4,000-token
prompt takes ~17 us as a list against ~117 us through a little-endian buffer, and decoding costs the same either
way once the ids are back in the Python list the scheduler needs, so raw buffers would not be faster here. Image
pixels travel as raw little-endian float32 bytes (msgpack ``bin``), which decode without a copy per value.
"""

import enum
import hashlib
from typing import ClassVar

import msgspec
import numpy as np

from spindle.shared.errors import (
    AlreadyExistsError,
    EngineUnavailableError,
    InvalidRequestError,
    NotFoundError,
    RequestRefusedError,
    ResourceExhaustedError,
)
from spindle.shared.lora import LoraAdapterInfo
from spindle.shared.outputs import FinishReason, TokenLogprobs
from spindle.shared.pooling_params import PoolingParams
from spindle.shared.sampling_params import SamplingParams

PROTOCOL_VERSION = 9
"""Bumped on every incompatible change; a backend refuses a frontend that speaks another version."""

HEARTBEAT_INTERVAL = 0.25
"""Seconds between the backend's heartbeats, sent from its I/O thread even while a long step runs."""

HEARTBEAT_TIMEOUT = 1.5
"""Seconds of silence after which a frontend declares the backend dead (so death is noticed within 2 s)."""

FRONTEND_TIMEOUT = 2.0
"""Seconds of silence after which the backend declares a frontend lost and aborts its requests."""


class ImageInput(msgspec.Struct, array_like=True):
    """One image of a prompt, preprocessed by the frontend, and the placeholder tokens its embeddings replace.

    ``pixels`` holds the model's input (resized, cropped, normalised) as little-endian float32 values in C order of
    ``shape`` (``[channels, height, width]``). Its placeholder is ``prompt_token_ids[offset:offset + length]``:
    ``length`` image tokens, one per embedding the model's vision encoder gives the image. ``content_hash`` (SHA-256
    of the shape and the pixels) keys the prefix cache's blocks that hold the placeholder, so requests with the same
    image share them and different images never do. Build one with :meth:`from_pixels`.
    """

    pixels: bytes
    shape: list[int]
    offset: int
    length: int
    content_hash: bytes

    @classmethod
    def from_pixels(cls, pixels: np.ndarray, offset: int, length: int) -> "ImageInput":
        """The image of the array ``pixels`` (``[channels, height, width]``, any float dtype) at its placeholder."""
        data = np.ascontiguousarray(pixels, dtype="<f4")
        shape = list(data.shape)
        digest = hashlib.sha256(np.asarray(shape, dtype="<i8").tobytes() + data.tobytes()).digest()
        return cls(data.tobytes(), shape, offset, length, digest)

    def overlaps(self, start: int, end: int) -> bool:
        """Whether the placeholder holds any of the prompt positions ``[start, end)``."""
        return self.offset < end and start < self.offset + self.length

    def array(self) -> np.ndarray:
        """The pixels as a read-only float32 array of ``shape`` (a view of ``pixels``)."""
        return np.frombuffer(self.pixels, dtype="<f4").reshape(self.shape)


class PromptEmbeds(msgspec.Struct, array_like=True):
    """A prompt's input embeddings: little-endian float32 values of ``shape`` (``[tokens, hidden_size]``), C order.

    The request's prompt token ids are placeholders (:data:`EMBEDS_PLACEHOLDER`), one per row; ``content_hash``
    (SHA-256 of the shape and the values) keys the prefix cache's blocks, so requests share the KV of the same
    embeddings only. Build one with :meth:`from_array`.
    """

    data: bytes
    shape: list[int]
    content_hash: bytes

    @classmethod
    def from_array(cls, values: np.ndarray) -> "PromptEmbeds":
        """The embeddings of the ``[tokens, hidden_size]`` array ``values`` (any float dtype)."""
        data = np.ascontiguousarray(values, dtype="<f4")
        shape = list(data.shape)
        digest = hashlib.sha256(b"spindle-prompt-embeds\0" + np.asarray(shape, dtype="<i8").tobytes() + data.tobytes())
        return cls(data.tobytes(), shape, digest.digest())

    def array(self) -> np.ndarray:
        """The embeddings as a read-only float32 array of ``shape`` (a view of ``data``)."""
        return np.frombuffer(self.data, dtype="<f4").reshape(self.shape)


EMBEDS_PLACEHOLDER = 0
"""The token id a prompt of embeddings has at each of its positions (the model reads the embeddings instead)."""


class ResumedCompletion(msgspec.Struct, array_like=True):
    """One completion of a resumed request: its index and the tokens it had generated when its backend died."""

    index: int
    token_ids: list[int]


class EngineRequest(msgspec.Struct):
    """A tokenized request handed to the engine core.

    ``priority`` orders it under the priority policy (lower first); ``lora_name`` names the LoRA adapter it
    generates with (``None``: the base model). With ``pooling`` set it is an embedding request: the engine prefills
    the prompt, pools its hidden states and finishes it, generating nothing (``params`` is then unused). ``images``
    are the prompt's images in prompt order, each at its placeholder tokens (a vision-language model only);
    ``prompt_embeds`` the embeddings of a prompt given as embeddings, whose token ids are then placeholders.
    ``grammar_after``, for a constrained request of a reasoning model, is the end of its thinking block (the token ids
    of ``</think>``): the output is free until it writes them, and its structured output constrains what follows.

    ``resumed`` makes it a request that a dead backend held, sent again: only the completions it lists run, each
    after the tokens it had generated, which the engine takes as that completion's output so far, not as prompt (its
    ``max_tokens`` and ``min_tokens``, penalties, stop conditions, seeded draws and grammar count them), so that it
    goes on as it would have; the completions it leaves out had finished. ``None``: a new request, all ``n`` run.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    lora_name: str | None = None
    pooling: PoolingParams | None = None
    images: list[ImageInput] = []
    resumed: list[ResumedCompletion] | None = None
    prompt_embeds: PromptEmbeds | None = None
    grammar_after: list[int] | None = None

    @property
    def indices(self) -> list[int]:
        """The indices of the completions the engine runs for it: all ``n``, or the ones a resumed request lists."""
        if self.resumed is None:
            return list(range(self.params.n))
        return [completion.index for completion in self.resumed]


class SequenceDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did for one completion of a request: its new tokens and, at the end, why it finished.

    ``prompt_logprobs`` comes once, with the first generated token. ``finish_reason`` is a :class:`FinishReason`:
    ``STOP`` (eos or a stop token, named by ``stop_reason`` for the latter), ``LENGTH`` or ``ABORT``; it travels as
    its string value, and any other string fails to decode. An embedding request's one delta carries no tokens, its
    pooled embedding in ``embedding`` (little-endian float32 values) and ``finish_reason`` ``STOP``.
    ``num_draft_tokens`` counts the draft tokens (speculative decoding) this step verified for the completion,
    ``num_accepted_draft_tokens`` those the model agreed with.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    embedding: bytes | None = None
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


class KvBlockStored(msgspec.Struct, tag="stored", array_like=True):
    """A full KV block got its hash and entered the prefix cache.

    ``block_hash`` and ``parent_hash`` are the SHA-256 chain's digests folded to signed 64-bit integers
    (:func:`~spindle.shared.block_hash.fold_hash`); ``parent_hash`` is ``None`` for a prompt's first block.
    ``token_ids`` are the block's tokens; ``lora_id`` and ``lora_name`` the LoRA adapter whose root the chain starts
    from (``None``: the base model).
    """

    block_hash: int
    parent_hash: int | None
    token_ids: list[int]
    lora_id: int | None = None
    lora_name: str | None = None


class KvBlockRemoved(msgspec.Struct, tag="removed", array_like=True):
    """A cached block's hash was dropped: the block was handed out again for other tokens."""

    block_hash: int


class KvCacheCleared(msgspec.Struct, tag="cleared", array_like=True):
    """Every cached block's hash was dropped (the prefix cache was reset), or the events start over from here."""


KvEvent = KvBlockStored | KvBlockRemoved | KvCacheCleared
"""What the block manager reports of its prefix cache (:meth:`~spindle.backend.block_manager.BlockManager.pop_events`)
to the frontends that subscribed (:class:`SubscribeKvEvents`)."""


def parents_first(blocks: list[KvBlockStored]) -> list[KvBlockStored]:
    """``blocks`` (one chain's or many) ordered so that each comes after its parent, when its parent is among them.

    A parent evicted and stored again is newer than its children, so the order blocks were stored in will not do.
    """
    by_hash = {block.block_hash: block for block in blocks}
    depth: dict[int, int] = {}
    for block in blocks:
        chain = []
        node: KvBlockStored | None = block
        while node is not None and node.block_hash not in depth:
            chain.append(node)
            node = by_hash.get(node.parent_hash) if node.parent_hash is not None else None
        base = depth[node.block_hash] if node is not None else 0
        for offset, link in enumerate(reversed(chain), 1):
            depth[link.block_hash] = base + offset
    return sorted(blocks, key=lambda block: depth[block.block_hash])


class EngineStats(msgspec.Struct, array_like=True):
    """The scheduler's and the KV cache's state after a step, and counts since the backend started.

    ``num_accepted_draft_tokens / num_draft_tokens`` is the acceptance rate of the draft tokens (speculative decoding)
    verified so far; ``num_prefix_cache_hits / num_prefix_cache_queries`` the prefix cache's hit rate, in tokens: the
    tokens of the sequences admitted to the batch, and those of them whose K/V was found cached;
    ``num_paused_requests`` the requests their frontends paused (:class:`Pause`), whose sequences ``num_running`` and
    ``num_waiting`` count too; ``lora_adapters`` names the LoRA adapters loaded (resident on the host, whether in a
    device slot or not). New fields go at the end with a default, so that a frontend and a backend one field
    apart still decode each other's stats.
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_paused_requests: int = 0
    lora_adapters: list[str] = []


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, element_bytes: int) -> int:
    """Bytes of one KV cache block over all layers: 2 (K, V) x layers x KV heads x head size x block size x value."""
    return 2 * num_layers * num_kv_heads * head_dim * block_size * element_bytes


class KVCacheReport(msgspec.Struct, frozen=True):
    """How cache initialisation sized the KV cache: the arithmetic's inputs and its result (:doc:`cache`).

    The backend's :meth:`~spindle.backend.model_runner.ModelRunner.init_cache` fills it once, before the engine
    serves (vLLM's ``LLMEngine._init_cache``); :attr:`~spindle.frontend.engine.llm_engine.LLMEngine.kv_cache_report`
    shows it, and :meth:`explain` writes the maths out.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        dtype: the cache's element type (the model's).
        num_layers: layers, each with a K and a V tensor.
        num_kv_heads: KV heads a layer holds (under tensor parallelism, one rank's share).
        head_dim: values per head.
        block_size: tokens per block.
        element_bytes: bytes per value of ``dtype``.
        budget_bytes: what the cache may take: ``kv_cache_memory`` on the CPU; on CUDA this engine's share of the
            device less this process's own use (the terms are in ``device_terms``).
        num_blocks: the blocks allocated: ``budget_bytes // block_bytes`` (under tensor parallelism, the fewest any
            rank could hold).
        max_model_len: the longest sequence the engine takes.
        device_terms: on CUDA, the budget's terms in bytes (``total``, ``share`` = ``gpu_memory_utilization`` x
            total, ``torch_peak``: weights and the largest step's activations, ``outside_torch``, ``graph_pool``);
            empty on the CPU.

    """

    device: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    element_bytes: int
    budget_bytes: int
    num_blocks: int
    max_model_len: int
    device_terms: dict[str, int] = {}

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (:func:`kv_block_bytes`)."""
        return kv_block_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.element_bytes)

    @property
    def num_tokens(self) -> int:
        """Tokens of context the cache holds, over all sequences."""
        return self.num_blocks * self.block_size

    @property
    def full_sequences(self) -> float:
        """How many sequences of ``max_model_len`` tokens fit at once (shorter ones share the blocks)."""
        return self.num_blocks / -(-self.max_model_len // self.block_size)

    def explain(self) -> str:
        """The sizing written out, one line per step of the arithmetic."""
        terms = self.device_terms
        if terms:
            budget = (
                f"budget = share {terms['share']:,} (gpu_memory_utilization x {terms['total']:,}) - torch peak "
                f"{terms['torch_peak']:,} - outside torch {terms['outside_torch']:,} - CUDA graphs "
                f"{terms['graph_pool']:,} = {self.budget_bytes:,} bytes"
            )
        else:
            budget = f"budget = kv_cache_memory = {self.budget_bytes:,} bytes"
        fit = max(0, self.budget_bytes // self.block_bytes)
        ranks = "" if self.num_blocks == fit else f" (the fewest any rank holds: {self.num_blocks:,})"
        return "\n".join(
            (
                f"KV cache on {self.device}, {self.dtype}: {self.num_blocks:,} blocks x {self.block_size} tokens = "
                f"{self.num_tokens:,} tokens",
                f"block_bytes = 2 (K, V) x {self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim} "
                f"head_dim x {self.block_size} tokens x {self.element_bytes} bytes = {self.block_bytes:,}",
                budget,
                f"num_blocks = {self.budget_bytes:,} // {self.block_bytes:,} = {fit:,}{ranks}",
                f"max_model_len={self.max_model_len} takes {-(-self.max_model_len // self.block_size)} blocks: "
                f"{self.full_sequences:.1f} such sequences fit at once",
            )
        )


class EngineInfo(msgspec.Struct):
    """What a frontend needs to know about the engine it talks to (the backend's side of the handshake).

    ``runtime_lora_dir`` is the directory the backend loads adapters from at run time when a frontend asks for a
    confined :class:`LoadLora` (it runs with ``allow_runtime_lora``); ``None`` when it refuses them. The engine core
    sets it from its configuration, as the policy belongs to the process that reads the files. ``step_timeout`` is
    how long one turn of the backend's step loop may last before its frontends declare it hung (see
    :func:`hung_reason`), ``max_message_size`` the largest message the backend takes (``None``: no limit said),
    ``max_loras`` the adapters one step may use (0 from a backend that does not say). ``architectures`` are the
    model's (``config.json``), ``kv_medium`` where its KV cache lives (``"GPU"`` or ``"CPU"``), ``boot_id`` an id
    of this backend's start, different for every start (a frontend tells a restarted backend by it), and ``kv_cache``
    how its cache was sized (``None`` from a backend that does not say).
    """

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
    tokenizer_files: dict[str, bytes]
    runtime_lora_dir: str | None = None
    step_timeout: float | None = None
    max_message_size: int | None = None
    max_loras: int = 0
    architectures: list[str] = []
    kv_medium: str = "GPU"
    boot_id: str = ""
    kv_cache: KVCacheReport | None = None


# Frontend -> backend.


class Hello(msgspec.Struct, tag="hello"):
    """The first message of a frontend: which protocol it speaks."""

    protocol_version: int


class FrontendHeartbeat(msgspec.Struct, tag="alive"):
    """A frontend's sign of life, naming the frontend it speaks for.

    Each frontend sends one every :data:`HEARTBEAT_INTERVAL` seconds from a thread (and socket) of its own.
    """

    frontend_id: bytes


class AddRequest(msgspec.Struct, tag="add"):
    """Queue a request."""

    request: EngineRequest


class Abort(msgspec.Struct, tag="abort"):
    """Drop requests and free their blocks."""

    request_ids: list[str]


class FinishSequence(msgspec.Struct, tag="finish"):
    """End one completion (the frontend matched a stop string) and free its blocks."""

    request_id: str
    index: int


class Pause(msgspec.Struct, tag="pause"):
    """Schedule no tokens for requests until resumed (their streams' readers lag behind); with ``resume``, again.

    A paused request keeps its KV blocks (unless another sequence needs them: it is preempted then) and is never
    ended for being paused: its frontend aborts it if its reader does not come back.
    """

    request_ids: list[str]
    resume: bool = False


class LoadLora(msgspec.Struct, tag="load_lora"):
    """Command: load the PEFT adapter at ``path`` under ``name``; its result is the adapter loaded.

    With ``confined`` (the gRPC API asks so) the engine refuses it unless it runs with ``allow_runtime_lora``, and
    takes ``path`` relative to its ``lora_dir``, refusing one that resolves outside
    (:func:`~spindle.shared.lora.confine_adapter_path`). Without, it reads ``path`` as it is: the Python engines'
    user owns the processes already.
    """

    Result: ClassVar[type] = LoraAdapterInfo

    name: str
    path: str
    confined: bool = False


class UnloadLora(msgspec.Struct, tag="unload_lora"):
    """Command: forget the adapter ``name`` (requests running with it finish); no result."""

    Result: ClassVar[type] = type(None)

    name: str


class ListLoras(msgspec.Struct, tag="list_loras"):
    """Command: which adapters are loaded? Its result lists them, in loading order."""

    Result: ClassVar[type] = list[LoraAdapterInfo]


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    """Command: drop every cached block's hash, if no request runs; its result says whether it did."""

    Result: ClassVar[type] = bool


Command = LoadLora | UnloadLora | ListLoras | ResetPrefixCache
"""The engine's control plane: what a frontend may ask of the engine core besides requests, run between two steps
(:meth:`~spindle.backend.engine_core.EngineCore.call`). Each command names its result's type as ``Result``; a new
operation is one struct here and one case of that method."""


class Call(msgspec.Struct, tag="call"):
    """Run ``command`` in the engine core; answered with a :class:`CallReply` of the same ``call_id``."""

    call_id: str
    command: Command


class SubscribeKvEvents(msgspec.Struct, tag="kv_subscribe"):
    """Send this frontend the prefix cache's events with each step's outputs (``subscribe`` false: stop).

    A subscription starts with a :class:`KvCacheCleared` and a :class:`KvBlockStored` for every block cached then
    (parents first), so that the frontend's picture of the cache is whole from the first batch. While no frontend
    subscribes, the block manager builds no event.
    """

    subscribe: bool = True


class Ping(msgspec.Struct, tag="ping"):
    """Is a backend up here? Answered with a :class:`Pong` by the backend's I/O thread, outside any frontend session.

    A probe (``spindle backend --check``) sends it from a socket of its own: unlike a :class:`Hello`, it joins
    nothing and changes nothing in the backend, so it cannot disturb the frontends being served.
    """


# Backend -> frontend.


class Ready(msgspec.Struct, tag="ready"):
    """The backend accepts the frontend."""

    protocol_version: int
    info: EngineInfo


class Refused(msgspec.Struct, tag="refused"):
    """The backend does not accept the frontend, and says why."""

    reason: str


class StepOutputs(msgspec.Struct, tag="outputs"):
    """One step's deltas for the requests of one frontend, in one message, and the step's KV events if it subscribed.

    A subscribed frontend gets one for a step that changed the cache even when none of its requests ran in it.
    """

    deltas: list[SequenceDelta]
    stats: EngineStats
    kv_events: list[KvEvent] = []


class RequestErrorKind(enum.StrEnum):
    """Which :class:`~spindle.shared.errors.RequestRefusedError` a :class:`RequestError` carries."""

    INVALID = "invalid"
    """An :class:`~spindle.shared.errors.InvalidRequestError`."""
    NOT_FOUND = "not_found"
    """A :class:`~spindle.shared.errors.NotFoundError`."""
    ALREADY_EXISTS = "already_exists"
    """An :class:`~spindle.shared.errors.AlreadyExistsError`."""
    UNAVAILABLE = "unavailable"
    """An :class:`~spindle.shared.errors.EngineUnavailableError`."""
    RESOURCE_EXHAUSTED = "resource_exhausted"
    """A :class:`~spindle.shared.errors.ResourceExhaustedError`."""
    NO_SESSION = "no_session"
    """An :class:`~spindle.shared.errors.EngineUnavailableError` because the backend has no session with the frontend
    (it restarted, or dropped the frontend after ``FRONTEND_TIMEOUT`` seconds of silence): the frontend must
    handshake again, and its requests there are gone."""


class RequestError(msgspec.Struct, tag="error"):
    """The engine core refused a request (it is not queued): the exception it raised, rebuilt by the frontend.

    ``kind`` names the exception type, ``reason`` is its message, ``fields`` the fields of an invalid request
    (its ``field`` first; empty for an unavailable engine).
    """

    request_id: str
    kind: RequestErrorKind
    reason: str
    fields: list[str] = []

    @classmethod
    def from_exception(cls, request_id: str, error: RequestRefusedError) -> "RequestError":
        """The message that carries ``error``, the refusal of request ``request_id``, to its frontend."""
        if isinstance(error, InvalidRequestError):
            kind = next(kind for kind, type_ in _INVALID_KINDS if isinstance(error, type_))
            return cls(request_id, kind, error.reason, list(error.fields))
        return cls(request_id, RequestErrorKind.UNAVAILABLE, str(error))

    def to_exception(self) -> RequestRefusedError:
        """The exception the engine core raised, of the same type, fields and message."""
        if self.kind in (RequestErrorKind.UNAVAILABLE, RequestErrorKind.NO_SESSION):
            return EngineUnavailableError(self.reason)
        field, *also = self.fields or [""]
        return dict(_INVALID_KINDS)[self.kind](field, self.reason, also=also)


# The most specific type first: the other three are InvalidRequestErrors too.
_INVALID_KINDS: list[tuple[RequestErrorKind, type[InvalidRequestError]]] = [
    (RequestErrorKind.NOT_FOUND, NotFoundError),
    (RequestErrorKind.ALREADY_EXISTS, AlreadyExistsError),
    (RequestErrorKind.RESOURCE_EXHAUSTED, ResourceExhaustedError),
    (RequestErrorKind.INVALID, InvalidRequestError),
]


class CallReply(msgspec.Struct, tag="reply"):
    """The answer to a :class:`Call` of the same ``call_id``: its result, or why the command was refused.

    ``result`` is the command's result encoded as msgpack (decode it as the command's ``Result`` type:
    :func:`decode_result`); ``error`` instead carries the refusal (its ``request_id`` is the ``call_id``), e.g. a
    :class:`~spindle.shared.errors.NotFoundError` for an unknown adapter name.
    """

    call_id: str
    result: bytes = b""
    error: RequestError | None = None


def decode_result(command: Command, reply: CallReply) -> object:
    """The result of ``command`` that ``reply`` carries, as its ``Result`` type; raises the refusal it carries instead.

    Raises:
        RequestRefusedError: the engine refused the command (of the type it raised there).

    """
    if reply.error is not None:
        raise reply.error.to_exception()
    return msgspec.msgpack.decode(reply.result, type=type(command).Result)


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Sent by the backend every :data:`HEARTBEAT_INTERVAL` seconds, so a frontend can tell it is alive.

    Its I/O thread sends it, whatever the step loop does; ``busy_for`` tells how that loop fares: the seconds its
    current turn (taking in messages, one step) has lasted so far, 0 while it waits for work.
    """

    stats: EngineStats
    busy_for: float = 0.0


class Pong(msgspec.Struct, tag="pong"):
    """The answer to a :class:`Ping`: the backend's protocol, model, and whether it is draining (after SIGTERM).

    ``busy_for`` and ``step_timeout`` are the step loop's, as in :class:`Heartbeat` and :class:`EngineInfo`: with
    them a probe sees a backend whose step loop is stuck though its I/O thread answers (:func:`hung_reason`).
    """

    protocol_version: int
    model_name: str
    draining: bool = False
    busy_for: float = 0.0
    step_timeout: float | None = None


def hung_reason(busy_for: float, step_timeout: float | None) -> str | None:
    """Why a backend whose step loop has been ``busy_for`` seconds in one turn counts as hung; ``None`` if it does not.

    It does once that turn has lasted longer than the backend's ``step_timeout``: a step stuck in a collective that
    never completes, or a kernel that never returns, while the I/O thread still answers.
    """
    if step_timeout is None or busy_for <= step_timeout:
        return None
    return f"its step loop has been in one step for {busy_for:.0f} s, over its step_timeout of {step_timeout:g} s"


FrontendMessage = (
    Hello | FrontendHeartbeat | AddRequest | Abort | FinishSequence | Call | Ping | Pause | SubscribeKvEvents
)
BackendMessage = Ready | Refused | StepOutputs | RequestError | CallReply | Heartbeat | Pong
