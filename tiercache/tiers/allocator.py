"""The page allocator behind the memory arenas (the host and GPU tiers).

An arena is cut into `total_pages` pages of one size. A record takes `ceil(size / page)` pages, as one contiguous
extent when a free run is large enough (best fit, so big runs stay whole) and otherwise as several extents. So:
- internal fragmentation is bounded by one page per record (the partial last page);
- there is no external fragmentation: any `free_pages >= n` request succeeds, however scattered the free pages are.
Contiguity is preferred because one extent is one memcpy (one DMA in the GPU tier), not because correctness needs it.

Not thread-safe: the owning tier calls it under its metadata lock.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple


class Extent(NamedTuple):
    start: int  # first page
    pages: int


class ExtentAllocator:
    def __init__(self, total_pages: int) -> None:
        self.total_pages = total_pages
        self.free_pages = 0
        self._by_start: dict[int, int] = {}  # start -> pages, for every free extent
        self._by_end: dict[int, int] = {}  # end (exclusive) -> start, to merge with a left neighbour
        self._by_size: list[tuple[int, int]] = []  # (pages, start), sorted, for best fit
        if total_pages:
            self._insert(0, total_pages)

    def allocate(self, pages: int) -> tuple[Extent, ...] | None:
        """Extents totalling exactly `pages`, or None when fewer pages are free (nothing is taken then)."""
        if pages <= 0:
            return ()
        if pages > self.free_pages:
            return None
        i = bisect.bisect_left(self._by_size, (pages, -1))
        if i < len(self._by_size):  # best fit: the smallest free run that is large enough
            return (self._take(self._by_size[i][1], pages),)
        taken = []
        while pages:  # scattered: largest runs first keeps the number of extents small
            size, start = self._by_size[-1]
            n = min(size, pages)
            taken.append(self._take(start, n))
            pages -= n
        return tuple(taken)

    def free(self, extents: tuple[Extent, ...]) -> None:
        for start, pages in extents:
            if pages:
                self._release(start, pages)

    def _take(self, start: int, pages: int) -> Extent:
        size = self._remove(start)
        if size > pages:
            self._insert(start + pages, size - pages)
        return Extent(start, pages)

    def _release(self, start: int, pages: int) -> None:
        end = start + pages
        assert start not in self._by_start and end not in self._by_end, "double free"
        left = self._by_end.get(start)
        if left is not None:
            pages += self._remove(left)
            start = left
        if end in self._by_start:
            pages += self._remove(end)
        self._insert(start, pages)

    def _insert(self, start: int, pages: int) -> None:
        self._by_start[start] = pages
        self._by_end[start + pages] = start
        bisect.insort(self._by_size, (pages, start))
        self.free_pages += pages

    def _remove(self, start: int) -> int:
        pages = self._by_start.pop(start)
        del self._by_end[start + pages]
        del self._by_size[bisect.bisect_left(self._by_size, (pages, start))]
        self.free_pages -= pages
        return pages

    def check(self) -> None:
        """Integrity: free extents are disjoint, never adjacent (always merged), and add up to free_pages."""
        runs = sorted(self._by_start.items())
        assert sum(p for _, p in runs) == self.free_pages
        assert sorted((p, s) for s, p in runs) == self._by_size
        for (s1, p1), (s2, _) in zip(runs, runs[1:]):
            assert s1 + p1 < s2, "free extents overlap or were not merged"
        assert all(0 <= s and s + p <= self.total_pages for s, p in runs)
