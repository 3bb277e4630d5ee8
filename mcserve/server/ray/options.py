"""``RayServeOptions``: what a scale-out deployment is made of (the engine's ``EngineConfig``
fields, the single server's flags, the replica layout), and the names of its two deployments.
Shared by the replica, the ingress and the deployment; nothing of Ray at import."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ENGINE_DEPLOYMENT", "INGRESS_DEPLOYMENT", "RayServeOptions", "options_from_args"]

ENGINE_DEPLOYMENT = "MCServeEngine"
INGRESS_DEPLOYMENT = "MCServeIngress"


@dataclass
class RayServeOptions:
    """What ``mcserve serve --replicas N`` deploys: the engine flags (``EngineConfig`` fields)
    and the server flags of the single-process server, plus the replica layout."""

    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig(**engine)
    replicas: int = 2
    cpu_threads: int = 1  # torch threads (and Ray CPUs) per replica
    num_gpus: float | None = None  # per replica; None: 1 when the device is CUDA, else 0
    router: str = "state"  # "state" (StateAffinityRouter) or "pow2" (Ray Serve's default)
    # queue-length gap beyond which affinity yields to load: small, since the replica that
    # takes the request migrates the prefix instead of recomputing it
    imbalanced_threshold: int = 1
    routing_stats_period_s: float = 1.0
    max_ongoing_requests: int = 256  # per replica, for Serve's router; the engine queues
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 4 * 2**20
    max_waiting_requests: int | None = 512  # per replica: beyond it, 429
    shutdown_grace_s: float = 10.0
    tool_call_parser: str = "auto"  # --tool-call-parser
    body_timeout_s: float | None = 60.0  # --body-timeout (None: no limit)
    ingress_replicas: int = 1
    max_constructor_retry_count: int = 1  # a replica that cannot load the model fails fast
    health_check_period_s: float = 2.0
    app_name: str = "mcserve"


_INT_FIELDS = ("replicas", "cpu_threads", "imbalanced_threshold", "max_ongoing_requests",
               "max_body_bytes", "max_waiting_requests", "ingress_replicas",
               "max_constructor_retry_count")
_FLOAT_FIELDS = ("num_gpus", "routing_stats_period_s", "shutdown_grace_s",
                 "health_check_period_s", "body_timeout_s")


def options_from_args(args: dict[str, Any]) -> RayServeOptions:
    """``RayServeOptions`` from flat string-or-typed arguments (``serve run ... key=value``,
    a RayService's ``args``): the engine's fields by their ``EngineConfig`` names, the rest
    by ``RayServeOptions`` names."""
    import dataclasses

    from mcserve.config import EngineConfig

    engine_fields = {f.name: f for f in dataclasses.fields(EngineConfig) if f.init}
    opt_fields = {f.name for f in dataclasses.fields(RayServeOptions)} - {"engine"}
    engine: dict[str, Any] = {}
    opts: dict[str, Any] = {}
    for key, val in args.items():
        k = key.replace("-", "_")
        if k in opt_fields:
            if k in _INT_FIELDS and val is not None:
                val = int(val)
            elif k in _FLOAT_FIELDS and val is not None:
                val = float(val)
            opts[k] = val
        elif k in engine_fields:
            engine[k] = _engine_value(engine_fields[k], val)
        else:
            raise ValueError(f"unknown argument {key!r}")
    if engine.get("model"):
        engine["model"] = str(Path(engine["model"]).expanduser().resolve())
    return RayServeOptions(engine=engine, **opts)


def _engine_value(f: Any, val: Any) -> Any:
    if not isinstance(val, str):
        return val
    ann = str(f.type).replace(" ", "")
    if ann.startswith("bool"):
        return val.strip().lower() in ("1", "true", "yes", "on")
    if ann.startswith("int"):
        return int(val)
    if ann.startswith("float|tuple"):
        return float(val) if "," not in val else tuple(float(v) for v in val.split(","))
    if ann.startswith("float"):
        return float(val)
    return val
