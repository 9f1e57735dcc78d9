"""Host-side accounting of the paged KV cache: free pages, reference counts and the prefix cache.

A computed full page is hashed over every token up to its end, so a later prompt with those leading tokens takes it,
in use or free, instead of recomputing it. Allocation takes the least recently freed page (forgetting its hash), so
cached prefixes survive as long as there is room.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

from day0jax.engine.paged_cache import TRASH_PAGE


class OutOfPages(RuntimeError):
    """No free page is left (the scheduler preempts a sequence and retries)."""


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The hash of one full block given the hash of the block before it (None for the first). Cryptographic, so
    that a client cannot craft a prompt whose blocks collide with another client's cached prefix and read its keys."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


def salted_root(parent: bytes | None, salt: str, kind: str = "salt") -> bytes:
    """The hash a salted sequence's block chain starts from (after its images' digest, if any): a different salt,
    a different chain, never a shared block. `kind` keeps scopes of different kinds apart ("salt": a tenant's,
    "adapter": a LoRA adapter's, whose keys and values are not the base model's)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(kind.encode() + b":" + salt.encode())
    return h.digest()


class BlockPool:
    """Free list, reference counts and prefix-cache map of `num_pages` pages (page 0 reserved).

    Args:
        num_pages: pages per layer, the trash page included (so `num_pages - 1` are usable).
        page_size: tokens per page.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self.ref = [0] * num_pages  # per page: the sequences whose block table holds it
        self.hash_of: list[bytes | None] = [None] * num_pages
        self.cached: dict[bytes, int] = {}  # hash -> page
        # Free pages in eviction order; values unused (OrderedDict gives O(1) removal from the middle).
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages) if p != TRASH_PAGE)
        self.hits = 0  # pages taken from the prefix cache
        self.queries = 0  # pages looked up in the prefix cache

    @property
    def usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.usable - len(self.free)

    def allocate(self) -> int:
        """Takes the least recently freed page (forgetting any prefix it cached).

        Raises:
            OutOfPages: none is free.
        """
        if not self.free:
            raise OutOfPages("no free KV page")
        page, _ = self.free.popitem(last=False)
        old = self.hash_of[page]
        if old is not None:
            if self.cached.get(old) == page:
                del self.cached[old]
            self.hash_of[page] = None
        self.ref[page] = 1
        return page

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached pages for the longest run of leading block hashes (not yet taken)."""
        pages = []
        for h in hashes:
            page = self.cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def take_cached(self, pages: Sequence[int], queried: int) -> None:
        """Adds a reference to pages found by `lookup` (taking free ones off the free queue).

        Args:
            pages: what `lookup` returned.
            queried: how many blocks were looked up (for the hit-rate metric).
        """
        self.queries += queried
        self.hits += len(pages)
        for page in pages:
            if self.ref[page] == 0:
                del self.free[page]
            self.ref[page] += 1

    def free_count_after_taking(self, pages: Sequence[int]) -> int:
        """How many pages would stay free after `take_cached(pages)`."""
        return len(self.free) - sum(1 for p in pages if self.ref[p] == 0)

    def register(self, page: int, h: bytes) -> None:
        """Records that `page` now holds the full block with hash `h` (first writer wins on duplicates)."""
        if self.hash_of[page] is not None or h in self.cached:
            return
        self.hash_of[page] = h
        self.cached[h] = page

    def release(self, pages: Sequence[int]) -> None:
        """Drops one reference to each page; pages nobody holds become free, the last block evicted first."""
        for page in reversed(pages):
            if page == TRASH_PAGE:
                continue
            self.ref[page] -= 1
            if self.ref[page] < 0:
                raise AssertionError(f"page {page} released more often than taken")
            if self.ref[page] == 0:
                self.free[page] = None

    def check(self) -> None:
        """Asserts the invariants (tests call this): every usable page is free xor referenced, maps agree."""
        for page in range(1, self.num_pages):
            assert (self.ref[page] == 0) == (page in self.free), f"page {page}: ref {self.ref[page]}"
            assert self.ref[page] >= 0
        for h, page in self.cached.items():
            assert self.hash_of[page] == h
