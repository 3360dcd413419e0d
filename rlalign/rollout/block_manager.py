"""KV page (block) bookkeeping: reference counts, copy-on-write, prefix hashing.

A page is *free* (ref 0, content worthless), *in use* (ref >= 1: that many block tables hold it)
or *evictable* (ref 0 but registered in the prefix cache: its content is a known token prefix,
reusable until the page is needed; evicted least recently freed first). Pages are shared by forked
samples (ref > 1); a sequence about to write into a shared page gets a private copy first.
A page is registered in the prefix cache only when full and computed, so a registered page is
never written again.

The manager moves page ids only; the K/V copies it asks for are done by the engine (before the
forward that writes into the new pages).
"""

from __future__ import annotations

import collections

import numpy as np


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be > 0, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = np.zeros(num_pages, np.int32)   # an array: the scheduler tests a whole step's pages at once
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._page_digest: dict[int, bytes] = {}
        self._digest_page: dict[bytes, int] = {}
        self.prefix_hits = 0      # pages reused from the prefix cache
        self.cow_copies = 0       # pages copied on write

    # ---- state ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages that can be allocated now (free + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._digest_page)

    def ref_count(self, page: int) -> int:
        return int(self._ref[page])

    @property
    def ref_counts(self) -> np.ndarray:
        """Every page's reference count, int32 indexed by page (read only: the scheduler reads a step's
        pages at once)."""
        return self._ref

    def check_consistency(self, tables: list[list[int]]) -> None:
        """Assert that the ref counts are exactly the number of tables holding each page (tests)."""
        counts = [0] * self.num_pages
        for table in tables:
            for page in table:
                counts[page] += 1
        assert counts == self._ref.tolist(), "page ref counts do not match the block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a page is twice in the free list"
        for page in range(self.num_pages):
            in_free, in_evict = page in free, page in self._evictable
            assert (counts[page] == 0) == (in_free or in_evict), f"page {page}: ref {counts[page]} vs free lists"
            assert not (in_free and in_evict), f"page {page} is free and evictable"
            assert in_evict <= (page in self._page_digest), f"evictable page {page} is not registered"

    # ---- allocation ----------------------------------------------------------------------------

    def _allocate(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            self._unregister(page)
        self._ref[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._ref[page] -= 1
        if self._ref[page] == 0:
            if page in self._page_digest:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def _unregister(self, page: int) -> None:
        digest = self._page_digest.pop(page, None)
        if digest is not None:
            del self._digest_page[digest]

    def pages_needed(self, table: list[int], num_computed: int, upto: int) -> int:
        """New pages :meth:`append` would take to let ``table`` hold tokens [0, upto) with the pages
        covering [num_computed, upto) private (new pages + copy-on-write copies)."""
        first, end = num_computed // self.page_size, pages_for(upto, self.page_size)
        shared = sum(1 for b in range(first, min(end, len(table))) if self._ref[table[b]] > 1)
        return max(0, end - len(table)) + shared

    def append(self, table: list[int], num_computed: int, upto: int,
               reserve: int = 0) -> list[tuple[int, int]] | None:
        """Grow ``table`` (in place) to hold tokens [0, upto); the pages that tokens [num_computed, upto)
        will be written into become private (shared ones are replaced by a copy). Returns the
        (src, dst) page copies to do before the write, or None (nothing changed) when fewer than
        the needed pages + ``reserve`` are available."""
        ps = self.page_size
        first, end = num_computed // ps, -(-upto // ps)
        if end <= len(table):
            # the common step (a decode token, or a chunk inside pages held already): nothing to
            # allocate; nothing to copy unless one of the written pages is shared
            ref = self._ref
            for b in range(first, end):
                if ref[table[b]] > 1:
                    break
            else:
                return None if reserve > len(self._free) + len(self._evictable) else []
        if self.pages_needed(table, num_computed, upto) + reserve > self.num_free:
            return None
        copies = []
        first, end = num_computed // self.page_size, pages_for(upto, self.page_size)
        for b in range(first, min(end, len(table))):
            old = table[b]
            if self._ref[old] > 1:
                new = self._allocate()
                copies.append((old, new))
                self._release(old)
                table[b] = new
        while len(table) < end:
            table.append(self._allocate())
        self.cow_copies += len(copies)
        return copies

    def allocate(self, count: int) -> list[int] | None:
        """``count`` new private pages (ref 1), or None (nothing changed) when fewer are available: the
        pages of a decode step's sequences whose new token starts a page (the scheduler appends them)."""
        if count > self.num_free:
            return None
        return [self._allocate() for _ in range(count)]

    def fork(self, table: list[int]) -> list[int]:
        """A new block table sharing every page of ``table``."""
        for page in table:
            self._ref[page] += 1
        return list(table)

    def free(self, table: list[int]) -> None:
        """Drop ``table``'s references (in place: the table is emptied)."""
        for page in table:
            self._release(page)
        table.clear()

    # ---- prefix cache --------------------------------------------------------------------------

    def match_prefix(self, digests: list[bytes]) -> list[int]:
        """Pages holding the longest cached prefix of ``digests`` (one per full page), referenced
        for the caller (its new block table)."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for digest in digests:
            page = self._digest_page.get(digest)
            if page is None:
                break
            if self._ref[page] == 0:
                del self._evictable[page]
            self._ref[page] += 1
            pages.append(page)
        self.prefix_hits += len(pages)
        return pages

    def register(self, page: int, digest: bytes) -> None:
        """Offer a full, computed page holding the token prefix ``digest`` to the prefix cache
        (ignored when the prefix is already cached in another page)."""
        if not self.enable_prefix_caching or digest in self._digest_page or page in self._page_digest:
            return
        self._page_digest[page] = digest
        self._digest_page[digest] = page

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the KV of other weights is worthless); evictable pages become free."""
        self._page_digest.clear()
        self._digest_page.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
