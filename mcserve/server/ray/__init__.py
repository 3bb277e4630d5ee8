"""Scale-out with Ray Serve: N engine replicas behind one OpenAI-compatible endpoint.

::

    HTTP ─▶ Serve proxy ─▶ MCServeIngress (build_app over RemoteAsyncEngine)
                              │ DeploymentHandle, streamed; StateAffinityRouter picks the replica
                              ▼
                           MCServeEngine × N (one LLMEngine each, on its engine thread)
                              │ export_prefix through the same handle + Ray's object store
                              ▼
                           the replica that holds a prompt's cached prefix

* **Ingress** (``MCServeIngress``): the single-process app of ``build_app`` (same routes,
  validation, errors, streaming, drain), over ``RemoteAsyncEngine``, which submits each
  request to the engine deployment through a Serve ``DeploymentHandle`` instead of a local
  engine thread. It tokenizes (so the prompt's segment-aligned block hashes, the engine's
  prefix-cache keys, travel with the request), answers with an ``x-mcserve-replica`` header,
  and serves every replica's ``mcserve:`` metrics on one ``/metrics`` with a ``replica`` label.
* **Engine replicas** (``MCServeEngine``): an ``LLMEngine`` driven by an ``AsyncEngine``, with
  calls queued on the engine thread between steps for the prefix export / import.
* **Routing** (``StateAffinityRouter``, a Ray Serve ``RequestRouter``): a request goes to the
  replica holding the longest cached prefix of its prompt (what it routed there, and the block
  hashes each replica reports through ``record_routing_stats``); when that replica's queue is
  longer than the shortest by more than ``imbalanced_threshold``, to the least loaded one,
  which then *migrates* the prefix: it asks the holder (the same handle, pinned to it) for
  ``export_prefix``, gets the blocks through Ray's object store, imports them and prefills only
  the rest. Token-identical to a recompute (tests/test_ray_serve.py).

``build_serve_app(options)`` builds the Serve application (``mcserve serve --replicas N``);
``app_builder(args)`` is the same for ``serve run mcserve.server.ray:app_builder`` and a
KubeRay RayService (docs/scale-out.md).

Modules, one concern each:

* ``options``: ``RayServeOptions``, ``options_from_args``, the deployment names (no Ray);
* ``replica``: ``MCServeEngine``, ``ReplicaAsyncEngine``, the prefix migration;
* ``ingress``: ``MCServeIngress``, ``RemoteAsyncEngine``, ``RemoteEngineView``,
  ``RemoteRequestStream``, ``known_replicas`` / ``gather_replicas``;
* ``router``: ``StateAffinityRouter`` (Ray pickles this module by value: Ray and the standard
  library only);
* ``metrics``: ``MigrationMetrics`` (replica), ``merge_metrics`` (ingress);
* ``middleware``: ``ReplicaHeaderMiddleware`` (the ``x-mcserve-replica`` header);
* ``deployment``: ``build_serve_app``, ``app_builder``, ``deploy``, ``run_serve_ray``.

The names below are loaded on first access, so that importing one module of the package (a
replica process imports ``replica``, Ray's router ``router``) loads only what it needs. (The
module is ``deployment``, not ``deploy``: a submodule of that name would shadow the function
``deploy`` on the package once imported.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "ENGINE_DEPLOYMENT",
    "DeploymentFailed",
    "INGRESS_DEPLOYMENT",
    "REPLICA_HEADER",
    "MCServeEngine",
    "MCServeIngress",
    "RayServeOptions",
    "RemoteAsyncEngine",
    "RemoteEngineView",
    "StateAffinityRouter",
    "app_builder",
    "build_serve_app",
    "deploy",
    "known_replicas",
    "merge_metrics",
    "options_from_args",
    "run_serve_ray",
]

if TYPE_CHECKING:  # pragma: no cover
    from mcserve.server.ray.deployment import (
        DeploymentFailed,
        app_builder,
        build_serve_app,
        deploy,
        run_serve_ray,
    )
    from mcserve.server.ray.ingress import (
        MCServeIngress,
        RemoteAsyncEngine,
        RemoteEngineView,
        known_replicas,
    )
    from mcserve.server.ray.metrics import merge_metrics
    from mcserve.server.ray.middleware import REPLICA_HEADER
    from mcserve.server.ray.options import (
        ENGINE_DEPLOYMENT,
        INGRESS_DEPLOYMENT,
        RayServeOptions,
        options_from_args,
    )
    from mcserve.server.ray.replica import MCServeEngine
    from mcserve.server.ray.router import StateAffinityRouter

_LAZY = {
    "DeploymentFailed": "deployment",
    "app_builder": "deployment",
    "build_serve_app": "deployment",
    "deploy": "deployment",
    "run_serve_ray": "deployment",
    "MCServeIngress": "ingress",
    "RemoteAsyncEngine": "ingress",
    "RemoteEngineView": "ingress",
    "known_replicas": "ingress",
    "merge_metrics": "metrics",
    "REPLICA_HEADER": "middleware",
    "ENGINE_DEPLOYMENT": "options",
    "INGRESS_DEPLOYMENT": "options",
    "RayServeOptions": "options",
    "options_from_args": "options",
    "MCServeEngine": "replica",
    "StateAffinityRouter": "router",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
