"""The KV page pool's host side: which page holds what, who uses it, and which pages hold a prefix.

Plain Python, like the scheduler that owns it; the device only ever sees page numbers in a
fixed-shape block table. Every sequence's positions live in fixed-size pages of one pool shared by
all sequences (`kv_cache.KVCache`); this module decides which pages:

    allocate(n)     n pages: free ones first, then the least recently released cached ones
    share(pages)    another reference to pages found in the prefix index (a prefix hit)
    release(pages)  drop references; an unreferenced page that holds a cached prefix stays in the
                    index (least recently used first out), any other goes back to the free list
    register(...)   a full page becomes findable by its prefix key
    lookup(keys)    the longest run of leading keys whose pages are cached

A full page's key is a hash of (the previous page's key, its tokens): equal keys mean equal token
prefixes, so equal K/V. The first key also takes a salt (`cache_salt`: tenants that must not share
cached prompts use different salts). Keys are SHA-256 digests: a tenant cannot craft a collision
that reads another's cache. With a draft model (`jinfer.draft`) a page may hold the draft's K/V
too, or not (its writer did not draft): a drafting sequence finds only pages that do. Page 0 is
never allocated: block-table entries that map no page point at it, and no write ever lands there
(writes to unmapped positions are dropped on the device).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq
from collections.abc import Callable, Iterable, Sequence

import numpy as np

SINK_PAGE = 0  # what unmapped block-table entries point at; never allocated, never written


def extend_keys(keys: list[bytes], tokens: Sequence[int], page_size: int, salt: str | None) -> None:
    """Append to `keys` (those of the first len(keys) pages of `tokens`) the keys of the full pages
    after them."""
    previous = keys[-1] if keys else hashlib.sha256(b"jinfer-kv" + (salt or "").encode()).digest()
    for first in range(len(keys) * page_size, len(tokens) - page_size + 1, page_size):
        page = np.asarray(tokens[first : first + page_size], np.int64).tobytes()
        previous = hashlib.sha256(previous + page).digest()
        keys.append(previous)


class PoolExhausted(RuntimeError):
    """Not enough free or evictable pages."""


class PagePool:
    """Reference counts, the free list, the prefix index and its LRU order, for `num_pages` pages
    of `page_size` positions (page 0, the sink, included and never handed out)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("a page pool needs at least one page besides the sink")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        # Free pages, lowest first (a heap): a sequence's pages mostly ascend in memory, which the
        # CPU attention kernel streams a little faster than scattered ones (bench_paged_decode.py).
        self._free = list(range(1, num_pages))
        self._key_of: dict[int, bytes] = {}  # cached page -> its key
        self._page_of: dict[bytes, int] = {}  # key -> cached page
        self._drafted: set[int] = set()  # cached pages that hold the draft model's K/V too
        # Cached pages nobody references, least recently released first (evicted in this order).
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    # ------------------------------------------------------------------------------ reading
    @property
    def usable(self) -> int:
        """Pages that can hold tokens (all but the sink)."""
        return self.num_pages - 1

    @property
    def available(self) -> int:
        """Pages an allocation can get now: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Pages some sequence references."""
        return self.usable - self.available

    @property
    def cached(self) -> int:
        """Pages findable in the prefix index (referenced or not)."""
        return len(self._page_of)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def lookup(self, keys: Iterable[bytes], drafted: bool = False) -> list[int]:
        """The cached pages of the longest run of leading `keys` (not yet referenced: `share` them);
        `drafted`: of pages that hold the draft model's K/V too."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None or (drafted and page not in self._drafted):
                break
            pages.append(page)
        return pages

    # ------------------------------------------------------------------------------ changing
    def allocate(self, n: int) -> list[int]:
        """n pages, referenced once each; PoolExhausted (and nothing taken) if there are not n."""
        if n > self.available:
            raise PoolExhausted(f"{n} pages asked for, {self.available} available")
        pages = []
        for _ in range(n):
            if self._free:
                page = heapq.heappop(self._free)
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
                self._drafted.discard(page)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more reference to each of `pages` (cached pages found by `lookup`)."""
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page, the last first: of a sequence's cached pages the later
        ones are evicted before the earlier ones, which more prompts share."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] < 0:
                raise AssertionError(f"page {page} released more often than referenced")
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    heapq.heappush(self._free, page)

    def register(self, page: int, key: bytes, drafted: bool = False) -> None:
        """Make a full, referenced page findable under `key` (`drafted`: it holds the draft
        model's K/V too). A key already cached keeps its page (two sequences computed the same
        prefix at once: the second copy is freed with its owner), unless only the new one holds
        the draft's K/V: the old one then leaves the index."""
        if page in self._key_of:
            return
        cached = self._page_of.get(key)
        if cached is not None:
            if not drafted or cached in self._drafted:
                return
            self.forget([cached])
        self._key_of[page] = key
        self._page_of[key] = page
        if drafted:
            self._drafted.add(page)

    def forget(self, pages: Iterable[int] | None = None) -> None:
        """Take pages (None: every page) out of the prefix index, their contents no longer trusted;
        unreferenced ones among them become free."""
        for page in list(self._key_of) if pages is None else pages:
            key = self._key_of.pop(page, None)
            if key is None:
                continue
            del self._page_of[key]
            self._drafted.discard(page)
            if page in self._evictable:
                del self._evictable[page]
                heapq.heappush(self._free, page)


@dataclasses.dataclass(eq=False)
class SequencePages:
    """Where one sequence's K/V lives, as the host knows it (kept across a preemption: its tokens
    only grow, so its prefix keys stay valid)."""

    salt: str | None = None
    pages: list[int] = dataclasses.field(default_factory=list)  # its block table, in order
    keys: list[bytes] = dataclasses.field(default_factory=list)  # keys of its full pages, as known
    registered: int = 0  # its first pages already findable in the index (or found there)
    # Its K/V goes to the draft model's cache too (a drafting request, `jinfer.draft`): it starts
    # only from cached pages that hold the draft's K/V, and its own are cached as holding them.
    drafted: bool = False


class KVPages:
    """The pool and the block tables of the slots: per slot, the pages of the sequence there.

    The scheduler says which sequence sits in which slot and how many positions it must be able to
    hold (its capacity); this class says whether the pool can, finds cached prefixes, and keeps
    `tables` [slots, max_pages] (the device's block tables; `version` changes with them) true.
    """

    def __init__(self, num_pages: int, page_size: int, slots: int, max_pages: int, prefix_caching: bool):
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.max_pages = max_pages
        self.prefix_caching = prefix_caching
        self.tables = np.full((slots, max_pages), SINK_PAGE, np.int32)
        self.version = 0
        self.queries = 0  # prompt tokens looked up in the prefix index
        self.hits = 0  # ... and found there

    def pages_for(self, capacity: int) -> int:
        """Pages that hold `capacity` positions (never more than a block table has)."""
        return min(-(-capacity // self.page_size), self.max_pages)

    def cached_prefix(self, seq: SequencePages, tokens: Sequence[int]) -> list[int]:
        """Cached pages holding a prefix of `tokens` (nothing is taken). Never all of them: the last
        token is computed again for its logits, and a page shared with others is never written."""
        if not self.prefix_caching:
            return []
        full = (len(tokens) - 1) // self.page_size
        if len(seq.keys) < full:
            extend_keys(seq.keys, tokens[: full * self.page_size], self.page_size, seq.salt)
        return self.pool.lookup(seq.keys[:full], seq.drafted)

    def cost(self, hits: Sequence[int], capacity: int) -> int:
        """Pages the pool gives up to place a sequence of `capacity` positions that starts with
        cached pages `hits` (sharing a cached page nobody holds takes it from the evictable ones)."""
        return self.pages_for(capacity) - len(hits) + sum(self.pool.refs(p) == 0 for p in hits)

    def place(self, seq: SequencePages, slot: int, tokens: Sequence[int], capacity: int) -> int:
        """Put a sequence of `tokens` (to be computed) in `slot` with pages for `capacity`
        positions, its cached prefix shared; PoolExhausted if the pool cannot. Returns the cached
        tokens (its computation starts there)."""
        hits = self.cached_prefix(seq, tokens)
        if self.cost(hits, capacity) > self.pool.available:
            raise PoolExhausted(f"{self.cost(hits, capacity)} pages needed, {self.pool.available} available")
        self.pool.share(hits)
        seq.pages = hits + self.pool.allocate(self.pages_for(capacity) - len(hits))
        seq.registered = len(hits)
        self._set_row(slot, seq.pages)
        cached = len(hits) * self.page_size
        self.queries += len(tokens)
        self.hits += cached
        return cached

    def catch_up(self, seq: SequencePages, slot: int, tokens: Sequence[int], computed: int) -> int:
        """Positions from `computed` on (page-aligned) that another sequence has cached since this
        one was placed: its own pages there are swapped for the cached ones. Returns the new
        computed count."""
        if not self.prefix_caching or computed % self.page_size:
            return computed
        start = computed // self.page_size
        found = self.pool.lookup(seq.keys[start : (len(tokens) - 1) // self.page_size], seq.drafted)
        if not found:
            return computed
        self.pool.share(found)
        self.pool.release(seq.pages[start : start + len(found)])
        seq.pages[start : start + len(found)] = found
        seq.registered = start + len(found)
        self._set_row(slot, seq.pages)
        return computed + len(found) * self.page_size

    def grow(self, seq: SequencePages, slot: int, capacity: int) -> bool:
        """Pages for `capacity` positions; False (nothing taken) if the pool has not enough."""
        more = self.pages_for(capacity) - len(seq.pages)
        if more <= 0:
            return True
        if more > self.pool.available:
            return False
        seq.pages += self.pool.allocate(more)
        self._set_row(slot, seq.pages)
        return True

    def register(self, seq: SequencePages, tokens: Callable[[], Sequence[int]], written: int) -> None:
        """Make the full pages among a sequence's first `written` positions findable (their K/V
        written, by dispatches the device runs before any later reader). `tokens()`: its tokens,
        at least `written` of them (built only when a page has filled)."""
        full = min(written // self.page_size, len(seq.pages))
        if not self.prefix_caching or full <= seq.registered:
            return
        if len(seq.keys) < full:
            extend_keys(seq.keys, tokens()[: full * self.page_size], self.page_size, seq.salt)
        for page, key in zip(seq.pages[seq.registered : full], seq.keys[seq.registered : full], strict=True):
            self.pool.register(page, key, seq.drafted)
        seq.registered = full

    def remove(self, seq: SequencePages, slot: int | None, poisoned: bool = False) -> list[int]:
        """Take a sequence out of its slot and drop its pages (cached ones stay in the index).
        `poisoned`: its pages may hold NaN: none stays cached, and the pages it alone held are
        returned, to be zeroed before anyone gets them."""
        freed = []
        if poisoned:
            self.pool.forget(seq.pages)
            freed = [p for p in seq.pages if self.pool.refs(p) == 1]
        self.pool.release(seq.pages)
        seq.pages, seq.registered = [], 0
        if slot is not None:
            self._set_row(slot, [])
        return freed

    def _set_row(self, slot: int, pages: Sequence[int]) -> None:
        row = self.tables[slot]
        row[:] = SINK_PAGE
        row[: len(pages)] = pages
        self.version += 1
