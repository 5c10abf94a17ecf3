"""The block pool's bookkeeping (node_agent/engine/blocks.py): hash chains, holding and releasing,
reuse of cached prefixes, least-recently-released eviction. No model."""

import pytest

from node_agent.engine.blocks import BlockPool, chain_hashes

ROOT = b"root"


def test_hash_chains_name_a_block_by_everything_before_it():
    a = chain_hashes(list(range(40)), 16, ROOT)
    b = chain_hashes(list(range(32)) + [7] * 8, 16, ROOT)
    c = chain_hashes([99] + list(range(1, 40)), 16, ROOT)
    assert len(a) == 2 and a == b  # only full blocks; the partial third differs and is not hashed
    assert a[0] != c[0] and a[1] != c[1]  # a different first token changes every later block
    assert (
        chain_hashes(list(range(48)), 16, a[1], start=2)
        == chain_hashes(list(range(48)), 16, ROOT)[2:]
    )
    assert chain_hashes(list(range(40)), 16, b"other root") != a


def test_released_blocks_stay_cached_until_evicted_oldest_first():
    pool = BlockPool(4, 16)
    first, second = pool.allocate(2), pool.allocate(2)
    hashes = [bytes([i]) for i in range(4)]
    for block, h in zip(first + second, hashes):
        pool.register(block, h)
    pool.release(first)
    pool.release(second)
    assert (pool.free, pool.used, pool.cached) == (4, 0, 4)
    assert pool.match(hashes[:2]) == first
    pool.allocate(
        1
    )  # evicts the oldest released: first's last block (a tail goes before its prefix)
    assert pool.match(hashes[:2]) == first[:1] and pool.cached == 3


def test_held_blocks_are_shared_and_never_evicted():
    pool = BlockPool(3, 16)
    blocks = pool.allocate(2)
    pool.register(blocks[0], b"h")
    pool.hold(pool.match([b"h"]))  # a second sequence shares the first block
    assert pool.refs[blocks[0]] == 2
    pool.release(blocks)
    assert pool.used == 1 and pool.match([b"h"]) == blocks[:1]
    assert len(pool.allocate(2)) == 2 and pool.free == 0  # the shared block was not evicted
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_without_caching_a_released_block_is_forgotten():
    pool = BlockPool(2, 16, caching=False)
    block = pool.allocate(1)
    pool.register(block[0], b"h")
    pool.release(block)
    assert pool.match([b"h"]) == [] and pool.cached == 0 and pool.free == 2


def test_a_mark_is_held_while_a_block_it_ends_on_is_cached():
    pool = BlockPool(2, 16)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.register(a[0], b"A")
    pool.register(b[0], b"B")
    assert pool.mark(b"A", "m1") and not pool.mark(b"A", "m1")  # new the first time only
    assert not pool.mark(b"B", "m1")  # a second block it ends on (another conversation's estimate)
    assert not pool.mark(b"Z", "m2") and "m2" not in pool.anchors  # no cached block has that hash
    pool.release(a)
    pool.release(b)
    pool.allocate(1)  # evicts A
    assert pool.take_dropped() == []  # m1 still ends on B
    pool.allocate(1)  # evicts B
    assert pool.take_dropped() == ["m1"] and pool.take_dropped() == [] and pool.anchors == {}


def test_marks_are_bounded_by_twice_the_blocks_oldest_first_and_a_reset_drops_them_all():
    pool = BlockPool(1, 16)
    [block] = pool.allocate(1)
    pool.register(block, b"A")
    for i in range(3):
        pool.mark(b"A", f"m{i}")
    assert pool.take_dropped() == ["m0"] and list(pool.anchors) == ["m1", "m2"]
    pool.reset()
    assert sorted(pool.take_dropped()) == ["m1", "m2"] and pool.anchors == {} and pool.marks == {}


# ---- the tiers below the device (node_agent/engine/kv_tiers.py) ---------------------------------


def _tiered(blocks: int, host_slots: int):
    from node_agent.engine.kv_tiers import KVTiers

    pool, tiers = BlockPool(blocks, 16), KVTiers(host_slots, None, block_bytes=100)
    pool.spill, pool.below, tiers.moved = tiers.spill, tiers.where, pool.moved
    return pool, tiers


def test_evicted_blocks_go_to_host_slots_least_recently_used_out_and_their_marks_follow():
    pool, tiers = _tiered(2, 2)
    hashes = [bytes([i]) * 16 for i in range(4)]
    for h in hashes:  # a step each: a block released cached, evicted by a later allocation
        tiers.begin()
        (block,) = pool.allocate(1)
        pool.register(block, h)
        pool.mark(h, f"m{h[0]}")
        pool.release([block])
    assert list(tiers.host.slot_of) == hashes[:2]
    tiers.begin()
    assert pool.allocate(2) == [1, 2]
    assert tiers.offloads == [(1, 0), (2, 1)]  # copied out before the step reuses the blocks
    assert list(tiers.host.slot_of) == hashes[2:]  # the two oldest went out of host memory
    assert pool.take_dropped() == ["m0", "m1"]
    assert dict(pool.take_retiered()) == {"m2": "host", "m3": "host"}
    assert tiers.stats.offloaded_bytes == 4 * 100


def test_a_host_slot_a_plan_reads_is_not_evicted_under_it():
    pool, tiers = _tiered(1, 1)
    tiers.begin()
    (block,) = pool.allocate(1)
    pool.register(block, b"a" * 16)
    pool.release([block])
    pool.allocate(1)  # evicts a into the one slot
    tiers.begin()
    found = tiers.match([b"a" * 16, b"b" * 16])
    assert [f.slot for f in found] == [0]
    assert tiers.spill(2, b"c" * 16) is None and b"a" * 16 in tiers.host.slot_of  # c not kept
    assert tiers.within_budget(found, 16, 512)
    tiers.restore(found, [1], 16)
    assert not tiers.within_budget(found * 300, 16, 512)  # past 8 x 512 tokens after the first
