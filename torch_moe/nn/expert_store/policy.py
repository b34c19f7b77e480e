"""Eviction policies of the expert cache: which resident expert gives up its slot.

A policy sees every request (``touch``, once per step and expert) and picks a victim among the
candidates the cache offers (resident experts in slots that no computation holds and that the
current step does not need). It never sees pinned slots, so it cannot evict them.
"""

import itertools

__all__ = ["EvictionPolicy", "LRU", "LFU", "POLICIES", "make_policy"]


class EvictionPolicy:
    def touch(self, expert: int) -> None:
        raise NotImplementedError

    def victim(self, candidates: list) -> int:
        """The expert, among ``candidates`` (resident expert ids), to evict."""
        raise NotImplementedError

    def seed(self, counts: list) -> None:
        """Prior request counts per expert (e.g. from calibration); LRU ignores them."""


class LRU(EvictionPolicy):
    """Least recently used: evicts the expert whose last request is the oldest."""

    def __init__(self):
        self._clock = itertools.count(1)
        self._last: dict = {}

    def touch(self, expert: int) -> None:
        self._last[expert] = next(self._clock)

    def victim(self, candidates: list) -> int:
        return min(candidates, key=lambda e: self._last.get(e, 0))


class LFU(EvictionPolicy):
    """Least frequently used: evicts the expert requested the fewest times so far (counted over
    the whole run, resident or not, so that a popular expert that was evicted once comes back
    with its history); ties go to the least recently used."""

    def __init__(self):
        self._lru = LRU()
        self._count: dict = {}

    def touch(self, expert: int) -> None:
        self._count[expert] = self._count.get(expert, 0) + 1
        self._lru.touch(expert)

    def victim(self, candidates: list) -> int:
        return min(candidates, key=lambda e: (self._count.get(e, 0), self._lru._last.get(e, 0)))

    def seed(self, counts: list) -> None:
        for e, c in enumerate(counts):
            self._count[e] = self._count.get(e, 0) + c


POLICIES = {"lru": LRU, "lfu": LFU}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"expert cache: expected policy in {sorted(POLICIES)}, but got {name!r}")
    return POLICIES[name]()
