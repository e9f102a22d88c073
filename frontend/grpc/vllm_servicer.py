"""``vllm.grpc.engine.VllmEngine``, the vLLM engine protocol that gateways (SMG, the inference gateway) route over.

The messages come from the ``smg-grpc-proto`` package. The service runs over the same engine, admission control,
connection-scoped request ids, limits and status codes as ``spindle.v1`` (``SpindleServicer``, whose ``status_for``
chooses every error's code). Token ids go in and out: the gateway tokenizes and detokenizes.

``Generate`` with ``stream`` sends a ``chunk`` per completion and step (its new token ids, with ``index``), then a
``complete`` per completion as it ends (finish reason, matched stop, token counts, ``cached_tokens``; its
``output_ids`` are empty, as the chunks carried them); without ``stream``, one ``complete`` per completion once all
have ended, with every token id. A field that Spindle cannot honour (KV transfer params, multimodal inputs, media
refs, a data-parallel rank) is refused with ``INVALID_ARGUMENT`` naming it, never dropped.
``GetTokenizer`` streams the tokenizer files the frontend loaded, as one zip archive. ``Embed`` pools a prompt's hidden
states as ``spindle.v1`` ``Embed`` does by default. ``FlushCache`` resets every backend's prefix cache.

``SubscribeKvEvents`` streams the backends' prefix cache events, relayed by the engine's
:class:`~spindle.frontend.engine.kv_events.KvEventHub`: numbered batches (the numbers are this frontend's, never reused
while it runs), each with its backend's ``dp_rank`` and load; ``load_only`` records every :data:`KV_LOAD_INTERVAL`
seconds while no batch comes, and within :data:`KV_LOAD_POLL` seconds of a change of a rank's load that no batch carried
(a request admitted from the cache, one that ended). A subscriber resumes from its last number while the hub's history
reaches back to it, else (or from 0) it gets a snapshot of the live blocks first. The stream's initial metadata carries
``spindle-kv-epoch`` (:data:`KV_EPOCH_METADATA`), which changes when the frontend or a backend restarts; a backend that
restarts during a stream shows on it as a ``KvCacheCleared`` for its rank, and the stream goes on. The profiler is not
served (gRPC answers ``UNIMPLEMENTED``).
"""

import datetime
import hashlib
import io
import json
import math
import time
import uuid
import zipfile
from collections.abc import AsyncIterator

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from spindle.frontend.engine.kv_events import KvBatch, KvSubscriberTooSlowError
from spindle.frontend.grpc.admission_control import OverLimitError
from spindle.frontend.grpc.metrics import kv_cache_usage
from spindle.frontend.grpc.servicer import (
    SpindleServicer,
    ends_with_status,
    engine_id,
    server_version,
    token_id_or_minus_one,
)
from spindle.shared import PoolingParams, RequestOutput, SamplingParams
from spindle.shared.errors import EngineUnavailableError, InvalidRequestError
from spindle.shared.outputs import CompletionOutput, Logprob
from spindle.shared.protocol import EngineStats, KvBlockRemoved, KvBlockStored, KvEvent
from spindle.shared.sampling_params import StructuredOutput

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
TOKENIZER_CHUNK_BYTES = 1 << 20
"""The most bytes of the tokenizer's zip archive that one ``GetTokenizer`` message carries."""

UNSUPPORTED_REQUEST_FIELDS = {
    "kv_transfer_params": "KV transfer (prefill/decode disaggregation) is not supported by Spindle",
    "kv_transfer_params_json": "KV transfer (prefill/decode disaggregation) is not supported by Spindle",
    "mm_inputs": "preprocessed multimodal tensors are not taken: send images through spindle.v1 Generate or Chat",
    "extra_mm_inputs": "preprocessed multimodal tensors are not taken: send images through spindle.v1 Generate or Chat",
    "media_refs": "Spindle does not fetch media: send images through spindle.v1 Generate or Chat",
    "data_parallel_rank": "Spindle balances requests over its data-parallel engines itself: leave it unset",
}
"""``GenerateRequest`` fields Spindle cannot honour, and why: a request that sets one is refused."""

KV_EPOCH_METADATA = "spindle-kv-epoch"
"""The ``SubscribeKvEvents`` stream's initial metadata key whose value changes when the frontend or a backend
restarts (the protocol has no field for the producer's epoch)."""

KV_LOAD_INTERVAL = 1.0
"""Seconds between a ``SubscribeKvEvents`` stream's ``load_only`` heartbeats while no event batch comes."""

KV_LOAD_POLL = 0.25
"""Seconds between a ``SubscribeKvEvents`` stream's looks at the load while no event batch comes (the backends send
their stats every 0.25 s): a rank whose load changed gets a ``load_only`` record then."""


def sampling_params_from_vllm(message: pb.SamplingParams) -> SamplingParams:
    """The :class:`~spindle.shared.SamplingParams` of a vLLM ``SamplingParams`` message.

    Fields without presence that are zero keep Spindle's defaults where zero is not a value they can mean (``n``,
    ``top_p``, ``repetition_penalty``); an unset ``max_tokens`` generates up to the context's end, as vLLM does.

    Raises:
        InvalidRequestError: a value is out of range.

    """
    kwargs = {
        "n": message.n or 1,
        "top_p": message.top_p or 1.0,
        "top_k": message.top_k,
        "min_p": message.min_p,
        "frequency_penalty": message.frequency_penalty,
        "presence_penalty": message.presence_penalty,
        "repetition_penalty": message.repetition_penalty or 1.0,
        "max_tokens": message.max_tokens if message.HasField("max_tokens") else None,
        "min_tokens": message.min_tokens,
        "stop": list(message.stop) or None,
        "stop_token_ids": frozenset(message.stop_token_ids) or None,
        "include_stop_str_in_output": message.include_stop_str_in_output,
        "ignore_eos": message.ignore_eos,
        "skip_special_tokens": message.skip_special_tokens,
        "spaces_between_special_tokens": message.spaces_between_special_tokens,
        "logit_bias": dict(message.logit_bias) or None,
    }
    for name in ("temperature", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    match message.WhichOneof("constraint"):
        case "choice":
            kwargs["structured_output"] = StructuredOutput(choice=list(message.choice.choices))
        case "json_object" if not message.json_object:
            raise InvalidRequestError("sampling_params.json_object", "json_object must be true when set")
        case None:
            pass
        case kind:
            kwargs["structured_output"] = StructuredOutput(**{kind: getattr(message, kind)})
    return SamplingParams(**kwargs)


def prompt_inputs_from_vllm(request: pb.GenerateRequest) -> dict:
    """The engine's prompt inputs of a ``GenerateRequest``: its token ids, or its text.

    Raises:
        InvalidRequestError: no input is set, or the request sets a field of ``UNSUPPORTED_REQUEST_FIELDS``.

    """
    for name, reason in UNSUPPORTED_REQUEST_FIELDS.items():
        field = request.DESCRIPTOR.fields_by_name[name]
        given = len(getattr(request, name)) if field.is_repeated else request.HasField(name)
        if given:
            raise InvalidRequestError(name, f"{name}: {reason}")
    match request.WhichOneof("input"):
        case "tokenized":
            return {"prompt_token_ids": list(request.tokenized.input_ids)}
        case "text":
            return {"prompt": request.text}
    raise InvalidRequestError("input", "the request has no input: set tokenized.input_ids or text")


def _top_logprobs(position: dict[int, Logprob], limit: int) -> pb.TopLogProbs:
    """The ``limit`` most likely tokens of a position (by rank), or all of them for ``limit`` -1."""
    ranked = sorted(position.items(), key=lambda item: math.inf if item[1].rank is None else item[1].rank)
    if limit >= 0:
        ranked = [(token, logprob) for token, logprob in ranked if logprob.rank is not None and logprob.rank <= limit]
    return pb.TopLogProbs(values=[lp.logprob for _, lp in ranked], token_ids=[token for token, _ in ranked])


def _output_logprobs(completion: CompletionOutput, limit: int) -> pb.OutputLogProbs:
    """The chosen tokens' log-probabilities of ``completion``'s (new) tokens and each position's top ``limit``."""
    positions = completion.logprobs or []
    return pb.OutputLogProbs(
        token_logprobs=[
            position[token].logprob for token, position in zip(completion.token_ids, positions, strict=True)
        ],
        token_ids=completion.token_ids,
        top_logprobs=[_top_logprobs(position, limit) for position in positions],
    )


def _input_logprobs(output: RequestOutput, limit: int) -> pb.InputLogProbs:
    """The prompt tokens' log-probabilities (none for the first) and each position's top ``limit``."""
    values, tops = [], []
    for token, position in zip(output.prompt_token_ids, output.prompt_logprobs or [], strict=True):
        values.append(
            pb.InputTokenLogProb() if position is None else pb.InputTokenLogProb(value=position[token].logprob)
        )
        tops.append(pb.TopLogProbs() if position is None else _top_logprobs(position, limit))
    return pb.InputLogProbs(token_logprobs=values, token_ids=output.prompt_token_ids, top_logprobs=tops)


class _Completions:
    """Builds one request's ``GenerateResponse`` messages from its (delta) outputs.

    Args:
        params: the request's sampling parameters (which logprobs it asked for).
        stream: whether the caller asked for chunks.

    """

    def __init__(self, params: SamplingParams, stream: bool) -> None:
        self.params = params
        self.stream = stream
        self.token_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[dict[int, Logprob]]] = {}
        self.sent_prompt_logprobs = False

    def take(self, output: RequestOutput) -> list[pb.GenerateResponse]:
        """The messages that ``output`` (the request's state after a step, with new tokens only) gives."""
        responses = []
        for completion in output.outputs:
            self.token_ids.setdefault(completion.index, []).extend(completion.token_ids)
            self.logprobs.setdefault(completion.index, []).extend(completion.logprobs or [])
            if self.stream and completion.token_ids:
                responses.append(pb.GenerateResponse(chunk=self._chunk(output, completion)))
            if self.stream and completion.finished():
                responses.append(pb.GenerateResponse(complete=self._complete(output, completion, [])))
        if not self.stream and output.finished:
            for completion in sorted(output.outputs, key=lambda c: c.index):
                responses.append(pb.GenerateResponse(complete=self._complete(output, completion, None)))
        return responses

    def _counts(self, output: RequestOutput, index: int) -> dict[str, int]:
        return {
            "prompt_tokens": len(output.prompt_token_ids),
            "completion_tokens": len(self.token_ids[index]),
            "cached_tokens": output.num_cached_tokens,
        }

    def _prompt_logprobs(self, output: RequestOutput) -> dict[str, pb.InputLogProbs]:
        """The prompt's logprobs, once per request, if asked for."""
        if self.params.prompt_logprobs is None or self.sent_prompt_logprobs:
            return {}
        self.sent_prompt_logprobs = True
        return {"input_logprobs": _input_logprobs(output, self.params.prompt_logprobs)}

    def _chunk(self, output: RequestOutput, completion: CompletionOutput) -> pb.GenerateStreamChunk:
        chunk = pb.GenerateStreamChunk(
            token_ids=completion.token_ids,
            index=completion.index,
            **self._counts(output, completion.index),
            **self._prompt_logprobs(output),
        )
        if self.params.logprobs is not None:
            chunk.output_logprobs.CopyFrom(_output_logprobs(completion, self.params.logprobs))
        return chunk

    def _complete(
        self, output: RequestOutput, completion: CompletionOutput, token_ids: list[int] | None
    ) -> pb.GenerateComplete:
        """The ``complete`` message of an ended completion: with ``token_ids`` ``None``, every token it generated."""
        index = completion.index
        complete = pb.GenerateComplete(
            output_ids=self.token_ids[index] if token_ids is None else token_ids,
            finish_reason=str(completion.finish_reason),
            index=index,
            spec_draft_tokens=completion.num_draft_tokens,
            spec_accepted_tokens=completion.num_accepted_draft_tokens,
            **self._counts(output, index),
            **({} if self.stream else self._prompt_logprobs(output)),
        )
        if isinstance(completion.stop_reason, str):
            complete.matched_stop_str = completion.stop_reason
        elif completion.stop_reason is not None:
            complete.matched_token_id = completion.stop_reason
        if token_ids is None and self.params.logprobs is not None:
            whole = CompletionOutput(
                index=index, text="", token_ids=self.token_ids[index], logprobs=self.logprobs[index]
            )
            complete.output_logprobs.CopyFrom(_output_logprobs(whole, self.params.logprobs))
        return complete


def kv_event_to_proto(event: KvEvent, event_id: int, medium: str) -> common_pb2.KvCacheEvent:
    """The protocol's form of one KV event of a backend whose cache lives on ``medium`` (``"GPU"``, ``"CPU"``).

    The cache is the engine's working one, wherever it lives: tier ``DEVICE``, locality ``LOCAL``.
    """
    where = {"tier": common_pb2.KV_CACHE_TIER_DEVICE, "medium": medium, "locality": common_pb2.KV_CACHE_LOCALITY_LOCAL}
    match event:
        case KvBlockStored():
            block = common_pb2.KvBlock(
                block_hash=event.block_hash, token_ids=event.token_ids, block_size=len(event.token_ids)
            )
            stored = common_pb2.KvBlocksStored(blocks=[block], **where)
            if event.parent_hash is not None:
                stored.parent_block_hash = event.parent_hash
            if event.lora_id is not None:
                block.lora_id = event.lora_id
                stored.blocks[0].lora_id = event.lora_id
            if event.lora_name is not None:
                stored.lora_name = event.lora_name
            return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
        case KvBlockRemoved():
            removed = common_pb2.KvBlocksRemoved(block_hashes=[event.block_hash], **where)
            return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


def _load_figures(stats: EngineStats | None) -> tuple[int, int, int]:
    """What a load record's routing core follows of a rank's stats: running and waiting requests, free KV blocks."""
    return (stats.num_running, stats.num_waiting, stats.num_free_blocks) if stats else (0, 0, 0)


class _KvStream:
    """Builds one ``SubscribeKvEvents`` stream's batches: the engine's load on each, numbered samples.

    Args:
        servicer: the service (the engine's info, its ranks' stats, the server's load).
        loads_first: the subscriber takes ``load_only`` records before the first batch.

    """

    def __init__(self, servicer: "VllmEngineServicer", loads_first: bool) -> None:
        self.servicer = servicer
        self.loads_first = loads_first
        self.medium = servicer.engine.info.kv_medium
        self.sent = 0  # the number of the last batch sent
        self.samples = 0
        self.reported: dict[int, tuple[int, int, int]] = {}  # each rank's load figures, as last sent
        self.beat_at = time.monotonic()

    def batch(self, batch: KvBatch) -> common_pb2.KvEventBatch | None:
        """A published batch, unless the subscriber has it already (``None``)."""
        if batch.sequence <= self.sent:
            return None
        self.sent = batch.sequence
        events = [kv_event_to_proto(e, batch.first_event_id + i, self.medium) for i, e in enumerate(batch.events)]
        return common_pb2.KvEventBatch(
            sequence_number=batch.sequence,
            timestamp=batch.timestamp,
            events=events,
            dp_rank=batch.rank,
            load=self.load(batch.rank, load_only=False),
        )

    def snapshot(self, sequence: int, live: dict[int, list[KvBlockStored]]) -> list[common_pb2.KvEventBatch]:
        """A snapshot's chunks, one per rank, numbered up to ``sequence``: a clear, then every live block."""
        blocks = sum(len(stored) for stored in live.values())
        chunks = []
        for index, (rank, stored) in enumerate(live.items()):
            cleared = common_pb2.KvCacheEvent(event_id=0, cleared=common_pb2.KvCacheCleared())
            events = [cleared, *(kv_event_to_proto(event, 0, self.medium) for event in stored)]
            chunks.append(
                common_pb2.KvEventBatch(
                    sequence_number=sequence - len(live) + 1 + index,
                    timestamp=time.time(),
                    events=events,
                    dp_rank=rank,
                    snapshot=common_pb2.KvSnapshotChunk(index=index, count=len(live), blocks=blocks),
                    load=self.load(rank, load_only=False),
                )
            )
        self.sent = max(self.sent, sequence)
        return chunks

    def loads(self) -> list[common_pb2.KvEventBatch]:
        """The ``load_only`` records due now, each repeating the last number sent.

        Every rank's once a heartbeat interval has passed, else those of the ranks whose load changed since it was
        last sent; none before the first batch, unless the subscriber asked for them (numbered 0 then).
        """
        if not self.sent and not self.loads_first:
            return []
        beat = time.monotonic() - self.beat_at >= KV_LOAD_INTERVAL
        if beat:
            self.beat_at = time.monotonic()
        return [
            common_pb2.KvEventBatch(
                sequence_number=self.sent, timestamp=time.time(), dp_rank=rank, load=self.load(rank, load_only=True)
            )
            for rank, figures in enumerate(self.servicer.engine.rank_stats())
            if beat or _load_figures(figures.stats) != self.reported.get(rank)
        ]

    def load(self, rank: int, load_only: bool) -> common_pb2.EngineLoad:
        """Rank ``rank``'s load as ``GetLoads`` reports it, the next sample of this stream."""
        self.samples += 1
        ranks = self.servicer.engine.rank_stats()
        stats = (ranks[rank].stats if rank < len(ranks) else None) or EngineStats(0, 0, 0, 0, 0)
        self.reported[rank] = _load_figures(stats)
        load = self.servicer.spindle.load.load()
        single = len(ranks) == 1
        record = common_pb2.EngineLoad(
            running_requests=stats.num_running,
            waiting_requests=stats.num_waiting,
            token_usage=kv_cache_usage(stats),
            gen_throughput=load.generation_tokens_per_second if single else 0.0,
            sample=self.samples,
            load_only=load_only,
        )
        if load_only or self.samples == 1:  # the telemetry beyond the routing core comes on the heartbeats
            block_size = self.servicer.engine.info.block_size
            record.num_used_tokens = (stats.num_total_blocks - stats.num_free_blocks) * block_size
            record.max_total_num_tokens = stats.num_total_blocks * block_size
            if single:
                record.cache_hit_rate = load.prefix_cache_hit_rate
        return record


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Implements ``vllm.grpc.engine.VllmEngine`` beside a :class:`SpindleServicer`, sharing its engine and limits.

    Args:
        spindle: the ``spindle.v1`` servicer whose engine, configuration, admission control, connection limits
            and load tracker this service uses.

    """

    def __init__(self, spindle: SpindleServicer) -> None:
        self.spindle = spindle
        self.engine = spindle.engine
        self.last_receive = 0.0

    @ends_with_status
    async def Generate(  # noqa: N802 - gRPC method names are CamelCase
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one prompt's completions as token ids (chunks and a ``complete`` each, or ``complete`` only)."""
        self.last_receive = time.time()
        inputs = prompt_inputs_from_vllm(request)
        self.spindle.check_limits(request.sampling_params)
        params = sampling_params_from_vllm(request.sampling_params)
        completions = _Completions(params, request.stream)

        def start(request_engine_id: str) -> AsyncIterator[RequestOutput]:
            return self.engine.generate(inputs, params, request_engine_id, delta=True)

        request_id = request.request_id or uuid.uuid4().hex
        async for output in self.spindle.admitted_outputs(context, request_id, start):
            for response in completions.take(output):
                yield response

    @ends_with_status
    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        """Abort the requests in flight that this caller's connection made (others are unknown to it)."""
        for request_id in request.request_ids:
            await self.engine.abort(engine_id(context, request_id))
        return pb.AbortResponse()

    @ends_with_status
    async def HealthCheck(  # noqa: N802
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        """Healthy while a backend serves and the server does not drain, as the standard health service says."""
        if self.spindle.admission_control.draining:
            return pb.HealthCheckResponse(healthy=False, message="the server is shutting down")
        if self.engine.is_dead:
            return pb.HealthCheckResponse(healthy=False, message="the model backend is down; one is being brought back")
        return pb.HealthCheckResponse(healthy=True, message="serving")

    @ends_with_status
    async def GetModelInfo(  # noqa: N802
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        """Describe the served model: its limits, special tokens and architectures, as the backend loaded it.

        ``served_model_name`` is the first name the server answers to, and ``default_sampling_params_json`` the
        generation config's defaults, as vLLM reports them (a gateway applies them to its requests; the speculation
        default is Spindle's own, and no field of vLLM's ``SamplingParams``).
        """
        info, tokenizer = self.engine.info, self.engine.tokenizer
        return pb.GetModelInfoResponse(
            architectures=info.architectures,
            model_path=info.model_name,
            served_model_name=self.spindle.served_model_names[0],
            default_sampling_params_json=json.dumps(self.spindle.generation_defaults),
            is_generation=True,
            max_context_length=info.max_model_len,
            max_req_input_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            bos_token_id=token_id_or_minus_one(tokenizer.bos_token_id),
            pad_token_id=token_id_or_minus_one(
                tokenizer.backend.token_to_id(tokenizer.special_tokens.get("pad_token", ""))
            ),
        )

    @ends_with_status
    async def GetServerInfo(  # noqa: N802
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        """Report the requests in flight, uptime and the engine's shape."""
        stats = await self.engine.get_stats()
        return pb.GetServerInfoResponse(
            active_requests=stats.num_running + stats.num_waiting,
            last_receive_timestamp=self.last_receive,
            uptime_seconds=time.monotonic() - self.spindle.started,
            # Gateways pick their protocol by this name; Spindle speaks vLLM's.
            server_type="vllm-grpc",
            data_parallel_size=len(self.engine.rank_stats()),
            block_size=self.engine.info.block_size,
        )

    @ends_with_status
    async def GetLoads(  # noqa: N802
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadsResponse:
        """Each data-parallel engine's load, from its latest stats (what ``WatchLoad`` adds up).

        Throughput and the prefix cache's hit rate are followed for the whole server only: they are reported on
        a single engine's load, and 0 with several.
        """
        outside = [section for section in request.include if section != "core"]
        if outside:
            raise InvalidRequestError("include", f"include has {outside}: Spindle reports the 'core' section only")
        ranks = self.engine.rank_stats()
        if request.HasField("dp_rank") and not 0 <= request.dp_rank < len(ranks):
            raise InvalidRequestError("dp_rank", f"dp_rank={request.dp_rank}: this server has ranks 0-{len(ranks) - 1}")
        block_size, load = self.engine.info.block_size, self.spindle.load.load()
        loads = []
        for rank, rank_stats in enumerate(ranks):
            stats = rank_stats.stats
            if stats is None or (request.HasField("dp_rank") and rank != request.dp_rank):
                continue
            single = len(ranks) == 1
            loads.append(
                pb.SchedulerLoad(
                    dp_rank=rank,
                    num_running_reqs=stats.num_running,
                    num_waiting_reqs=stats.num_waiting,
                    num_total_reqs=stats.num_running + stats.num_waiting,
                    num_used_tokens=(stats.num_total_blocks - stats.num_free_blocks) * block_size,
                    max_total_num_tokens=stats.num_total_blocks * block_size,
                    token_usage=kv_cache_usage(stats),
                    gen_throughput=load.generation_tokens_per_second if single else 0.0,
                    cache_hit_rate=load.prefix_cache_hit_rate if single else 0.0,
                )
            )
        timestamp = datetime.datetime.now(datetime.UTC).isoformat()
        return pb.GetLoadsResponse(timestamp=timestamp, version=server_version(), dp_rank_count=len(loads), loads=loads)

    @ends_with_status
    async def GetTokenizer(  # noqa: N802
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """Stream the tokenizer files the frontend loaded, as a zip archive; the last chunk carries its SHA-256."""
        archive = io.BytesIO()
        with zipfile.ZipFile(archive, "w") as files:
            for name, data in sorted(self.engine.info.tokenizer_files.items()):
                files.writestr(name, data)
        data = archive.getvalue()
        starts = range(0, len(data), TOKENIZER_CHUNK_BYTES)
        for start in starts:
            chunk = common_pb2.GetTokenizerChunk(data=data[start : start + TOKENIZER_CHUNK_BYTES])
            if start == starts[-1]:
                chunk.sha256 = hashlib.sha256(data).hexdigest()
            yield chunk

    @ends_with_status
    async def Embed(  # noqa: N802
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        """Embed one tokenized prompt, pooled as ``spindle.v1`` ``Embed`` pools by default."""
        if not request.tokenized.input_ids:
            raise InvalidRequestError("tokenized.input_ids", "the request has no input: set tokenized.input_ids")
        inputs = {"prompt_token_ids": list(request.tokenized.input_ids)}
        request_id = engine_id(context, request.request_id or uuid.uuid4().hex)
        with self.spindle.connections.hold(context.peer()), self.spindle.admission_control.admit(1):
            (output,) = await self.engine.embed(inputs, PoolingParams(), request_id)
        embedding = output.outputs.embedding
        return pb.EmbedResponse(
            embedding=embedding, prompt_tokens=len(output.prompt_token_ids), embedding_dim=len(embedding)
        )

    @ends_with_status
    async def FlushCache(  # noqa: N802
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        """Reset every backend's prefix cache once no request is in flight, waiting up to ``timeout_s`` for that."""
        if await self.engine.flush_cache(max(0.0, request.timeout_s)):
            return common_pb2.FlushCacheResponse(success=True, message="the prefix cache of every engine was reset")
        message = f"requests were still in flight after {request.timeout_s:g} s: the prefix cache was not reset"
        return common_pb2.FlushCacheResponse(success=False, message=message)

    @ends_with_status
    async def SubscribeKvEvents(  # noqa: N802
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Stream the backends' KV events from ``start_sequence_number`` on (a snapshot first when needed)."""
        hub = self.engine.kv_events
        with self.spindle.watchers.hold():
            await context.send_initial_metadata([(KV_EPOCH_METADATA, hub.epoch())])
            subscription, missed = hub.subscribe(request.start_sequence_number)
            stream = _KvStream(self, request.load_records_before_first_batch)
            try:
                if missed is None:
                    for chunk in stream.snapshot(hub.sequence, hub.snapshot()):
                        yield chunk
                    missed = []
                while True:
                    for batch in missed:
                        if (message := stream.batch(batch)) is not None:
                            yield message
                    if self.spindle.admission_control.draining:
                        raise EngineUnavailableError("the server is shutting down: subscribe to another replica")
                    try:
                        missed = await subscription.next(KV_LOAD_POLL)
                    except KvSubscriberTooSlowError as error:
                        raise OverLimitError(str(error)) from None
                    if not missed:
                        for record in stream.loads():
                            yield record
            finally:
                hub.unsubscribe(subscription)
