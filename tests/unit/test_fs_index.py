"""The filesystem store's in-memory index: its recency heap stays bounded by the live entries in a
server that reads much and evicts little, and least-recently-used order survives compaction."""

from __future__ import annotations

from galahad.adapters.fs.index import Index


def _eid(i: int) -> tuple[str, bytes]:
    return ("ns", i.to_bytes(32, "big"))


def test_reads_without_evictions_keep_the_heap_bounded() -> None:
    index = Index()
    for i in range(10):
        index.learn(_eid(i), {0: 100}, tick=i + 1)
    tick = 100
    for _ in range(20_000):  # every read pushes a heap item; only an eviction would pop one
        tick += 1
        index.touch(_eid(tick % 10), tick)
    assert len(index._heap) <= 2 * len(index) + 1024


def test_least_recently_used_order_survives_compaction() -> None:
    index = Index()
    for i in range(5):
        index.learn(_eid(i), {0: 100}, tick=i + 1)
    tick = 10
    for _ in range(3000):  # entries 1-4 read over and over, entry 0 never again
        tick += 1
        index.touch(_eid(1 + tick % 4), tick)
    index.touch(_eid(2), tick + 1)
    # last uses: entry 0 at tick 1, then 4, 1, 3 (the loop's last turns), then 2
    victims = index.trim(300)  # 500 bytes used: the two least recent go
    assert [eid for eid, _ in victims] == [_eid(0), _eid(4)]
    assert index.used() == 300
