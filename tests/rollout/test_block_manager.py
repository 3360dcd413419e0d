"""BlockManager: ref counts, copy-on-write, prefix cache with LRU eviction; random op sequences stay consistent."""

from __future__ import annotations

import random

import pytest

from rlalign.rollout.block_manager import BlockManager, pages_for


def test_append_allocates_exactly_the_pages_for_the_tokens():
    bm = BlockManager(num_pages=10, page_size=4)
    table: list[int] = []
    assert bm.pages_needed(table, 0, 9) == 3
    assert bm.append(table, 0, 9) == []
    assert len(table) == 3 and bm.num_free == 7
    assert bm.append(table, 9, 12) == [] and len(table) == 3    # page 2 has room for tokens 9..11
    assert bm.append(table, 12, 13) == [] and len(table) == 4
    bm.free(table)
    assert table == [] and bm.num_free == 10


def test_append_refuses_without_enough_pages_and_changes_nothing():
    bm = BlockManager(num_pages=3, page_size=4)
    table: list[int] = []
    assert bm.append(table, 0, 13) is None
    assert table == [] and bm.num_free == 3
    assert bm.append(table, 0, 8, reserve=2) is None      # 2 pages + 2 reserved > 3 free
    assert bm.append(table, 0, 8, reserve=1) == []


def test_fork_shares_pages_and_writing_into_a_shared_partial_page_copies_it():
    bm = BlockManager(num_pages=8, page_size=4)
    leader: list[int] = []
    bm.append(leader, 0, 6)                 # prompt of 6 tokens: one full page, one partial
    sibling = bm.fork(leader)
    assert sibling == leader and all(bm.ref_count(p) == 2 for p in leader)
    assert bm.pages_needed(sibling, 6, 7) == 1   # the shared partial page is copied
    copies = bm.append(sibling, 6, 7)
    assert copies == [(leader[1], sibling[1])] and sibling[1] != leader[1]
    assert sibling[0] == leader[0] and bm.ref_count(leader[0]) == 2
    assert bm.ref_count(leader[1]) == 1
    assert bm.append(leader, 6, 7) == []    # now private: written in place
    bm.check_consistency([leader, sibling])


def test_fork_at_a_page_boundary_copies_nothing():
    bm = BlockManager(num_pages=8, page_size=4)
    leader: list[int] = []
    bm.append(leader, 0, 8)
    sibling = bm.fork(leader)
    assert bm.append(sibling, 8, 9) == [] and len(sibling) == 3 and sibling[:2] == leader[:2]
    bm.check_consistency([leader, sibling])


def test_prefix_cache_matches_registered_full_pages_and_evicts_least_recently_freed():
    bm = BlockManager(num_pages=4, page_size=2, enable_prefix_caching=True)
    a: list[int] = []
    bm.append(a, 0, 4)
    bm.register(a[0], b"d0")
    bm.register(a[1], b"d1")
    pages_a = list(a)
    bm.free(a)
    assert bm.num_free == 4 and bm.num_cached == 2
    hit = bm.match_prefix([b"d0", b"d1", b"d2"])
    assert hit == pages_a and bm.prefix_hits == 2
    assert bm.match_prefix([b"zz"]) == []
    bm.free(hit)
    # allocating all 4 pages evicts the cached ones last, least recently freed first
    b: list[int] = []
    bm.append(b, 0, 6)
    assert bm.num_cached == 1 and bm.match_prefix([b"d0"]) == [] and bm.num_free == 1
    bm.check_consistency([b])


def test_register_ignores_duplicates_and_reset_forgets_everything():
    bm = BlockManager(num_pages=4, page_size=2, enable_prefix_caching=True)
    a, b = [], []
    bm.append(a, 0, 2)
    bm.append(b, 0, 2)
    bm.register(a[0], b"d")
    bm.register(b[0], b"d")          # same prefix already cached in a[0]
    assert bm.num_cached == 1
    bm.free(a)
    bm.free(b)
    bm.reset_prefix_cache()
    assert bm.num_cached == 0 and bm.match_prefix([b"d"]) == [] and bm.num_free == 4
    bm.check_consistency([])


def test_prefix_caching_off_never_matches():
    bm = BlockManager(num_pages=4, page_size=2, enable_prefix_caching=False)
    a: list[int] = []
    bm.append(a, 0, 2)
    bm.register(a[0], b"d")
    assert bm.match_prefix([b"d"]) == []


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_ref_counts_consistent(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_pages=24, page_size=3, enable_prefix_caching=True)
    tables: list[tuple[list[int], int]] = []   # (table, tokens computed)
    for _ in range(400):
        op = rng.random()
        if op < 0.45 and tables:
            k = rng.randrange(len(tables))
            table, done = tables[k]
            upto = done + rng.randint(1, 5)
            if bm.append(table, done, upto) is not None:
                tables[k] = (table, upto)
                for b in range(done // 3, upto // 3):
                    bm.register(table[b], bytes([seed, b, rng.randrange(3)]))
        elif op < 0.6 and tables:
            table, done = rng.choice(tables)
            tables.append((bm.fork(table), done))
        elif op < 0.8 and tables:
            table, _ = tables.pop(rng.randrange(len(tables)))
            bm.free(table)
        else:
            digests = [bytes([seed, b, rng.randrange(3)]) for b in range(rng.randint(1, 3))]
            hit = bm.match_prefix(digests)
            tables.append((hit, 3 * len(hit)))
        bm.check_consistency([t for t, _ in tables])
        for table, done in tables:
            assert len(table) >= pages_for(done, 3)
