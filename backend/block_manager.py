"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, reference counts and prefix sharing."""

import hashlib
from collections import OrderedDict
from collections.abc import Callable

from spindle.backend.sequence import Sequence
from spindle.shared.block_hash import block_hash, fold_hash, root_hash
from spindle.shared.protocol import KvBlockRemoved, KvBlockStored, KvCacheCleared, KvEvent, parents_first


def _image_hashes(seq: Sequence, start: int, end: int) -> bytes:
    """The content hashes of ``seq``'s images whose placeholders overlap positions ``[start, end)``, in order."""
    return b"".join(image.content_hash for image in seq.images if image.overlaps(start, end))


def _root(seq: Sequence) -> bytes:
    """What ``seq``'s first block chains from: its salt and adapter, and the embeddings of a prompt given as them.

    Every prompt of embeddings has the same placeholder tokens: without its embeddings' hash, two would share K/V.
    """
    root = root_hash(seq.params.cache_salt, seq.lora_id)
    if seq.prompt_embeds is None:
        return root
    return hashlib.sha256(root + seq.prompt_embeds.content_hash).digest()


class Block:
    """One block of ``block_size`` KV slots; ``hash`` (a SHA-256 digest) is set once it is full.

    With it, what a KV event reports of the block: its predecessor's digest (``None`` for a prompt's first block),
    its tokens and the LoRA adapter its chain started from.
    """

    __slots__ = ("block_id", "ref_count", "hash", "parent", "token_ids", "lora_id")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.parent: bytes | None = None
        self.token_ids: list[int] = []
        self.lora_id: int | None = None


class BlockManager:
    """Hands out KV cache blocks to sequences and shares full blocks between sequences with the same prefix.

    A full block is keyed by the SHA-256 digest of its predecessor's digest, its own tokens and the content hashes of
    the images whose placeholders it holds (:func:`~spindle.shared.block_hash.block_hash`), so two sequences with the
    same first ``k * block_size`` tokens (the ``n`` completions of one prompt, or prompts with the same system message,
    or the same images at the same places) point at the same ``k`` blocks. The first block chains from the request's
    ``cache_salt`` and LoRA adapter (:func:`~spindle.shared.block_hash.root_hash`), so requests with different salts or
    adapters, or a salted and an unsalted one, share no block; unsalted base-model requests share with each other.
    A cryptographic hash means no prompt can be crafted to collide with another's blocks, to read or poison the K/V
    cached for someone else's prefix. A block whose reference count drops to zero goes back to the free list but
    keeps its contents and hash until it is handed out again, so a preempted sequence, or a later prompt with the
    same prefix, finds it again (least recently freed is reused first).

    While :meth:`record_events` is on, it reports what enters and leaves the prefix cache as
    :data:`~spindle.shared.protocol.KvEvent` s, taken with :meth:`pop_events`: a block stored when it is published
    (full, hashed, and the first block of its hash in ``cached``), removed when its hash is dropped to hand it out
    again, and the whole cache cleared by :meth:`reset_prefix_cache`. While it is off, no event is built.

    With a ``sliding_window`` (a model whose every layer slides), the blocks wholly before the window of a
    sequence's next token are released as it advances (:meth:`allocate`): no attention reads them again. Their
    entries stay in its block table (the runner's copy only ever grows), pointing at blocks that may since hold
    other sequences' K/V; the kernels never read a position outside the window. Released blocks keep their hashes
    like any freed block, so a later prompt with that prefix still finds them until they are handed out again, and
    the sequence goes on publishing its later blocks, chained from the last released block's hash.

    Args:
        num_blocks: the KV cache's blocks.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between sequences (else no block is ever cached).
        lora_name: the name of the LoRA adapter of an id, for the events (an adapter unloaded since: ``None``).
        sliding_window: the attention window of every layer, when they all slide (the largest, if they differ);
            None to keep every block of a sequence until it is freed.

    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        lora_name: Callable[[int], str | None] = lambda lora_id: None,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        # By sequence id: how many of its first blocks were released, and the hash of the last of them.
        self.released: dict[int, tuple[int, bytes | None]] = {}
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # digest -> block id
        # Prefix cache lookups since start-up, in tokens: what admitted sequences looked up, and what they found.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        # The last lookup, counted only once its sequence gets blocks: the scheduler hands a sequence it cannot admit
        # back to the queue and looks it up again next step, which must not count twice.
        self._pending_lookup: tuple[Sequence, int] | None = None
        self.lora_name = lora_name
        self.events: list[KvEvent] | None = None  # None: no one listens, so none is built

    def record_events(self, on: bool) -> None:
        """Start collecting KV events from a snapshot of the cache, or with ``on`` false stop (and drop those untaken).

        The snapshot is a clear, then every cached block stored, parents before children.
        """
        self.events = None
        if on:
            cached = [self._stored(self.blocks[block_id]) for block_id in self.cached.values()]
            self.events = [KvCacheCleared(), *parents_first(cached)]

    def pop_events(self) -> list[KvEvent]:
        """The KV events since the last call (none while :meth:`record_events` is off)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so that no later prompt finds one; only while no sequence holds a block.

        Returns whether it did (``False``: some sequence holds blocks, and the cache is unchanged).
        """
        if len(self.free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.hash = block.parent = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(KvCacheCleared())
        return True

    def _stored(self, block: Block) -> KvBlockStored:
        """The event that reports ``block`` (published) stored."""
        parent = None if block.parent is None else fold_hash(block.parent)
        lora_name = None if block.lora_id is None else self.lora_name(block.lora_id)
        return KvBlockStored(fold_hash(block.hash), parent, block.token_ids, block.lora_id, lora_name)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (some of them still hold reusable cached prefixes)."""
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """How many more blocks ``seq`` needs to hold ``num_new_tokens`` more computed tokens."""
        num_tokens = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the free list can cover ``seq``'s next ``num_new_tokens`` tokens.

        It counts the blocks :meth:`allocate` releases first, outside the window, that no other sequence shares.
        """
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed <= len(self.free):
            return True  # the common case, without counting the blocks outside the window
        released, outside = self.released.get(seq.seq_id, (0, None))[0], self._outside_window(seq)
        unshared = sum(self.blocks[block_id].ref_count == 1 for block_id in seq.block_table[released:outside])
        return needed <= len(self.free) + unshared

    def match_prefix(self, seq: Sequence) -> int:
        """Point a new sequence's block table at the cached blocks of its longest cached prefix.

        Returns the number of tokens whose K/V needs no computing. The last token is always computed, since its
        logits are needed, so a prompt cached in full gives back its last block.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        hits: list[int] = []
        parent = _root(seq)
        for start in range(0, len(seq) - self.block_size + 1, self.block_size):
            end = start + self.block_size
            parent = block_hash(parent, seq.token_ids[start:end], _image_hashes(seq, start, end) if seq.images else b"")
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        if hits and len(hits) * self.block_size >= len(seq):
            hits.pop()
        for block_id in hits:
            self._take(block_id)
        seq.block_table = hits
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self._pending_lookup = (seq, seq.num_computed_tokens)
        return seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` the blocks for its next ``num_new_tokens`` tokens and publish the blocks they fill.

        Blocks are published (hashed) when allocated rather than after the forward pass: within one step every
        layer writes all new K/V before any attention reads it, so a sequence scheduled in the same step may
        already share them. Callers check :meth:`can_allocate` first.
        """
        if self._pending_lookup is not None and self._pending_lookup[0] is seq:
            self.num_prefix_queries += len(seq)
            self.num_prefix_hits += self._pending_lookup[1]
            self._pending_lookup = None
        self._release_outside_window(seq)
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            block_id = next(iter(self.free))
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if self.events is not None:
                    self.events.append(KvBlockRemoved(fold_hash(block.hash)))
            block.hash = None
            self._take(block_id)
            seq.block_table.append(block_id)
        if self.enable_prefix_caching:
            self._publish_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)

    def free_blocks(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (finished, aborted or preempted)."""
        released = self.released.pop(seq.seq_id, (0, None))[0]
        for block_id in reversed(seq.block_table[released:]):
            self._release(block_id)
        seq.block_table = []

    def _outside_window(self, seq: Sequence) -> int:
        """How many of ``seq``'s first blocks lie wholly outside its window (0 without one).

        The window is that of its next token, at ``num_computed_tokens``: every later token's starts later still.
        """
        if self.sliding_window is None:
            return 0
        return max(0, seq.num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _release_outside_window(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks outside the window (:meth:`_outside_window`) that it still holds."""
        outside = self._outside_window(seq)
        if not outside:
            return
        released = self.released.get(seq.seq_id, (0, None))[0]
        if outside <= released:
            return
        # Full and published (when prefix caching is on) since they filled: the chain of later blocks goes on from it.
        self.released[seq.seq_id] = (outside, self.blocks[seq.block_table[outside - 1]].hash)
        for block_id in seq.block_table[released:outside]:
            self._release(block_id)

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past ``seq``'s computed tokens, and publish the full blocks its computed tokens fill.

        After a speculative step the engine core moves ``num_computed_tokens`` back over the rejected drafts: their
        K/V slots, written but never published, are given back (or overwritten by the next tokens).
        """
        keep = -(-seq.num_computed_tokens // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        if keep < len(seq.block_table):
            # A new list, not a cut in place: a table only ever grows in place (the runner's InputBuffers rely on it).
            seq.block_table = seq.block_table[:keep]
        if self.enable_prefix_caching:
            self._publish_full_blocks(seq, seq.num_computed_tokens)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _publish_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        # Only blocks of known tokens: a speculative step also computes draft tokens, which may yet be rejected.
        end = min(num_tokens, len(seq)) // self.block_size
        # Earlier blocks were published when they filled: walk back to the last one that was, or was released.
        released, released_hash = self.released.get(seq.seq_id, (0, None))
        first = end
        while first > released and self.blocks[seq.block_table[first - 1]].hash is None:
            first -= 1
        parent = self.blocks[seq.block_table[first - 1]].hash if first > released else released_hash
        for i in range(first, end):
            block = self.blocks[seq.block_table[i]]
            start, stop = i * self.block_size, (i + 1) * self.block_size
            images = _image_hashes(seq, start, stop) if seq.images else b""
            block.token_ids = seq.token_ids[start:stop]
            chained = _root(seq) if parent is None else parent
            block.hash = block_hash(chained, block.token_ids, images)
            block.parent, block.lora_id = parent, seq.lora_id
            # Only the first block of a hash is cached (and stored): a second is a copy no lookup finds.
            if self.cached.setdefault(block.hash, block.block_id) == block.block_id and self.events is not None:
                self.events.append(self._stored(block))
            parent = block.hash
