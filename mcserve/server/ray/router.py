"""``StateAffinityRouter``: the Ray Serve request router of mcserve's engine replicas
(``docs/scale-out.md``).

Ray serialises a custom router's whole module by value into every process that routes
(``RequestRouterConfig``), so this module holds the router only: no locks, no shared state,
nothing but Ray and the standard library at import.
"""

from __future__ import annotations

import random
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

__all__ = ["StateAffinityRouter", "short_id"]


def short_id(replica_id: str) -> str:
    """``MCServeEngine#ab12cd`` -> ``ab12cd``: the name responses and metrics use."""
    return replica_id.rsplit("#", 1)[-1]


class StateAffinityRouter(RequestRouter):
    """Routes each request to the replica holding the longest cached prefix of its prompt.

    Requests are dicts. ``hashes``: the prompt's segment-aligned block hashes (the engine's
    prefix-cache keys, ``LLMEngine.prefix_hashes``). Per replica the router knows the hashes
    it routed there recently and the hashes the replica reported cached
    (``record_routing_stats``); a replica's match is the number of leading hashes it has.

    * best match > 0 and its queue is within ``imbalanced_threshold`` of the shortest: there
      (``affinity``);
    * best match > 0 but its queue is longer: the least loaded replica (``fallback``);
    * no match: the least loaded replica (``cold``).

    ``req["route"]`` tells the chosen replica which other replica knows most of the prefix and
    how many blocks: the chosen one migrates from it what its own cache lacks.

    ``req["to"]`` pins a call to one replica (the short id), or to any replica when it is gone
    (the callee checks). Requests that are not dicts get a random pair, as the default router.
    """

    def initialize_state(self, imbalanced_threshold: int = 1, routed_ttl_s: float = 30.0,
                         **_: Any) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        # routed hashes count until the replica's own report has had time to include them
        self.routed_ttl_s = routed_ttl_s
        self._routed: dict[ReplicaID, dict[bytes, float]] = {}
        # requests this router assigned and has not seen complete, per replica (and per
        # internal request id, with which completions are reported): a burst of decisions
        # made before any of them reaches a replica sees no queue in Serve's numbers
        self._inflight: dict[ReplicaID, int] = {}
        self._assigned: dict[str, list[ReplicaID]] = {}

    # -- what each replica holds ---------------------------------------------------------------
    def _reported(self, r: RunningReplica) -> set[bytes]:
        stats = r.routing_stats or {}
        cached = stats.get("cached")
        if not cached:
            return set()
        key = id(cached)
        memo = getattr(r, "_mcserve_cached_set", None)
        if memo is None or memo[0] != key:
            memo = (key, set(cached))
            r._mcserve_cached_set = memo  # type: ignore[attr-defined]
        return memo[1]

    def match(self, r: RunningReplica, hashes: list[bytes]) -> int:
        routed = self._routed.get(r.replica_id, {})
        reported = self._reported(r)
        n = 0
        for h in hashes:
            if h not in routed and h not in reported:
                break
            n += 1
        return n

    def _prune(self, now: float) -> None:
        for rid, routed in list(self._routed.items()):
            if rid not in self._replica_id_set:
                del self._routed[rid]
                continue
            stale = [h for h, t in routed.items() if now - t > self.routed_ttl_s]
            for h in stale:
                del routed[h]

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        lens: dict[ReplicaID, int] = {}
        probe: list[RunningReplica] = []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id)
            if q is None:
                probe.append(r)
            else:
                lens[r.replica_id] = q
        if probe:
            for r, q in await self._probe_queue_lens(probe, 0):
                if q is not None:
                    lens[r.replica_id] = q
        return lens

    # -- RequestRouter -------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        req = None
        if pending_request is not None and pending_request.args:
            req = pending_request.args[0] if isinstance(pending_request.args[0], dict) else None
        if req is None or ("hashes" not in req and "to" not in req):
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_name = {short_id(r.replica_id.to_full_id_str()): r for r in candidate_replicas}
        to = req.get("to")
        if to is not None:
            target = by_name.get(to)
            return [[target]] if target is not None else [[random.choice(candidate_replicas)]]
        hashes = req.get("hashes") or []
        lens = await self._queue_lens(candidate_replicas)
        for r in candidate_replicas:
            mine = self._inflight.get(r.replica_id, 0)
            if mine > lens.get(r.replica_id, -1):
                lens[r.replica_id] = mine
        live = [r for r in candidate_replicas if r.replica_id in lens] or candidate_replicas
        inf = float("inf")
        least = min(live, key=lambda r: (lens.get(r.replica_id, inf), random.random()))
        self._prune(time.monotonic())
        matches = {r.replica_id: self.match(r, hashes) for r in live} if hashes else {}
        best = max(live, key=lambda r: (matches.get(r.replica_id, 0),
                                        -lens.get(r.replica_id, 0), random.random()))
        n_best = matches.get(best.replica_id, 0)
        if n_best == 0:
            chosen, reason = least, "cold"
        elif lens.get(best.replica_id, 0) - lens.get(least.replica_id, 0) \
                > self.imbalanced_threshold:
            chosen, reason = least, "fallback"
        else:
            chosen, reason = best, "affinity"
        # the replica that knows most of the prefix besides the chosen one: the chosen replica
        # fetches from it whatever its own cache lacks (after a fallback; or when it was chosen
        # for a prefix it is still importing or prefilling)
        route: dict[str, Any] = {"holder": None, "holder_blocks": 0}
        others = [r for r in live if r.replica_id != chosen.replica_id]
        if hashes and others:
            holder = max(others, key=lambda r: (matches.get(r.replica_id, 0), random.random()))
            if matches.get(holder.replica_id, 0) > 0:
                route = {"holder": short_id(holder.replica_id.to_full_id_str()),
                         "holder_blocks": matches[holder.replica_id]}
        route["reason"] = reason
        # the chosen replica reads it: whom to fetch the prefix from (the request is sent
        # after this returns; a replica that refuses it makes the router choose again)
        req["route"] = route
        self._count(pending_request, chosen.replica_id)
        if hashes:
            # the replica will cache this prefix once it has prefilled it (recorded here, as
            # one replica is chosen: on_request_routed is not called on every send path)
            now = time.monotonic()
            routed = self._routed.setdefault(chosen.replica_id, {})
            for h in hashes:
                routed[h] = now
        return [[chosen]]

    def _count(self, pr: PendingRequest | None, replica_id: ReplicaID) -> None:
        """Count ``pr`` as in flight on ``replica_id`` (moved there if it was chosen before:
        a replica that refused it makes the router choose again)."""
        if pr is None:
            return
        iid = pr.metadata.internal_request_id
        prev = getattr(pr, "_mcserve_replica", None)
        assigned = self._assigned.setdefault(iid, [])
        if prev is not None:
            self._uncount(iid, prev)
            assigned = self._assigned.setdefault(iid, [])
        pr._mcserve_replica = replica_id  # type: ignore[attr-defined]
        assigned.append(replica_id)
        self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1

    def _uncount(self, iid: str, replica_id: ReplicaID) -> None:
        assigned = self._assigned.get(iid)
        if not assigned or replica_id not in assigned:
            return
        assigned.remove(replica_id)
        if not assigned:
            del self._assigned[iid]
        self._inflight[replica_id] = max(0, self._inflight.get(replica_id, 0) - 1)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._uncount(internal_request_id, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._routed.pop(replica_id, None)
        self._inflight.pop(replica_id, None)
