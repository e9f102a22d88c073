import pytest

from spindle import SamplingParams
from spindle.backend.block_manager import BlockManager
from spindle.backend.sequence import Sequence
from spindle.shared.block_hash import fold_hash
from spindle.shared.protocol import KvBlockRemoved, KvBlockStored, KvCacheCleared, parents_first

BS = 4


def make_seq(tokens: list[int], cache_salt: str | None = None) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(cache_salt=cache_salt), 0.0)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Match the prefix cache, then allocate the rest of the sequence, as the scheduler does for a prompt."""
    cached = bm.match_prefix(seq)
    bm.allocate(seq, len(seq) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(seq)
    return cached


def test_allocate_and_free_restore_the_free_count():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(10)))
    assert bm.blocks_needed(seq, 10) == 3
    admit(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    seq.token_ids += [10, 11, 12]
    bm.allocate(seq, 3)  # 13 tokens -> 4 blocks
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    bm.free_blocks(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_same_prefix_shares_full_blocks_and_recomputes_the_tail():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a, b = make_seq(list(range(10))), make_seq(list(range(10)))
    admit(bm, a)
    assert admit(bm, b) == 8  # two full blocks shared, the partial third block is b's own
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free_blocks(a)
    bm.free_blocks(b)
    assert bm.num_free_blocks == 16


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, make_seq(list(range(8))))
    again = make_seq(list(range(8)))
    assert bm.match_prefix(again) == 4  # the last block is given back so its last token gets logits


@pytest.mark.parametrize(
    "first,second,expected",
    [([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 6, 7, 8, 9], 4), ([1, 2, 3, 4, 5], [9, 2, 3, 4, 5], 0)],
)
def test_prefix_match_stops_at_the_first_different_block(first, second, expected):
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, make_seq(first))
    assert bm.match_prefix(make_seq(second)) == expected


def test_freed_blocks_stay_cached_until_reused_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(list(range(8)) + [99])
    admit(bm, a)
    bm.free_blocks(a)
    assert bm.num_free_blocks == 4
    b = make_seq(list(range(8)) + [42])
    assert admit(bm, b) == 8  # found again after being freed
    bm.free_blocks(b)
    other = make_seq(list(range(100, 116)))  # needs every block: all cached entries are evicted
    admit(bm, other)
    assert bm.cached == {bm.blocks[i].hash: i for i in other.block_table}
    bm.free_blocks(other)
    assert bm.match_prefix(make_seq(list(range(8)) + [1])) == 0


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    admit(bm, make_seq(list(range(12))))
    assert admit(bm, make_seq(list(range(12)))) == 0
    assert bm.num_free_blocks == 10


@pytest.mark.parametrize(
    "first_salt,second_salt,shared",
    [("a", "b", 0), ("a", "a", 8), ("a", None, 0), (None, "a", 0), (None, None, 8)],
)
def test_cache_salt_isolates_the_prefix_cache(first_salt, second_salt, shared):
    bm = BlockManager(num_blocks=16, block_size=BS)
    first, second = make_seq(list(range(10)), first_salt), make_seq(list(range(10)), second_salt)
    admit(bm, first)
    assert admit(bm, second) == second.num_cached_tokens == shared
    assert len(set(first.block_table) & set(second.block_table)) == shared // BS
    bm.free_blocks(first)
    bm.free_blocks(second)  # freed but still cached: a third request finds only its own salt's blocks
    assert bm.match_prefix(make_seq(list(range(10)), "c")) == 0


BASE = dict(parent_tokens=[1, 2, 3, 4], tokens=[5, 6, 7, 8], cache_salt="s")


def second_block_hash(parent_tokens: list[int], tokens: list[int], cache_salt: str | None) -> bytes:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(parent_tokens + tokens, cache_salt)
    admit(bm, seq)
    return bm.blocks[seq.block_table[1]].hash


@pytest.mark.parametrize(
    "change",
    [
        dict(parent_tokens=[1, 2, 3, 9]),
        dict(tokens=[5, 6, 7, 9]),
        dict(tokens=[5, 6, 7, 2**40]),  # ids are 8 bytes each: no truncation to 32 bits
        dict(cache_salt="t"),
        dict(cache_salt=None),
    ],
    ids=lambda change: ",".join(change),
)
def test_a_block_hash_depends_on_its_parent_its_tokens_and_the_salt(change):
    digest = second_block_hash(**BASE)
    assert len(digest) == 32 and second_block_hash(**BASE) == digest  # a SHA-256 digest, the same every time
    assert second_block_hash(**{**BASE, **change}) != digest


def stored(events: list) -> list[KvBlockStored]:
    return [event for event in events if isinstance(event, KvBlockStored)]


def test_stored_events_chain_their_hashes_and_carry_the_tokens():
    bm = BlockManager(num_blocks=8, block_size=BS, lora_name=lambda lora_id: f"adapter-{lora_id}")
    bm.record_events(True)
    assert bm.pop_events() == [KvCacheCleared()]  # an empty cache's snapshot
    seq = Sequence("r", 0, list(range(14)), SamplingParams(), 0.0, lora_id=3)
    admit(bm, seq)
    events = bm.pop_events()
    assert [type(event) for event in events] == [KvBlockStored] * 3  # 14 tokens: three full blocks, a partial one
    hashes = [fold_hash(bm.blocks[block_id].hash) for block_id in seq.block_table[:3]]
    assert [event.block_hash for event in events] == hashes
    assert [event.parent_hash for event in events] == [None, *hashes[:2]]
    assert [event.token_ids for event in events] == [list(range(i, i + BS)) for i in (0, 4, 8)]
    assert {(event.lora_id, event.lora_name) for event in events} == {(3, "adapter-3")}
    assert bm.pop_events() == []
    seq.token_ids += [14, 15]
    bm.allocate(seq, 2)  # the fourth block fills: it is stored once, chained to the third
    (fourth,) = bm.pop_events()
    assert (fourth.parent_hash, fourth.token_ids) == (hashes[2], [12, 13, 14, 15])


def test_reused_blocks_are_removed_by_exactly_their_hashes():
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.record_events(True)
    bm.pop_events()
    first = make_seq(list(range(8)))
    admit(bm, first)
    bm.free_blocks(first)
    second = make_seq(list(range(8)) + [50, 51, 52, 53])  # shares both blocks, takes a free one: nothing evicted
    admit(bm, second)
    bm.free_blocks(second)
    cached = [event.block_hash for event in stored(bm.pop_events())]
    assert len(cached) == 3
    other = make_seq(list(range(100, 110)))  # three blocks: the never-used one, then two cached ones
    admit(bm, other)
    events = bm.pop_events()
    removed = [event.block_hash for event in events if isinstance(event, KvBlockRemoved)]
    assert removed == [cached[2], cached[1]]  # a sequence frees its tail first, so its tail is reused first
    assert len(stored(events)) == 2 and bm.match_prefix(make_seq([0, 1, 2, 3, 9])) == BS  # the head stays


def test_a_late_subscription_starts_from_a_snapshot_parents_first():
    bm = BlockManager(num_blocks=8, block_size=BS)
    admit(bm, make_seq(list(range(12))))
    assert bm.pop_events() == []  # nobody listened: nothing was built
    bm.record_events(True)
    cleared, *snapshot = bm.pop_events()
    assert cleared == KvCacheCleared() and len(snapshot) == 3
    assert [event.parent_hash for event in snapshot] == [None, snapshot[0].block_hash, snapshot[1].block_hash]
    bm.record_events(False)
    admit(bm, make_seq(list(range(200, 212))))
    assert bm.pop_events() == []


def test_reset_clears_the_cache_only_when_no_block_is_held():
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.record_events(True)
    bm.pop_events()
    seq = make_seq(list(range(9)))
    admit(bm, seq)
    bm.pop_events()
    assert not bm.reset_prefix_cache() and bm.pop_events() == []
    bm.free_blocks(seq)
    assert bm.reset_prefix_cache() and bm.pop_events() == [KvCacheCleared()]
    assert bm.match_prefix(make_seq(list(range(9)))) == 0


def test_parents_first_orders_a_parent_stored_again_before_its_children():
    root, child, grandchild = (KvBlockStored(h, p, []) for h, p in ((1, None), (2, 1), (3, 2)))
    assert parents_first([grandchild, child, root]) == [root, child, grandchild]
    orphan = KvBlockStored(9, 8, [])  # its parent was evicted: it comes first, at depth 1
    assert [block.block_hash for block in parents_first([child, orphan, root])] == [9, 1, 2]


def held(bm: BlockManager) -> int:
    """The blocks some sequence holds."""
    return sum(block.ref_count > 0 for block in bm.blocks)


def decode(bm: BlockManager, seq: Sequence, token: int) -> None:
    """One decode step as the scheduler runs it: a block for the new token, then the token computed."""
    seq.token_ids.append(token)
    bm.allocate(seq, 1)
    seq.num_computed_tokens += 1


def test_a_sliding_window_releases_the_blocks_before_it_and_keeps_publishing():
    """A window of 6 over blocks of 4: a decode holds at most ceil(6 / 4) + 1 blocks, the rest go back to the free
    list with their hashes (a later prompt still finds them), and the blocks filled later chain as without a window."""
    windowed, plain = BlockManager(16, BS, sliding_window=6), BlockManager(16, BS)
    seq, same = make_seq(list(range(10))), make_seq(list(range(10)))
    admit(windowed, seq)
    admit(plain, same)
    for token in range(10, 30):
        decode(windowed, seq, token)
        decode(plain, same, token)
        assert held(windowed) <= 3
    released, _ = windowed.released[seq.seq_id]
    assert released == (30 - 6 + 1) // BS == 6 and held(windowed) == len(seq.block_table) - released
    hashes = [windowed.blocks[b].hash for b in seq.block_table[released:]]
    assert None not in hashes[:-1] and hashes == [plain.blocks[b].hash for b in same.block_table[released:]]
    assert windowed.match_prefix(make_seq(list(range(25)))) == 24  # the released blocks, found again
    windowed.free_blocks(seq)
    assert seq.seq_id not in windowed.released and held(windowed) == 6  # the new sequence's matched blocks


def test_a_sliding_window_counts_the_blocks_it_will_release_as_free():
    """With every block held, the next token fits by the block its allocation releases first, unless another
    sequence shares that block."""
    bm = BlockManager(3, BS, sliding_window=6)
    seq = make_seq(list(range(12)))
    admit(bm, seq)
    assert bm.num_free_blocks == 0 and bm.can_allocate(seq, 1)  # token 12's window is 7..12: block 0 is outside
    decode(bm, seq, 12)
    assert bm.released[seq.seq_id][0] == 1 and bm.num_free_blocks == 0 and held(bm) == 3

    bm = BlockManager(4, BS, sliding_window=6)
    seq, sharing = make_seq(list(range(12))), make_seq(list(range(8)) + [60])
    admit(bm, seq)
    assert admit(bm, sharing) == 8 and bm.num_free_blocks == 0
    assert not bm.can_allocate(seq, 1)
