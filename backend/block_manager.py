"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, reference counts and prefix sharing."""

from collections import OrderedDict

from spindle.backend.sequence import Sequence


class Block:
    """One block of ``block_size`` KV slots; ``token_ids`` and ``hash`` are set once it is full."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out KV cache blocks to sequences and shares full blocks between sequences with the same prefix.

    A full block is keyed by a hash of its tokens chained with its predecessor's hash, so two sequences
    with the same first ``k * block_size`` tokens (the ``n`` completions of one prompt, or prompts with the
    same system message) point at the same ``k`` blocks. A block whose reference count drops to zero goes
    back to the free list but keeps its contents and hash until it is handed out again, so a preempted
    sequence, or a later prompt with the same prefix, finds it again (least recently freed is reused first).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (some of them still hold reusable cached prefixes)."""
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """How many more blocks ``seq`` needs to hold ``num_new_tokens`` more computed tokens."""
        num_tokens = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the free list can cover ``seq``'s next ``num_new_tokens`` tokens."""
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free)

    def match_prefix(self, seq: Sequence) -> int:
        """Point a new sequence's block table at the cached blocks of its longest cached prefix.

        Returns the number of tokens whose K/V needs no computing. The last token is always computed, since its
        logits are needed, so a prompt cached in full gives back its last block.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        hits: list[int] = []
        parent: int | None = None
        for start in range(0, len(seq) - self.block_size + 1, self.block_size):
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            parent = hash((parent, tokens))
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        if hits and len(hits) * self.block_size >= len(seq):
            hits.pop()
        for block_id in hits:
            self._take(block_id)
        seq.block_table = hits
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        return seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` the blocks for its next ``num_new_tokens`` tokens and publish the blocks they fill.

        Blocks are published (hashed) when allocated rather than after the forward pass: within one step every
        layer writes all new K/V before any attention reads it, so a sequence scheduled in the same step may
        already share them. Callers check :meth:`can_allocate` first.
        """
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            block_id = next(iter(self.free))
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
            self._take(block_id)
            seq.block_table.append(block_id)
        if self.enable_prefix_caching:
            self._publish_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)

    def free_blocks(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (finished, aborted or preempted)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _publish_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        # Blocks before the computed prefix were published when they filled, so start after them.
        first = seq.num_computed_tokens // self.block_size
        parent = self.blocks[seq.block_table[first - 1]].hash if first else None
        for i in range(first, num_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.token_ids = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                block.hash = hash((parent, block.token_ids))
                self.cached.setdefault(block.hash, block.block_id)
            parent = block.hash
