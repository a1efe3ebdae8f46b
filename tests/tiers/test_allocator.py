import random

from tiercache.tiers.allocator import ExtentAllocator


def test_best_fit_keeps_large_runs_whole():
    a = ExtentAllocator(100)
    first = a.allocate(10)
    a.allocate(5)
    a.free(first)  # free runs: 10 pages at 0, 85 at 15
    assert a.allocate(8)[0].start == 0  # the 10-page hole, not the big run
    a.check()


def test_scattered_pages_still_satisfy_a_request():
    a = ExtentAllocator(10)
    parts = [a.allocate(1) for _ in range(10)]
    for p in parts[::2]:
        a.free(p)
    extents = a.allocate(5)
    assert sum(e.pages for e in extents) == 5 and len(extents) == 5
    assert a.allocate(1) is None
    a.check()


def test_free_merges_neighbours():
    a = ExtentAllocator(30)
    x, y, z = a.allocate(10), a.allocate(10), a.allocate(10)
    a.free(x)
    a.free(z)
    a.free(y)
    assert a.allocate(30) is not None and len(a.allocate(0)) == 0
    a.check()


def test_random_workload_keeps_invariants():
    rng = random.Random(7)
    a = ExtentAllocator(1000)
    live = []
    for _ in range(5000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            got = a.allocate(rng.randint(1, 60))
            if got is not None:
                live.append(got)
        used = sum(e.pages for ex in live for e in ex)
        assert used + a.free_pages == 1000
    pages = sorted(p for ex in live for e in ex for p in range(e.start, e.start + e.pages))
    assert len(pages) == len(set(pages))  # no page handed out twice
    a.check()
