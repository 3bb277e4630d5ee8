"""Prometheus metrics of the scale-out: the per-replica migration counters
(``MigrationMetrics``) and the ingress's merge of every replica's exposition into one
``/metrics`` (``merge_metrics``)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

__all__ = ["MigrationMetrics", "merge_metrics"]


class MigrationMetrics:
    """Per-replica counters of prefix migrations, in the replica's Prometheus registry."""

    def __init__(self, registry: CollectorRegistry):
        self.migrations = Counter(
            "mcserve:state_migrations",
            "Prefix migrations this replica asked for, by outcome (imported: blocks came from "
            "the holder; empty: the holder had nothing; failed: recomputed instead).",
            ["outcome"], registry=registry)
        self.blocks = Counter("mcserve:state_migrated_blocks",
                              "State blocks imported from another replica.", registry=registry)
        self.bytes = Counter("mcserve:state_migrated_bytes",
                             "Bytes of state blocks and resume points imported from another "
                             "replica.", registry=registry)
        self.resume_points = Counter(
            "mcserve:state_migrated_resume_points",
            "Resume points imported from another replica (models without segment blocks "
            "migrate these: the whole recurrent state where the prompt's prefix ends).",
            registry=registry)
        self.seconds = Histogram(
            "mcserve:state_migration_seconds",
            "Time to fetch a prefix's blocks from the holder and queue their import.",
            registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
        self.recomputed = Counter(
            "mcserve:prompt_tokens_recomputed",
            "Prompt tokens prefilled because no cached state (local or migrated) covered "
            "them.", registry=registry)
        self.routed = Counter(
            "mcserve:routed_requests",
            "Requests the state-affinity router sent here, by reason (affinity: this replica "
            "held the longest cached prefix; fallback: another did but was busier, so the "
            "prefix was migrated; cold: no replica held a prefix of it).", ["reason"],
            registry=registry)
        self.exported_blocks = Counter(
            "mcserve:state_exported_blocks",
            "State blocks this replica exported to others.", registry=registry)


class _MergedMetrics(Collector):
    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_metrics(texts: dict[str, str], extra: Iterable[Metric] = ()) -> bytes:
    """One Prometheus exposition of several replicas' ``mcserve:`` metrics, each sample
    labelled ``replica``."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            if not fam.name.startswith("mcserve:"):
                continue
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "replica": replica}, s.value,
                               s.timestamp, s.exemplar)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_MergedMetrics([*merged.values(), *extra]))
    return _generate_latest(reg)
