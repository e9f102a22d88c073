"""``DataParallelEngine``: N engines, each a backend process with its own KV cache, behind one frontend.

It offers the interface of :class:`~spindle.frontend.async_llm_engine.AsyncLLMEngine`, so that the gRPC server serves
it the same way (``spindle serve --data-parallel-size N``, or ``--backend-address`` with a comma-separated list). Each
engine keeps its own connection, recovery and restarts; this module only chooses where each request goes and adds up
what the engines report. It runs in the frontend process and never imports torch.
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec

from spindle.frontend.async_llm_engine import AsyncLLMEngine
from spindle.frontend.core_client import BackendConnection, BackendProcess, EngineDeadError, start_backend
from spindle.frontend.input_processor import ProcessedPrompt
from spindle.frontend.tokenizer import Tokenizer
from spindle.shared import EmbeddingRequestOutput, PoolingParams, PromptInputs, RequestOutput, SamplingParams
from spindle.shared.block_hash import block_hash, root_hash
from spindle.shared.config import EngineConfig
from spindle.shared.errors import AlreadyExistsError, InvalidRequestError, NotFoundError
from spindle.shared.lora import LoraAdapterInfo, LoRARequest
from spindle.shared.protocol import EngineInfo, EngineStats, ImageInput

logger = logging.getLogger(__name__)

AFFINITY_SLACK = 4
"""How many more requests (in flight plus waiting) than the least loaded engine the engine holding a request's
prefix may have and still get it; see :class:`DataParallelEngine`."""

AFFINITY_SLACK_RATIO = 0.5
"""The same slack as a share of the least loaded engine's load, when that is more than :data:`AFFINITY_SLACK`."""


def prefix_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    images: Sequence[ImageInput] = (),
) -> list[bytes]:
    """The digests of the full ``block_size``-token blocks of a prompt, chained as the backend's prefix cache does.

    Each covers its block and all before it (:func:`~spindle.shared.block_hash.block_hash`, from the ``cache_salt``'s
    :func:`~spindle.shared.block_hash.root_hash`), so two prompts share their first ``k`` digests exactly when they
    share their first ``k`` blocks, salt and adapter; a block that holds image tokens hashes the content hashes of
    its ``images`` too. The backend chains an adapter's blocks from a root hashed with the adapter's id, which only it
    knows; the router knows the adapter by name, so it hashes ``lora_name`` into the root instead, under a prefix of
    its own: those digests differ from the backend's, but they keep adapters apart as the backend's cache does, which
    is all the routing needs.
    """
    parent = root_hash(cache_salt)
    if lora_name is not None:
        parent = hashlib.sha256(
            b"spindle-route-lora\0" + lora_name.encode("utf-8", "surrogatepass") + b"\0" + parent
        ).digest()
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        seen = b"".join(image.content_hash for image in images if image.overlaps(start, end))
        parent = block_hash(parent, token_ids[start:end], seen)
        hashes.append(parent)
    return hashes


def device_groups(size: int, ranks_per_engine: int) -> list[dict[str, str]]:
    """The environment of each of ``size`` engines started on this machine: its own consecutive GPUs.

    Engine ``i`` gets ``CUDA_VISIBLE_DEVICES`` set to the ``i``-th group of ``ranks_per_engine`` (its tensor-parallel
    ranks) of this process's visible GPUs: those ``CUDA_VISIBLE_DEVICES`` lists, else those ``nvidia-smi`` finds.
    With too few GPUs for one group each (none, on a CPU machine), nothing is set and the engines share what there is.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else _nvidia_gpus()
    if len(devices) < size * ranks_per_engine:
        if devices:
            logger.warning(
                "%d GPUs for %d engines of %d ranks: the engines share them", len(devices), size, ranks_per_engine
            )
        return [{} for _ in range(size)]
    groups = [devices[i * ranks_per_engine : (i + 1) * ranks_per_engine] for i in range(size)]
    return [{"CUDA_VISIBLE_DEVICES": ",".join(group)} for group in groups]


def _nvidia_gpus() -> list[str]:
    """The indices of this machine's NVIDIA GPUs, as ``nvidia-smi`` lists them (none without it)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return listing.stdout.split() if listing.returncode == 0 else []


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """Add up the engines' stats, field by field (every :class:`EngineStats` field is a count)."""
    return EngineStats(*(sum(getattr(s, name) for s in stats) for name in EngineStats.__struct_fields__))


class _Replica:
    """One engine as the router sees it: its requests in flight and the prompt prefixes it was sent.

    Attributes:
        engine: the engine.
        in_flight: requests this router sent there that have not ended (counted at once, unlike the backend's).
        prefixes: an LRU of :func:`prefix_hashes` of the prompts sent there, at most the engine's KV blocks long:
            the backend cannot hold more blocks than that, so older ones are likely evicted there too.
        restarts_seen: the engine's ``num_backend_restarts`` when the router last looked: when it grows, the new
            backend's cache is empty and its runtime adapters are gone.
        restoring: the task reloading the runtime adapters into a new backend, which requests routed there await.

    """

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.in_flight = 0
        self.prefixes: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.restarts_seen = engine.num_backend_restarts
        self.restoring: asyncio.Task | None = None

    def load(self) -> int:
        """Requests in flight from this router, plus those waiting in the backend's queue (counted again: they wait)."""
        stats = self.engine.stats
        return self.in_flight + (stats.num_waiting if stats is not None else 0)

    def free_blocks(self) -> int:
        """The backend's free KV blocks, as of its latest stats."""
        stats = self.engine.stats
        return stats.num_free_blocks if stats is not None else self.engine.info.num_kv_blocks

    def free_share(self) -> float:
        """The share of the backend's KV blocks that is free."""
        return self.free_blocks() / max(1, self.engine.info.num_kv_blocks)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt this engine was sent before (and likely still caches)."""
        matched = 0
        while matched < len(hashes) and hashes[matched] in self.prefixes:
            matched += 1
        return matched

    def remember(self, hashes: Sequence[bytes]) -> None:
        """Record a prompt's blocks as sent here, evicting the least recently sent beyond the capacity."""
        # Last block first: a prompt's first blocks become the most recent, so eviction takes its tail before them
        # (a match needs the blocks before it).
        for digest in reversed(hashes):
            self.prefixes[digest] = None
            self.prefixes.move_to_end(digest)
        while len(self.prefixes) > max(1, self.engine.info.num_kv_blocks):
            self.prefixes.popitem(last=False)


class DataParallelEngine:
    """Serve from N engines, each a backend process with its own KV cache, as one :class:`AsyncLLMEngine` would.

    The methods are those of :class:`AsyncLLMEngine`, with the same errors. The prompt is tokenized once, here (the
    router needs its token ids), and streamed to the chosen engine. Each engine recovers on its own: a dead backend
    fails only the requests it held (:class:`EngineDeadError`), the others go on, new requests go to the live ones,
    and it takes requests again once it is back. Calls fail with :class:`EngineDeadError` only while every engine is
    down.

    Routing: a request goes to a live engine, chosen by the request's prompt (its full KV blocks of ``block_size``
    tokens) and each engine's *load*, its requests in flight from this router plus those waiting in its scheduler
    (from its latest stats):

    1. the *affine* engine is the one that was sent the longest leading run of the prompt's blocks (chained block
       hashes kept per engine in an LRU as long as its KV cache; the LoRA adapter and ``cache_salt`` are part of the
       hash, as they are of the backend's); the *least loaded* engine has the lowest load, then the largest share of
       free KV blocks;
    2. the request goes to the affine engine if it matched at least one block, unless it is clearly busier than the
       least loaded one: more than ``max(AFFINITY_SLACK, AFFINITY_SLACK_RATIO * least's load)`` requests above it,
       or fewer free KV blocks than the prompt's uncached blocks where the least loaded engine has them;
    3. otherwise to the least loaded engine.

    So requests that share a long prefix land on one engine and hit its prefix cache, until it is clearly busier
    than the others. Embedding batches go to the least loaded engine (every ``{request_id}-{i}`` to the same one).

    Every request id maps to its engine while it runs, so :meth:`abort` (and a cancelled stream) reaches it.
    LoRA adapters loaded through :meth:`load_lora` are loaded into every live engine (all or none), and again into
    an engine whose backend restarted or was reconnected to, before it gets another request; adapters that a
    request's ``lora_request.lora_path`` loads are loaded by the engine that serves it, as with one engine.

    Args:
        engines: the engines, each connected to its backend (all serving the same model).

    Attributes:
        engines: the engines, in the order given.

    """

    def __init__(self, engines: Sequence[AsyncLLMEngine]) -> None:
        if not engines:
            raise ValueError("a DataParallelEngine needs at least one engine")
        self.engines = list(engines)
        self._replicas = [_Replica(engine) for engine in self.engines]
        self._owners: dict[str, _Replica] = {}  # request id -> the engine that runs it
        self._loras: dict[str, tuple[str, bool]] = {}  # adapters loaded at run time: name -> (path, confined)

    @classmethod
    def from_args(
        cls,
        data_parallel_size: int | None = None,
        backend_addresses: Sequence[str] = (),
        startup_timeout: float = 600.0,
        **engine_args: object,
    ) -> "DataParallelEngine":
        """Connect to the backends at ``backend_addresses``, or start ``data_parallel_size`` backend children.

        ``engine_args`` are :class:`~spindle.shared.config.EngineConfig` fields, for the backends this call starts
        (each with its own KV cache of ``kv_cache_memory``, its own GPUs where there are enough
        (:func:`device_groups`), and unless ``cpu_threads`` is given, an equal share of this machine's cores). The
        handshakes run side by side.

        Raises:
            ValueError: neither a size nor addresses, or a size other than the number of addresses.
            EngineDeadError: a backend exited or did not answer in time (the others are stopped).
            RuntimeError: a backend refused the handshake (e.g. another protocol version; the others are stopped).

        """
        if backend_addresses and data_parallel_size not in (None, len(backend_addresses)):
            raise ValueError(
                f"data_parallel_size={data_parallel_size} but {len(backend_addresses)} backend addresses: "
                "give one address per engine, or no size"
            )
        size = len(backend_addresses) or data_parallel_size or 0
        if size < 1:
            raise ValueError(f"data_parallel_size={size} must be at least 1")
        config = EngineConfig(**engine_args)
        if not backend_addresses and config.cpu_threads is None:
            # The engines share this machine's cores: as many threads as cores in each would stall each other's steps.
            config = dataclasses.replace(config, cpu_threads=max(1, (os.cpu_count() or 1) // size))
        backends: list[tuple[str, BackendProcess | None]] = [(address, None) for address in backend_addresses]
        if not backends:
            # Started from this thread, not the handshake threads: a backend's parent-death signal fires when the
            # thread that started it ends.
            envs = device_groups(size, config.tensor_parallel_size) if config.device != "cpu" else [{}] * size
            backends = [(address, process) for process, address in (start_backend(config, env=env) for env in envs)]
        with concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="spindle-handshake") as pool:
            futures = [
                pool.submit(BackendConnection, address, config, True, startup_timeout, process=process)
                for address, process in backends
            ]
        connections = [future.result() for future in futures if future.exception() is None]
        errors = [future.exception() for future in futures if future.exception() is not None]
        if errors:
            for connection in connections:
                connection.close()
            for _, process in backends:
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait()
            raise errors[0]
        return cls([AsyncLLMEngine(connection) for connection in connections])

    @property
    def info(self) -> EngineInfo:
        """A live engine's description, with the KV blocks of all engines."""
        total = sum(replica.engine.info.num_kv_blocks for replica in self._replicas)
        return msgspec.structs.replace(self._any().engine.info, num_kv_blocks=total)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (a live engine's)."""
        return self._any().engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest prompt + completion the engines accept."""
        return self._any().engine.max_model_len

    @property
    def is_dead(self) -> bool:
        """Whether no engine serves now."""
        return all(engine.is_dead for engine in self.engines)

    @property
    def num_backend_restarts(self) -> int:
        """How many times a new backend took over from a dead one, over all engines."""
        return sum(engine.num_backend_restarts for engine in self.engines)

    def engine_of(self, request_id: str) -> AsyncLLMEngine | None:
        """The engine that runs the request ``request_id`` now (``None`` when none does)."""
        replica = self._owners.get(request_id)
        return replica.engine if replica is not None else None

    async def generate(
        self,
        inputs: PromptInputs,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        delta: bool = False,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs from the engine it is routed to (:meth:`AsyncLLMEngine.generate`)."""
        params = sampling_params or SamplingParams()
        prompt = await self._any().engine.input_processor.process_async(inputs, params)
        async for output in self._stream(prompt, params, request_id, delta, priority, lora_request):
            yield output

    async def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        add_generation_prompt: bool = True,
        delta: bool = False,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = "auto",
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the reply to a conversation from the engine it is routed to (:meth:`AsyncLLMEngine.chat`)."""
        params = sampling_params or SamplingParams()
        input_processor = self._any().engine.input_processor
        prompt = await input_processor.process_chat_async(messages, params, add_generation_prompt, tools, tool_choice)
        async for output in self._stream(prompt, params, request_id, delta, priority, lora_request):
            yield output

    async def embed(
        self,
        inputs: PromptInputs | Sequence[PromptInputs],
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
    ) -> list[EmbeddingRequestOutput]:
        """Embed a batch of prompts on the least loaded engine (:meth:`AsyncLLMEngine.embed`)."""
        batch = [inputs] if isinstance(inputs, str | dict) else list(inputs)
        request_id = request_id or uuid.uuid4().hex
        request_ids = [f"{request_id}-{index}" for index in range(len(batch))]
        replica = self._least_loaded(self._live())
        self._claim(request_ids, replica)
        try:
            await self._restored(replica)
            return await replica.engine.embed(batch, pooling_params, request_id, priority=priority)
        finally:
            self._release(request_ids, replica)

    async def abort(self, request_id: str) -> bool:
        """Abort a request in the engine that runs it; returns whether one did (:meth:`AsyncLLMEngine.abort`)."""
        engine = self.engine_of(request_id)
        return engine is not None and await engine.abort(request_id)

    async def get_stats(self) -> EngineStats:
        """The live engines' stats added up, as of each one's next heartbeat or step.

        Raises:
            EngineDeadError: no engine serves.

        """
        results = await asyncio.gather(
            *(replica.engine.get_stats() for replica in self._live()), return_exceptions=True
        )
        stats = [result for result in results if isinstance(result, EngineStats)]
        if not stats:  # every live engine died while we waited
            raise next(result for result in results if isinstance(result, BaseException))
        return sum_stats(stats)

    async def load_lora(self, name: str, path: str, *, confined: bool = False) -> LoraAdapterInfo:
        """Load an adapter into every live engine, or into none (:meth:`AsyncLLMEngine.load_lora`).

        An engine that is down gets it once it is back, before its next request. If any engine refuses it, it is
        unloaded again from those that took it, and the first refusal is raised: an adapter on some engines only
        would make requests naming it fail or not by their route.
        """
        live = self._live()
        results = await asyncio.gather(
            *(replica.engine.load_lora(name, path, confined=confined) for replica in live), return_exceptions=True
        )
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            for replica, result in zip(live, results, strict=True):
                if not isinstance(result, BaseException):
                    with contextlib.suppress(Exception):
                        await replica.engine.unload_lora(name)
            raise errors[0]
        self._loras[name] = (path, confined)
        return results[0]

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter from every live engine (:meth:`AsyncLLMEngine.unload_lora`).

        Raises:
            NotFoundError: no live engine has an adapter under ``name``.
            EngineDeadError: an engine died meanwhile (the others unloaded it).
            EngineUnavailableError: an engine did not answer in time.

        """
        self._loras.pop(name, None)
        live = self._live()
        results = await asyncio.gather(*(replica.engine.unload_lora(name) for replica in live), return_exceptions=True)
        errors = [result for result in results if isinstance(result, BaseException)]
        # An engine without it is no failure while another had it: it may have restarted since, or never served
        # a request that loaded it.
        others = [error for error in errors if not isinstance(error, NotFoundError)]
        if others:
            raise others[0]
        if len(errors) == len(live):
            raise errors[0]

    async def list_loras(self) -> list[LoraAdapterInfo]:
        """The adapters any live engine has loaded, each name once."""
        results = await asyncio.gather(
            *(replica.engine.list_loras() for replica in self._live()), return_exceptions=True
        )
        lists = [result for result in results if not isinstance(result, BaseException)]
        if not lists:
            raise next(result for result in results if isinstance(result, BaseException))
        adapters = {adapter.name: adapter for adapters in reversed(lists) for adapter in adapters}
        return sorted(adapters.values(), key=lambda adapter: adapter.name)

    def shutdown(self) -> None:
        """Shut every engine down (:meth:`AsyncLLMEngine.shutdown`)."""
        for replica in self._replicas:
            if replica.restoring is not None:
                replica.restoring.cancel()
            replica.engine.shutdown()

    async def _stream(
        self,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        request_id: str | None,
        delta: bool,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> AsyncIterator[RequestOutput]:
        request_id = request_id or uuid.uuid4().hex
        lora_name = lora_request.lora_name if lora_request is not None else None
        replica = self._route(prompt.prompt_token_ids, params.cache_salt, lora_name, prompt.images)
        self._claim([request_id], replica)
        try:
            await self._restored(replica)
            async for output in replica.engine.generate_processed(
                prompt, params, request_id, delta=delta, priority=priority, lora_request=lora_request
            ):
                yield output
        finally:
            self._release([request_id], replica)

    def _route(
        self, token_ids: Sequence[int], cache_salt: str | None, lora_name: str | None, images: Sequence[ImageInput]
    ) -> _Replica:
        """The engine for a prompt, by the rule of the class docstring; it remembers the prompt's blocks."""
        live = self._live()
        block_size = live[0].engine.info.block_size
        hashes = prefix_hashes(token_ids, block_size, cache_salt, lora_name, images)
        least = self._least_loaded(live)
        matches = {replica: replica.match(hashes) for replica in live}
        affine = max(live, key=lambda replica: (matches[replica], -replica.load()))
        chosen = least
        if matches[affine]:
            slack = max(AFFINITY_SLACK, AFFINITY_SLACK_RATIO * least.load())
            uncached = -(-(len(token_ids) - matches[affine] * block_size) // block_size)  # ceiling division
            busier = affine.load() > least.load() + slack or affine.free_blocks() < uncached <= least.free_blocks()
            if not busier:
                chosen = affine
        chosen.remember(hashes)
        return chosen

    def _least_loaded(self, live: list[_Replica]) -> _Replica:
        return min(live, key=lambda replica: (replica.load(), -replica.free_share()))

    def _live(self) -> list[_Replica]:
        """The engines that serve now, caught up with their restarts; :class:`EngineDeadError` if none does."""
        live = [replica for replica in self._replicas if not replica.engine.is_dead]
        if not live:
            raise EngineDeadError(f"all {len(self._replicas)} engines are down")
        for replica in live:
            if replica.engine.num_backend_restarts != replica.restarts_seen:
                self._catch_up(replica)
        return live

    def _any(self) -> _Replica:
        """A live engine if there is one, else the first: for what all engines share (model, tokenizer, limits)."""
        return next((replica for replica in self._replicas if not replica.engine.is_dead), self._replicas[0])

    def _catch_up(self, replica: _Replica) -> None:
        """Follow a new backend: its prefix cache starts empty, and the runtime adapters must be loaded again."""
        replica.restarts_seen = replica.engine.num_backend_restarts
        replica.prefixes.clear()
        if self._loras:
            replica.restoring = asyncio.get_running_loop().create_task(self._restore_loras(replica, dict(self._loras)))

    async def _restore_loras(self, replica: _Replica, loras: dict[str, tuple[str, bool]]) -> None:
        """Load the runtime adapters into a new backend; a failure is logged, and requests naming it hear NOT_FOUND."""
        for name, (path, confined) in loras.items():
            try:
                await replica.engine.load_lora(name, path, confined=confined)
            except AlreadyExistsError:  # a backend reconnected to still has it
                pass
            except Exception as error:
                logger.warning("Could not load LoRA adapter %r into a new backend again: %s", name, error)

    async def _restored(self, replica: _Replica) -> None:
        """Wait until the runtime adapters are back in the engine's backend, if it restarted."""
        if replica.restoring is not None:
            await asyncio.shield(replica.restoring)  # shielded: a cancelled request must not cancel the reload

    def _claim(self, request_ids: list[str], replica: _Replica) -> None:
        busy = [request_id for request_id in request_ids if request_id in self._owners]
        if busy:
            raise InvalidRequestError("request_id", f"request ids {busy} are already in use")
        for request_id in request_ids:
            self._owners[request_id] = replica
        replica.in_flight += len(request_ids)

    def _release(self, request_ids: list[str], replica: _Replica) -> None:
        for request_id in request_ids:
            del self._owners[request_id]
        replica.in_flight -= len(request_ids)


Engine = AsyncLLMEngine | DataParallelEngine
"""What the gRPC server serves: one engine, or several behind a :class:`DataParallelEngine`."""


def replicas(engine: Engine) -> list[AsyncLLMEngine]:
    """The engines that do the work of ``engine``: its engines for a :class:`DataParallelEngine`, else itself."""
    return engine.engines if isinstance(engine, DataParallelEngine) else [engine]
