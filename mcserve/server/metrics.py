"""Prometheus metrics: the engine's ``stats()`` snapshot under vLLM-style names, and the
per-request latency histograms the engine thread observes (``RequestMetricsSink``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mcserve.server.async_engine import AsyncEngine


class EngineStatsCollector(Collector):
    """Exposes the engine's ``stats()`` snapshot under vLLM-style names (prefix ``mcserve:``)."""

    def __init__(self, aengine: AsyncEngine):
        self.aengine = aengine

    def collect(self) -> Iterable[Any]:
        s = self.aengine.stats()

        def num(key: str, default: float = 0.0) -> float:
            v = s.get(key, default)
            return float(v) if isinstance(v, (int, float)) else default

        yield GaugeMetricFamily("mcserve:num_requests_running",
                                "Requests being computed by the engine.",
                                value=num("num_requests_running"))
        yield GaugeMetricFamily("mcserve:num_requests_waiting",
                                "Requests waiting to be scheduled.",
                                value=num("num_requests_waiting"))
        tiers = _tiers(s)
        used_g = GaugeMetricFamily("mcserve:state_blocks_used",
                                   "Memory-state blocks in use (cached segment checkpoints).",
                                   labels=["tier"])
        total_g = GaugeMetricFamily("mcserve:state_blocks_total",
                                    "Memory-state blocks in the pool.", labels=["tier"])
        for tier, (used, total) in tiers.items():
            used_g.add_metric([tier], used)
            total_g.add_metric([tier], total)
        yield used_g
        yield total_g
        yield GaugeMetricFamily("mcserve:state_slots_used",
                                "Recurrent-state slots held by sequences (one per sequence "
                                "being computed).", value=num("state_slots_used"))
        yield GaugeMetricFamily("mcserve:state_slots_total",
                                "Recurrent-state slots in the pool.",
                                value=num("state_slots_total"))
        yield GaugeMetricFamily("mcserve:state_blocks_cached",
                                "Memory-state blocks free for reuse but kept for the prefix "
                                "cache.", value=num("state_blocks_cached"))
        yield GaugeMetricFamily("mcserve:num_requests_in_flight",
                                "Requests the server submitted to the engine and not yet "
                                "finished, aborted or failed.",
                                value=float(self.aengine.num_in_flight))
        dev_used, dev_total = tiers.get("device", (0.0, 0.0))
        yield GaugeMetricFamily("mcserve:state_cache_usage_perc",
                                "Fraction of the device state-block pool in use (0..1).",
                                value=dev_used / dev_total if dev_total else 0.0)
        for key, doc in (
            ("resume_points", "Resume points held in memory (device and host tiers)."),
            ("resume_points_disk", "Resume points in the disk tier."),
            ("resume_bytes_device", "Bytes of resume points on the device tier."),
            ("resume_bytes_host", "Bytes of resume points on the host tier."),
            ("resume_bytes_disk", "Bytes of resume point files in the disk tier."),
        ):
            yield GaugeMetricFamily(f"mcserve:{key}", doc, value=num(key))
        for key, name, doc in (
            ("prefix_cache_queries", "prefix_cache_queries", "Prefix-cache block lookups."),
            ("prefix_cache_hits", "prefix_cache_hits", "Prefix-cache block hits."),
            ("prompt_tokens_total", "prompt_tokens", "Prompt tokens taken by the engine."),
            ("generation_tokens_total", "generation_tokens", "Tokens generated."),
            ("prompt_tokens_cached", "prompt_tokens_cached",
             "Prompt tokens served from the state cache (segment blocks, resume points)."),
            ("prompt_tokens_computed", "prompt_tokens_computed",
             "Prompt tokens the engine computed (not served from the state cache)."),
            ("resume_points_taken", "resume_points_taken",
             "Resume points kept (the recurrent state at a token position)."),
            ("resume_points_hit", "resume_points_hit", "Requests that resumed from one."),
            ("resume_points_evicted", "resume_points_evicted",
             "Resume points dropped from the last tier of the state cache."),
            ("resume_points_spilled_host", "resume_points_spilled_host",
             "Resume points moved from the device to the host tier."),
            ("resume_points_spilled_disk", "resume_points_spilled_disk",
             "Resume points written to the disk tier."),
            ("resume_points_loaded_disk", "resume_points_loaded_disk",
             "Resume points read back from the disk tier."),
            ("resume_files_skipped", "resume_files_skipped",
             "Files of the disk tier skipped as unreadable, corrupt or another model's."),
            ("num_preemptions", "num_preemptions", "Sequences preempted."),
            ("num_swaps", "num_swaps", "Preempted sequences swapped to the host tier."),
            ("host_bytes_moved", "host_bytes_moved",
             "Bytes of memory states moved between the host tier and the device (swaps, "
             "ssc offloads and fetches of selected blocks)."),
        ):
            yield CounterMetricFamily(f"mcserve:{name}", doc, value=num(key))


def _tiers(s: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """{tier: (used, total)} from the stats: ints mean the device tier; dicts are per tier."""
    used, total = s.get("state_blocks_used", 0), s.get("state_blocks_total", 0)
    out: dict[str, tuple[float, float]] = {}
    if isinstance(used, dict) or isinstance(total, dict):
        u = used if isinstance(used, dict) else {"device": used}
        t = total if isinstance(total, dict) else {"device": total}
        for tier in sorted(set(u) | set(t)):
            out[str(tier)] = (float(u.get(tier, 0)), float(t.get(tier, 0)))
    else:
        out["device"] = (float(used or 0), float(total or 0))
    if "host_blocks_used" in s or "host_blocks_total" in s:
        out["host"] = (float(s.get("host_blocks_used", 0) or 0),
                       float(s.get("host_blocks_total", 0) or 0))
    return out


class ServerMetrics:
    """The app's Prometheus registry (one per app) and the per-request histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "mcserve:time_to_first_token_seconds", "Time to first token.", registry=r,
            buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0))
        self.itl = Histogram(
            "mcserve:inter_token_latency_seconds", "Time between two outputs of a request.",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                     0.5, 0.75, 1.0, 2.5, 5.0, 10.0))
        self.e2e = Histogram(
            "mcserve:e2e_request_latency_seconds", "Arrival to finish of a request.",
            registry=r,
            buckets=(0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                     40.0, 50.0, 60.0, 120.0, 240.0, 480.0))
        self.queue = Histogram(
            "mcserve:request_queue_time_seconds",
            "Arrival to the start of the engine step that first scheduled the request.",
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        self.success = Counter(
            "mcserve:request_success", "Finished requests by finish reason.",
            ["finished_reason"], registry=r)

    # RequestMetricsSink (called from the engine thread; prometheus_client is thread-safe)
    def observe_queue_time(self, seconds: float) -> None:
        self.queue.observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds)

    def count_finished(self, reason: str) -> None:
        self.success.labels(finished_reason=reason).inc()
