"""The prefix cache's events as one frontend relays them: numbered batches, a bounded history, a mirror of live blocks.

The backends send their block manager's events with their step outputs once the frontend subscribes
(:class:`~spindle.shared.protocol.SubscribeKvEvents`); a backend's subscription starts with a clear and every block
it caches then, so the mirror here is whole from its first batch. :class:`KvEventHub` subscribes its engine's
backends while it has subscribers of its own, numbers each batch it receives (numbers never reused for the life of
the frontend, whatever the backends do), keeps the last ``history`` batches for subscribers that resume from a
number, and applies every batch to a mirror of each backend's live blocks, for those that need a snapshot instead.
It runs on the frontend's event loop and imports no torch.
"""

import asyncio
import collections
import dataclasses
import hashlib
import time
import uuid
from typing import TYPE_CHECKING

from spindle.shared.protocol import KvBlockRemoved, KvBlockStored, KvCacheCleared, KvEvent, parents_first

if TYPE_CHECKING:
    from spindle.frontend.engine.client import AsyncEngineClient

KV_HISTORY = 4096
"""Batches a :class:`KvEventHub` keeps for subscribers that resume from a sequence number."""

KV_BUFFER = 1024
"""Batches a subscriber may leave unread before it is dropped."""


class KvSubscriberTooSlowError(Exception):
    """A subscriber left :data:`KV_BUFFER` batches unread: it was dropped, and must subscribe again."""


@dataclasses.dataclass(frozen=True)
class KvBatch:
    """One backend step's events, as numbered by the hub.

    Attributes:
        sequence: its number, from 1, one more than the batch before it (of any backend).
        timestamp: when the hub received it (seconds since the epoch).
        rank: the data-parallel rank of the backend that sent it.
        events: the events, in the order the backend's block manager recorded them.
        first_event_id: the id of its first event; the others follow on (ids are the hub's, from 1).

    """

    sequence: int
    timestamp: float
    rank: int
    events: list[KvEvent]
    first_event_id: int


class KvSubscription:
    """The batches published since one subscriber joined, until it reads them (:meth:`next`).

    Args:
        buffer: the most unread batches; one more drops the subscriber (its hub forgets it).

    """

    def __init__(self, buffer: int) -> None:
        self.buffer = buffer
        self.batches: collections.deque[KvBatch] = collections.deque()
        self.overflowed = False
        self._ready = asyncio.Event()

    def push(self, batch: KvBatch) -> bool:
        """Queue a batch; ``False`` if the subscriber fell ``buffer`` batches behind (it is to be dropped)."""
        if len(self.batches) >= self.buffer:
            self.overflowed = True
        else:
            self.batches.append(batch)
        self._ready.set()
        return not self.overflowed

    async def next(self, timeout: float) -> list[KvBatch]:
        """The unread batches, awaiting one for up to ``timeout`` seconds (``[]`` if none came).

        Raises:
            KvSubscriberTooSlowError: the subscriber fell ``buffer`` batches behind.

        """
        if not self.batches and not self.overflowed:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                return []
        if self.overflowed:
            raise KvSubscriberTooSlowError(f"the subscriber left {self.buffer} KV event batches unread: resubscribe")
        batches = list(self.batches)
        self.batches.clear()
        return batches


class KvEventHub:
    """Relays an engine's KV events to any number of subscribers, with a history and a mirror for late ones.

    Args:
        client: the engine's client, whose backends it subscribes to while it has subscribers.
        history: how many batches it keeps for resuming subscribers.
        buffer: how many unread batches each subscriber may have.

    Attributes:
        sequence: the number of the latest batch (0 before the first).
        live: per data-parallel rank, the blocks its backend caches by their (folded) hash, as its events tell.

    """

    def __init__(self, client: "AsyncEngineClient", history: int = KV_HISTORY, buffer: int = KV_BUFFER) -> None:
        self.client = client
        self.buffer = buffer
        self.id = uuid.uuid4().hex  # this frontend's numbering: another frontend's numbers mean nothing here
        self.sequence = 0
        self.history: collections.deque[KvBatch] = collections.deque(maxlen=history)
        self.live: dict[int, dict[int, KvBlockStored]] = {}
        self.subscriptions: set[KvSubscription] = set()
        self._next_event_id = 1

    def epoch(self) -> str:
        """An id of what the sequence numbers count: this frontend and each backend's start.

        It changes when the frontend or any backend restarts: a subscriber that finds another epoch than the one
        it had throws away what it knew of this server's blocks.
        """
        boot_ids = ",".join(figures.boot_id for figures in self.client.rank_stats())
        return hashlib.sha256(f"{self.id}/{boot_ids}".encode()).hexdigest()[:32]

    def subscribe(self, start: int) -> tuple[KvSubscription, list[KvBatch] | None]:
        """Add a subscriber that read up to batch ``start``: its subscription, and the batches it missed.

        The missed batches are ``None`` when the history does not reach back to ``start`` (or ``start`` is 0, or
        a number this frontend never gave): the subscriber then needs :meth:`snapshot`. Batches published from now
        on go to the subscription.
        """
        if not self.subscriptions:
            self.client.subscribe_kv_events(self.publish)
        subscription = KvSubscription(self.buffer)
        self.subscriptions.add(subscription)
        oldest = self.history[0].sequence if self.history else self.sequence + 1
        if start == 0 or start > self.sequence or start + 1 < oldest:
            return subscription, None
        return subscription, [batch for batch in self.history if batch.sequence > start]

    def unsubscribe(self, subscription: KvSubscription) -> None:
        """Remove a subscriber; the last one gone, the backends stop sending events (and building them)."""
        self.subscriptions.discard(subscription)
        if not self.subscriptions:
            self.client.subscribe_kv_events(None)

    def snapshot(self) -> dict[int, list[KvBlockStored]]:
        """Each rank's live blocks, parents before children, as of batch :attr:`sequence`."""
        return {rank: parents_first(list(blocks.values())) for rank, blocks in sorted(self.live.items())}

    def publish(self, rank: int, events: list[KvEvent]) -> None:
        """Number a backend's batch of events, keep it, apply it to the mirror and hand it to every subscriber."""
        self.sequence += 1
        batch = KvBatch(self.sequence, time.time(), rank, events, self._next_event_id)
        self._next_event_id += len(events)
        live = self.live.setdefault(rank, {})
        for event in events:
            match event:
                case KvBlockStored(block_hash=block_hash):
                    live[block_hash] = event
                case KvBlockRemoved(block_hash=block_hash):
                    live.pop(block_hash, None)
                case KvCacheCleared():
                    live.clear()
        self.history.append(batch)
        for subscription in list(self.subscriptions):
            if not subscription.push(batch):
                self.unsubscribe(subscription)
