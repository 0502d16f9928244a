"""The page pool's host bookkeeping: references, the free list, the prefix index and its LRU
eviction order, prefix keys and salts, placing sequences with their cached prefix."""

import pytest

from jinfer.paging import SINK_PAGE, KVPages, PagePool, PoolExhausted, SequencePages, extend_keys


def _keys(tokens, salt=None, page=4):
    keys = []
    extend_keys(keys, tokens, page, salt)
    return keys


def test_allocate_share_and_release_count_references():
    pool = PagePool(6, 4)  # 5 usable: page 0 is the sink
    a = pool.allocate(3)
    assert SINK_PAGE not in a and len(set(a)) == 3 and pool.available == 2 and pool.used == 3
    pool.share(a[:1])
    assert pool.refs(a[0]) == 2
    pool.release(a)
    assert pool.refs(a[0]) == 1 and pool.available == 4
    with pytest.raises(PoolExhausted):
        pool.allocate(5)
    assert pool.available == 4  # a refused allocation takes nothing
    pool.release(a[:1])
    assert pool.available == 5 and pool.used == 0
    with pytest.raises(AssertionError):
        pool.release(a[:1])


def test_unreferenced_cached_pages_are_evicted_least_recently_released_first_tails_before_heads():
    pool = PagePool(8, 4)  # 7 usable
    seq_a, seq_b = pool.allocate(3), pool.allocate(3)
    keys_a, keys_b = _keys(range(12)), _keys(range(100, 112))
    for page, key in [*zip(seq_a, keys_a, strict=True), *zip(seq_b, keys_b, strict=True)]:
        pool.register(page, key)
    pool.release(seq_a)  # released first: evicted first, its last page before its first
    pool.release(seq_b)
    assert pool.available == 7 and pool.cached == 6
    assert pool.lookup(keys_a) == seq_a and pool.lookup(keys_b) == seq_b
    assert pool.allocate(1) != seq_a[2]  # the free page goes first
    taken = pool.allocate(2)
    assert taken == [seq_a[2], seq_a[1]]
    assert pool.lookup(keys_a) == seq_a[:1]  # a lookup stops at the first missing page
    pool.share(pool.lookup(keys_b))  # a hit takes its pages out of the eviction order
    assert pool.allocate(1) == [seq_a[0]]
    with pytest.raises(PoolExhausted):
        pool.allocate(1)


def test_keys_name_whole_prefixes_and_salts_keep_them_apart():
    base = _keys(range(10))
    assert len(base) == 2  # full pages only
    assert _keys(range(10)) == base
    assert _keys([99, *range(1, 10)])[1] != base[1]  # a later page's key depends on every earlier token
    assert _keys(range(8)) == base
    assert set(_keys(range(10), salt="tenant")).isdisjoint(base)
    grown = list(base[:1])
    extend_keys(grown, list(range(12)), 4, None)  # extending continues the chain
    assert grown == _keys(range(12))


def test_a_key_cached_twice_keeps_its_first_page_and_the_copy_is_freed():
    pool = PagePool(4, 4)
    key = _keys(range(4))[0]
    first, copy = pool.allocate(2)
    pool.register(first, key)
    pool.register(copy, key)
    pool.release([copy])
    assert pool.lookup([key]) == [first] and pool.available == 2 and pool.cached == 1


def test_drafting_sequences_find_only_pages_that_hold_the_drafts_k_v():
    """A page cached without the draft model's K/V is found by sequences that do not draft only,
    until a drafting sequence caches its own copy of it: that one replaces it in the index."""
    pool = PagePool(5, 4)
    keys = _keys(range(8))
    plain = pool.allocate(2)
    pool.register(plain[0], keys[0])
    pool.register(plain[1], keys[1], drafted=True)
    assert pool.lookup(keys) == plain and pool.lookup(keys, drafted=True) == []
    copy = pool.allocate(1)
    pool.register(copy[0], keys[0], drafted=True)
    assert pool.lookup(keys, drafted=True) == pool.lookup(keys) == [copy[0], plain[1]]
    pool.release(plain)  # the replaced page, no longer cached, is free once released
    assert pool.available == 3 and pool.cached == 2
    pool.forget([copy[0]])
    assert pool.lookup(keys, drafted=True) == []


def test_forgotten_pages_are_no_longer_found_and_unreferenced_ones_become_free():
    pool = PagePool(4, 4)
    keys = _keys(range(8))
    pages = pool.allocate(2)
    for page, key in zip(pages, keys, strict=True):
        pool.register(page, key)
    pool.release(pages[1:])
    pool.forget()
    assert pool.lookup(keys) == [] and pool.cached == 0 and pool.available == 2
    assert pool.refs(pages[0]) == 1


def test_kv_pages_place_share_the_prefix_and_keep_the_block_table():
    kv = KVPages(num_pages=12, page_size=4, slots=2, max_pages=5, prefix_caching=True)
    tokens = list(range(13))
    first = SequencePages()
    assert kv.place(first, 0, tokens, capacity=14) == 0  # nothing cached yet
    assert kv.tables[0, :4].tolist() == first.pages and kv.tables[0, 4] == SINK_PAGE
    kv.register(first, lambda: tokens, written=13)  # three full pages
    version = kv.version
    second = SequencePages()
    assert kv.place(second, 1, tokens, capacity=14) == 12
    assert second.pages[:3] == first.pages[:3] and second.pages[3] != first.pages[3]
    assert kv.version > version and (kv.queries, kv.hits) == (26, 12)
    assert kv.grow(second, 1, capacity=20) and len(second.pages) == 5
    assert kv.grow(second, 1, capacity=40) and len(second.pages) == 5  # never past the table
    freed = kv.remove(second, 1)
    assert freed == [] and kv.tables[1].tolist() == [SINK_PAGE] * 5
    assert kv.pool.refs(first.pages[0]) == 1


def test_catch_up_swaps_pages_another_sequence_has_cached_since():
    kv = KVPages(num_pages=16, page_size=4, slots=2, max_pages=6, prefix_caching=True)
    tokens = list(range(21))
    leader, follower = SequencePages(), SequencePages()
    kv.place(leader, 0, tokens, capacity=22)
    kv.place(follower, 1, tokens, capacity=22)
    kv.register(leader, lambda: tokens, written=16)  # the leader's first chunks are computed
    kv.register(follower, lambda: tokens, written=4)
    assert kv.catch_up(follower, 1, tokens, computed=4) == 16
    assert follower.pages[:4] == [follower.pages[0], *leader.pages[1:4]]
    assert kv.tables[1, 1:4].tolist() == leader.pages[1:4]


def test_poisoned_sequences_leave_nothing_cached_and_return_the_pages_they_alone_held():
    kv = KVPages(num_pages=10, page_size=4, slots=2, max_pages=4, prefix_caching=True)
    tokens = list(range(9))
    healthy, poisoned = SequencePages(), SequencePages()
    kv.place(healthy, 0, tokens, capacity=10)
    kv.register(healthy, lambda: tokens, written=9)
    kv.place(poisoned, 1, tokens, capacity=10)
    shared = poisoned.pages[:2]
    assert shared == healthy.pages[:2]
    own = poisoned.pages[2:]
    assert kv.remove(poisoned, 1, poisoned=True) == own
    assert kv.pool.cached == 0 and kv.pool.refs(shared[0]) == 1
