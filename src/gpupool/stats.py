"""Prefix-cache statistics as vLLM's ``PrefixCacheStats`` counts them (``vllm/v1/metrics/stats.py``),
shared by both managers (docs/semantics.md section 9, "Admission").

A request's lookup is recorded when it is admitted (vLLM 0.32+: "record at admission so unscheduled
lookups are not counted"): ``queries`` += its token count, ``hits`` += its prefix-hit tokens. A
request resumed after a preemption counts in the ``preempted_*`` fields instead, as in vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class PrefixCacheStats:
    """Counters since the last :meth:`~gpupool.manager.KVCacheManager.make_prefix_cache_stats`:
    ``requests``, ``queries`` (tokens looked up), ``hits`` (tokens hit) of new requests, and the same
    of requests resumed after a preemption (``preempted_*``). All ints >= 0."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """One admitted request's lookup (vLLM's ``PrefixCacheStats.record``)."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` of new requests (0.0 with no query)."""
        return self.hits / self.queries if self.queries else 0.0

    def as_list(self) -> list[int]:
        """The counters in field order (the device manager's ``stats`` vector has this order)."""
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_list(cls, values) -> "PrefixCacheStats":
        return cls(*(int(v) for v in values))


#: Number of counters (the device vector's length).
NUM_PREFIX_STATS = len(fields(PrefixCacheStats))
