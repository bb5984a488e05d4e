"""The encoder's plan cache: each call's plan and its graph steps' staged metadata, kept per
grid tuple (oldest out first, within the tuning's entry and byte limits), with its hit and
miss counts and the host time the misses took."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..engine.planner import Plan
from .tuning import PlanTuning


@dataclass
class PreparedPlan:
    plan: Plan
    staged: list  # per step: GraphBank.stage() of its padded metadata, None for an eager step

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.staged if a is not None)


class PlanCache:
    def __init__(self) -> None:
        self._entries: OrderedDict[tuple, PreparedPlan] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = 0
        self.miss_seconds = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> PreparedPlan | None:
        with self._lock:
            prepared = self._entries.get(key)
            self.hits += prepared is not None
            return prepared

    def add(self, key: tuple, prepared: PreparedPlan, seconds: float, keep: bool, limits: PlanTuning) -> None:
        """Count a miss that took ``seconds``; keep its plan where ``keep``."""
        with self._lock:
            self.misses += 1
            self.miss_seconds += seconds
            if not keep or key in self._entries:
                return
            self._entries[key] = prepared
            self.nbytes += prepared.nbytes
            while len(self._entries) > limits.cache_entries or self.nbytes > limits.cache_bytes:
                self.nbytes -= self._entries.popitem(last=False)[1].nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.nbytes, "hits": self.hits, "misses": self.misses,
                    "miss_ms": 1000 * self.miss_seconds / self.misses if self.misses else 0.0}
