"""Exporting a membership part's counters on a ``prometheus_client`` registry: one collector shape for all of them.

A part (the KV-event subscriber, the engine-metrics scraper, the Redis shared state) keeps plain counters and
writes one function that renders them as metric families; ``register_families`` puts that function on the
router's registry, which calls it at every scrape. The collector describes no metrics up front (``describe``
returns nothing), so registering it never runs the function and the families are always built from the
counters of the moment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class FamiliesCollector(Collector):
    """A registry collector over ``families``, a function building metric families from counters at scrape time."""

    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self.families = families

    def describe(self) -> list[Metric]:
        """Nothing up front: the registry learns the names at the first scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The families of this scrape."""
        yield from self.families()


def register_families(registry: CollectorRegistry, families: Callable[[], Iterable[Metric]]) -> None:
    """Export the metric families ``families`` builds on ``registry`` (called at every scrape)."""
    registry.register(FamiliesCollector(families))
