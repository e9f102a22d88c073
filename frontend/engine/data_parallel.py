"""``DataParallelClient``: N backend engines, each its own process with its own KV cache, behind one frontend.

It is an :class:`~spindle.frontend.engine.client.AsyncEngineClient` like a single backend's, so one ``AsyncLLMEngine``
serves from it as from one backend (``spindle serve --data-parallel-size N``, or ``--backend-address`` with a
comma-separated list): the engine admits, tokenizes and detokenizes each request once, and this client chooses the
backend it goes to and adds up what the backends report. Each backend keeps its own connection, recovery and restarts
(an :class:`~spindle.frontend.engine.async_client.AsyncBackendClient` each). It runs in the frontend process and never
imports torch.
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from spindle.frontend.engine.async_client import AsyncBackendClient, KvListener, RankStats
from spindle.frontend.engine.connection import BackendConnection, BackendProcess, EngineDeadError, start_backend
from spindle.shared.block_hash import block_hash, root_hash
from spindle.shared.config import EngineConfig
from spindle.shared.errors import AlreadyExistsError, NotFoundError, RequestRefusedError
from spindle.shared.protocol import (
    Command,
    EngineInfo,
    EngineRequest,
    EngineStats,
    ImageInput,
    KvEvent,
    ListLoras,
    LoadLora,
    ResetPrefixCache,
    SequenceDelta,
    UnloadLora,
)

if TYPE_CHECKING:
    from spindle.frontend.engine.client import OutputHandler

logger = logging.getLogger(__name__)

AFFINITY_SLACK = 4
"""How many more requests (in flight plus waiting) than the least loaded engine the engine holding a request's
prefix may have and still get it; see :class:`DataParallelClient`."""

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


def _from_rank(listener: KvListener, rank: int, _: int, events: list[KvEvent]) -> None:
    """Pass one backend's KV events on under its rank among the data-parallel engines."""
    listener(rank, events)


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
    """Add up the engines' stats, field by field: the counts summed, the adapters' names gathered (each once)."""
    adapters = sorted({name for s in stats for name in s.lora_adapters})
    counts = [name for name in EngineStats.__struct_fields__ if name != "lora_adapters"]
    return EngineStats(**{name: sum(getattr(s, name) for s in stats) for name in counts}, lora_adapters=adapters)


def connect_backends(
    config: EngineConfig, size: int, addresses: Sequence[str] = (), startup_timeout: float = 600.0
) -> list[BackendConnection]:
    """Connect to the backends at ``addresses``, or start ``size`` backend children with ``config``.

    The backends this starts each get their own KV cache of ``kv_cache_memory``, their own GPUs where there are
    enough (:func:`device_groups`), and unless ``cpu_threads`` is given, an equal share of this machine's cores. The
    handshakes run side by side.

    Raises:
        EngineDeadError: a backend exited or did not answer in time (the others are stopped).
        RuntimeError: a backend refused the handshake (e.g. another protocol version; the others are stopped).

    """
    if not addresses and config.parallel.cpu_threads is None:
        # The engines share this machine's cores: as many threads as cores in each would stall each other's steps.
        config = config.replace(cpu_threads=max(1, (os.cpu_count() or 1) // size))
    backends: list[tuple[str, BackendProcess | None]] = [(address, None) for address in addresses]
    if not backends:
        # Started from this thread, not the handshake threads: a backend's parent-death signal fires when the
        # thread that started it ends.
        ranks = config.parallel.tensor_parallel_size
        envs = device_groups(size, ranks) if config.model.device != "cpu" else [{}] * size
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
    return connections


class _Rank:
    """One backend as the router sees it: its client, the prompt prefixes it was sent, its adapters coming back.

    It is also the :class:`~spindle.frontend.engine.client.OutputHandler` of its client: what the backend sends goes
    on to the router's handler, and a new backend in its place starts with an empty prefix cache and none of the
    adapters loaded at run time, which it gets again.

    Attributes:
        client: the backend's client.
        prefixes: an LRU of :func:`prefix_hashes` of the prompts sent there, at most the backend's KV blocks long:
            the backend cannot hold more blocks than that, so older ones are likely evicted there too.
        restoring: the task reloading the runtime adapters into a new backend, which requests routed there await.

    """

    def __init__(self, router: "DataParallelClient", client: AsyncBackendClient) -> None:
        self.router = router
        self.client = client
        self.prefixes: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.restoring: asyncio.Task | None = None

    def load(self) -> int:
        """Requests in flight there, plus those waiting in the backend's queue."""
        return self.client.load()

    def free_blocks(self) -> int:
        """The backend's free KV blocks, as of its latest stats."""
        stats = self.client.stats
        return stats.num_free_blocks if stats is not None else self.client.info.num_kv_blocks

    def free_share(self) -> float:
        """The share of the backend's KV blocks that is free."""
        return self.free_blocks() / max(1, self.client.info.num_kv_blocks)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt this backend was sent before (and likely still caches)."""
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
        while len(self.prefixes) > max(1, self.client.info.num_kv_blocks):
            self.prefixes.popitem(last=False)

    async def restored(self) -> None:
        """Wait until the runtime adapters are back in this backend, if it is a new one."""
        if self.restoring is not None:
            await asyncio.shield(self.restoring)  # shielded: a cancelled request must not cancel the reload

    def on_step(self, deltas: list[SequenceDelta]) -> None:
        """Pass a step's deltas on."""
        self.router.handler.on_step(deltas)

    def on_refused(self, request_id: str, error: RequestRefusedError) -> None:
        """Pass a refusal on."""
        self.router.handler.on_refused(request_id, error)

    def on_lost(self, request_ids: list[str], error: EngineDeadError) -> None:
        """Pass on the requests lost with the backend; the others go on elsewhere."""
        self.router.handler.on_lost(request_ids, error)

    def on_adopted(self) -> None:
        """Follow a new backend: its prefix cache starts empty, and the runtime adapters are loaded into it again."""
        self.prefixes.clear()
        if self.router.loras:
            loads = list(self.router.loras.values())
            self.restoring = asyncio.get_running_loop().create_task(self._restore(loads))
        self.router.handler.on_adopted()

    async def _restore(self, loads: list[LoadLora]) -> None:
        """Load the runtime adapters; a failure is logged, and requests naming the adapter hear NOT_FOUND."""
        for load in loads:
            try:
                await self.client.call(load)
            except AlreadyExistsError:  # a backend reconnected to still has it
                pass
            except Exception as error:
                logger.warning("Could not load LoRA adapter %r into a new backend again: %s", load.name, error)


class DataParallelClient:
    """N backends behind one engine: each request goes to one, chosen by prefix affinity and load.

    Each backend recovers on its own: a dead backend loses only the requests it held (the handler hears they are
    lost, and may send them again: they go to the live ones), the others go on, new requests go to the live ones,
    and it takes requests again once it is back. Calls
    fail with :class:`~spindle.frontend.engine.connection.EngineDeadError` only while every backend is down.

    Routing: a request goes to a live backend, chosen by the request's prompt (its full KV blocks of ``block_size``
    tokens) and each backend's *load*, its requests in flight from this client plus those waiting in its scheduler
    (from its latest stats):

    1. the *affine* backend is the one that was sent the longest leading run of the prompt's blocks (chained block
       hashes, :func:`prefix_hashes`, kept per backend in an LRU as long as its KV cache; the LoRA adapter and
       ``cache_salt`` are part of the hash, as they are of the backend's); the *least loaded* backend has the lowest
       load, then the largest share of free KV blocks;
    2. the request goes to the affine backend if it matched at least one block, unless it is clearly busier than
       the least loaded one: more than ``max(AFFINITY_SLACK, AFFINITY_SLACK_RATIO * least's load)`` requests above
       it, or fewer free KV blocks than the prompt's uncached blocks where the least loaded backend has them;
    3. otherwise to the least loaded backend.

    So requests that share a long prefix land on one backend and hit its prefix cache, until it is clearly busier
    than the others. An embedding batch goes whole to the least loaded backend.

    A request's aborts, pauses and ended completions go to the backend that runs it (:meth:`client_of`). LoRA adapters
    (:class:`~spindle.shared.protocol.LoadLora`, whether a caller or a request's ``lora_path`` asks) are loaded into
    every live backend or into none, and again into a backend that restarted or was reconnected to, before it gets
    another request.

    Args:
        clients: the backends' clients (all serving the same model).

    Attributes:
        clients: the backends' clients, in the order given.
        loras: the adapters loaded at run time, by name, as the commands that loaded them.

    """

    def __init__(self, clients: Sequence[AsyncBackendClient]) -> None:
        if not clients:
            raise ValueError("a DataParallelClient needs at least one backend")
        self.clients = list(clients)
        self.loras: dict[str, LoadLora] = {}
        self.handler: OutputHandler | None = None
        self._ranks = [_Rank(self, client) for client in self.clients]

    @property
    def info(self) -> EngineInfo:
        """A live backend's description, with the KV blocks of all backends."""
        total = sum(client.info.num_kv_blocks for client in self.clients)
        return msgspec.structs.replace(self._any().client.info, num_kv_blocks=total)

    @property
    def is_dead(self) -> bool:
        """Whether no backend serves now."""
        return all(client.is_dead for client in self.clients)

    @property
    def num_restarts(self) -> int:
        """How many times a new backend took over from a dead one, over all backends."""
        return sum(client.num_restarts for client in self.clients)

    def client_of(self, request_id: str) -> AsyncBackendClient | None:
        """The client of the backend that runs the request ``request_id`` now (``None`` when none does)."""
        return next((client for client in self.clients if request_id in client.requests), None)

    def attach(self, handler: "OutputHandler") -> None:
        """Hand what every backend sends from now on to ``handler``."""
        self.handler = handler
        for rank in self._ranks:
            rank.client.attach(rank)

    async def add_requests(self, requests: Sequence[EngineRequest]) -> None:
        """Queue requests in one backend, chosen by the rule of the class docstring, once its adapters are back."""
        rank = self._route(requests)
        await rank.restored()
        await rank.client.add_requests(requests)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests in the backends that run them."""
        for client, owned in self._by_client(request_ids):
            client.abort_requests(owned)

    def pause_requests(self, request_ids: Sequence[str], resume: bool = False) -> None:
        """Stop scheduling requests in the backends that run them, or with ``resume`` schedule them again."""
        for client, owned in self._by_client(request_ids):
            client.pause_requests(owned, resume)

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion in the backend that runs its request."""
        client = self.client_of(request_id)
        if client is not None:
            client.finish_sequence(request_id, index)

    async def call(self, command: Command) -> Any:
        """Run a control-plane command in the live backends; the result is theirs together.

        :class:`~spindle.shared.protocol.LoadLora` loads the adapter into every live backend, or into none: if any
        refuses it, it is unloaded again from those that took it, and the first refusal is raised (an adapter on
        some backends only would make requests naming it fail or not by their route); a backend that is down gets
        it once it is back. :class:`~spindle.shared.protocol.UnloadLora` unloads it from every live backend
        (:class:`~spindle.shared.errors.NotFoundError` only if none had it: one may have restarted since).
        :class:`~spindle.shared.protocol.ListLoras` lists what any live backend has, each name once.
        :class:`~spindle.shared.protocol.ResetPrefixCache` resets every live backend's cache: true if all did.

        Raises:
            EngineDeadError: no backend serves, or one died meanwhile.
            EngineUnavailableError: a backend did not answer in time.

        """
        live = self._live()
        results = await asyncio.gather(*(rank.client.call(command) for rank in live), return_exceptions=True)
        errors = [result for result in results if isinstance(result, BaseException)]
        match command:
            case LoadLora(name=name):
                if errors:
                    for rank, result in zip(live, results, strict=True):
                        if not isinstance(result, BaseException):
                            with contextlib.suppress(Exception):
                                await rank.client.call(UnloadLora(name))
                    raise errors[0]
                self.loras[name] = command
                return results[0]
            case UnloadLora(name=name):
                self.loras.pop(name, None)
                # A backend without it is no failure while another had it.
                others = [error for error in errors if not isinstance(error, NotFoundError)]
                if others or len(errors) == len(live):
                    raise (others or errors)[0]
                return None
            case ListLoras():
                lists = [result for result in results if not isinstance(result, BaseException)]
                if not lists:
                    raise errors[0]
                adapters = {adapter.name: adapter for adapters in reversed(lists) for adapter in adapters}
                return sorted(adapters.values(), key=lambda adapter: adapter.name)
            case ResetPrefixCache():
                if errors:
                    raise errors[0]
                return all(results)

    async def get_stats(self) -> EngineStats:
        """The live backends' stats added up, as of each one's next heartbeat or step.

        Raises:
            EngineDeadError: no backend serves.

        """
        results = await asyncio.gather(*(rank.client.get_stats() for rank in self._live()), return_exceptions=True)
        stats = [result for result in results if isinstance(result, EngineStats)]
        if not stats:  # every live backend died while we waited
            raise next(result for result in results if isinstance(result, BaseException))
        return sum_stats(stats)

    def rank_stats(self) -> list[RankStats]:
        """Each backend's figures, in the order of :attr:`clients`."""
        return [figures for client in self.clients for figures in client.rank_stats()]

    def subscribe_kv_events(self, listener: KvListener | None) -> None:
        """Hand every backend's KV events to ``listener``, with the backend's rank (``None``: stop them)."""
        for rank, client in enumerate(self.clients):
            client.subscribe_kv_events(None if listener is None else functools.partial(_from_rank, listener, rank))

    def close(self) -> None:
        """Close every backend's client (stopping the backends this client started)."""
        for rank in self._ranks:
            if rank.restoring is not None:
                rank.restoring.cancel()
            rank.client.close()

    def _route(self, requests: Sequence[EngineRequest]) -> _Rank:
        """The backend for a request (an embedding batch: the least loaded); it remembers the prompt's blocks."""
        live = self._live()
        least = min(live, key=lambda rank: (rank.load(), -rank.free_share()))
        request = requests[0]
        if request.pooling is not None:
            return least
        block_size = live[0].client.info.block_size
        hashes = prefix_hashes(
            request.prompt_token_ids, block_size, request.params.cache_salt, request.lora_name, request.images
        )
        matches = {rank: rank.match(hashes) for rank in live}
        affine = max(live, key=lambda rank: (matches[rank], -rank.load()))
        chosen = least
        if matches[affine]:
            slack = max(AFFINITY_SLACK, AFFINITY_SLACK_RATIO * least.load())
            uncached = -(-(len(request.prompt_token_ids) - matches[affine] * block_size) // block_size)  # ceiling
            busier = affine.load() > least.load() + slack or affine.free_blocks() < uncached <= least.free_blocks()
            if not busier:
                chosen = affine
        chosen.remember(hashes)
        return chosen

    def _by_client(self, request_ids: Sequence[str]) -> list[tuple[AsyncBackendClient, list[str]]]:
        """The requests among ``request_ids`` that each backend runs, for those that run any."""
        groups = [(client, [rid for rid in request_ids if rid in client.requests]) for client in self.clients]
        return [(client, owned) for client, owned in groups if owned]

    def _live(self) -> list[_Rank]:
        """The backends that serve now; :class:`EngineDeadError` if none does."""
        live = [rank for rank in self._ranks if not rank.client.is_dead]
        if not live:
            raise EngineDeadError(f"all {len(self._ranks)} engines are down")
        return live

    def _any(self) -> _Rank:
        """A live backend if there is one, else the first: for what all share (model, tokenizer, limits)."""
        return next((rank for rank in self._ranks if not rank.client.is_dead), self._ranks[0])
