"""Deploying the scale-out: the Serve application (``build_serve_app``), its builder for
``serve run mcserve.server.ray:app_builder`` and a KubeRay RayService (``app_builder``),
``deploy`` (``serve.run`` with the replicas' own error on failure), and
``mcserve serve --replicas N`` (``run_serve_ray``)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from mcserve.server.app import DRAIN_SETTLE_S
from mcserve.server.ray.ingress import MCServeIngress
from mcserve.server.ray.options import (
    ENGINE_DEPLOYMENT,
    INGRESS_DEPLOYMENT,
    RayServeOptions,
    options_from_args,
)
from mcserve.server.ray.replica import MCServeEngine
from mcserve.server.ray.router import StateAffinityRouter

logger = logging.getLogger("mcserve.server")

__all__ = ["DeploymentFailed", "app_builder", "build_serve_app", "deploy", "run_serve_ray"]


def build_serve_app(options: RayServeOptions) -> Any:
    """The Serve application: ``options.replicas`` engine replicas behind the ingress."""
    from mcserve.config import EngineConfig

    EngineConfig(**options.engine)  # bad flags fail here, not in every replica
    device = str(options.engine.get("device") or "cpu")
    gpus = options.num_gpus
    if gpus is None:
        gpus = 1.0 if device.startswith("cuda") else 0.0
    actor: dict[str, Any] = {"num_cpus": max(1, options.cpu_threads)}
    if gpus:
        actor["num_gpus"] = gpus
    env = {"OMP_NUM_THREADS": str(max(1, options.cpu_threads))}
    for key in ("MCSERVE_CPU_KERNELS", "MCSERVE_CPU_KERNELS_PORTABLE", "MCSERVE_CPU_ISA"):
        if key in os.environ:
            env[key] = os.environ[key]
    actor["runtime_env"] = {"env_vars": env}
    if options.router == "state":
        router = RequestRouterConfig(
            request_router_class=StateAffinityRouter,
            request_router_kwargs={"imbalanced_threshold": options.imbalanced_threshold},
            request_routing_stats_period_s=options.routing_stats_period_s)
    elif options.router == "pow2":
        router = RequestRouterConfig(request_routing_stats_period_s=options.routing_stats_period_s)
    else:
        raise ValueError(f"router must be 'state' or 'pow2', got {options.router!r}")
    engine = serve.deployment(
        MCServeEngine, name=ENGINE_DEPLOYMENT, num_replicas=options.replicas,
        ray_actor_options=actor, max_ongoing_requests=options.max_ongoing_requests,
        request_router_config=router,
        max_constructor_retry_count=options.max_constructor_retry_count,
        health_check_period_s=options.health_check_period_s,
        graceful_shutdown_timeout_s=options.shutdown_grace_s,
    )
    ingress = serve.deployment(
        MCServeIngress, name=INGRESS_DEPLOYMENT, num_replicas=options.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1024, options.max_ongoing_requests * options.replicas),
        graceful_shutdown_timeout_s=options.shutdown_grace_s,
    )
    return ingress.bind(engine.bind(options), options)


def app_builder(args: dict[str, Any]) -> Any:
    """Application builder for ``serve run mcserve.server.ray:app_builder model=DIR
    replicas=2 ...`` and a KubeRay RayService's ``import_path`` (``args`` as in
    ``options_from_args``)."""
    return build_serve_app(options_from_args(dict(args or {})))


# --------------------------------------------------------------------------------------------
# mcserve serve --replicas N
# --------------------------------------------------------------------------------------------


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host if host not in ("", "0.0.0.0", "::") else "127.0.0.1", 0))
        return int(s.getsockname()[1])


class DeploymentFailed(RuntimeError):
    """A replica could not start; the message is the replica's own error (the loader's)."""


def _failure_reason(app_name: str) -> str | None:
    """The last line of the traceback a failed deployment of ``app_name`` reports: the error
    its replicas' constructor raised (``ValueError: MODEL: no checkpoint at ...``)."""
    try:
        app = serve.status().applications.get(app_name)
    except Exception:  # noqa: BLE001 - no status: the caller keeps Serve's message
        return None
    if app is None:
        return None
    for d in app.deployments.values():
        lines = [ln.strip() for ln in str(d.message or "").splitlines() if ln.strip()]
        if str(d.status).endswith("DEPLOY_FAILED") and lines:
            return lines[-1]
    return None


def deploy(options: RayServeOptions, *, route_prefix: str = "/", blocking: bool = False
           ) -> Any:
    """``serve.run`` of ``build_serve_app(options)`` as application ``options.app_name``;
    returns the ingress handle. A replica that cannot start fails it with
    ``DeploymentFailed(<its error>)`` (after ``max_constructor_retry_count`` tries), not a
    hang and not Serve's generic message."""
    try:
        return serve.run(build_serve_app(options), name=options.app_name,
                         route_prefix=route_prefix, blocking=blocking)
    except RuntimeError as e:
        reason = _failure_reason(options.app_name)
        if reason is None:
            raise
        raise DeploymentFailed(reason) from e


def run_serve_ray(args: Any, config: Any, *, api_key: str | None,
                  ready: Callable[[int, str], None]) -> int:
    """``mcserve serve MODEL --replicas N [--ray-address ADDR]``: start (or join) a Ray
    cluster, deploy the replicas and the ingress, serve until SIGTERM / Ctrl-C, then drain as
    the single server does (503 for new requests, ``--shutdown-timeout`` for running ones,
    the rest aborted and answered) and take the application down.

    ``config``: the validated ``EngineConfig`` of the flags; ``ready(port, served_name)`` is
    called once the application answers."""
    import dataclasses
    import signal

    from mcserve.cli_args import CLIError

    engine = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    if engine.get("model"):
        engine["model"] = str(Path(engine["model"]).expanduser().resolve())
    options = RayServeOptions(
        engine=engine, replicas=args.replicas, cpu_threads=args.replica_threads,
        router=args.router, api_key=api_key, served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes, max_waiting_requests=args.max_waiting_requests,
        shutdown_grace_s=args.shutdown_timeout,
        tool_call_parser=getattr(args, "tool_call_parser", "auto"),
        body_timeout_s=getattr(args, "body_timeout", 60.0) or None)
    started_ray = args.ray_address is None
    if started_ray:
        gpus = options.replicas if str(config.device).startswith("cuda") else None
        ray.init(num_cpus=max(os.cpu_count() or 1, options.replicas * options.cpu_threads),
                 num_gpus=gpus, include_dashboard=False)
    else:
        ray.init(address=args.ray_address)
    port = args.port or _free_port(args.host)
    try:
        serve.start(http_options={"host": args.host, "port": port})
        try:
            handle = deploy(options)
        except DeploymentFailed as e:
            serve.delete(options.app_name)
            raise CLIError(f"the replicas could not start: {e}") from None
        served = args.served_model_name or (Path(engine["model"]).name if engine.get("model")
                                            else "mcserve-default")
        logger.info("mcserve serving %s with %d replicas (Ray Serve, router %s) on port %d",
                    served, options.replicas, options.router, port)
        ready(port, served)
        signals = {"n": 0}
        stop = threading.Event()

        def on_signal(signum: int, frame: Any) -> None:
            signals["n"] += 1
            if signals["n"] >= 3:
                os._exit(1)
            stop.set()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not stop.wait(0.5):
                pass
            logger.info("shutting down: draining (up to %.1f s for running requests)",
                        options.shutdown_grace_s)
            grace = options.shutdown_grace_s if signals["n"] < 2 else 0.0
            try:
                aborted = handle.drain.remote(grace).result(
                    timeout_s=grace + DRAIN_SETTLE_S + 10)
                if aborted:
                    logger.info("shutting down: aborted %d request(s)", aborted)
            except Exception as e:  # noqa: BLE001 - still take the application down
                logger.warning("draining failed: %s", e)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        serve.delete(options.app_name)
    finally:
        if started_ray:
            serve.shutdown()
            ray.shutdown()
    logger.info("mcserve stopped")
    return 0
