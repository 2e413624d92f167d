"""Ray Serve request routers for the engine deployments.

Serve runs one router per deployment handle, in the process that holds the
handle (the ingress replicas; a driver's handle in tests). `choose_replicas`
returns ranked groups of one replica each: Serve tries the first, and moves on
only when that one's queue is full (`max_ongoing_requests`).

- `PrefixRouter`: the request's block-hash chain (computed in the ingress with
  the engine's own hasher and seed, `payload["block_hashes"]`) is ranked by the
  shared KV index (`index_actor.KVIndexActor.route`), which also records it at
  the chosen replica at once. With one candidate there is nothing to rank: the
  index is told (`route` sent, not awaited) and the request goes on at once.
- `RoundRobinRouter`: the baseline; the turn is kept in the index too, so two
  routers do not both start at replica 0.
Serve's default (power of two choices) is the third policy; it needs no class.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from spur.cluster.routing.index_actor import get_index

logger = logging.getLogger(__name__)
INDEX_TIMEOUT_S = 2.0  # past this (an index restarting), route by queue length


def _payload(pending: PendingRequest | None) -> dict[str, Any]:
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return {}
    return pending.args[0]


class _IndexRouter(RequestRouter):
    lane: str = ""

    def initialize_state(self, **kwargs: Any) -> None:
        self.lane = kwargs.get("lane", "")
        self.weights = dict(kwargs.get("weights", {}))
        self.index = get_index(kwargs.get("index_kwargs"))
        # request id -> the replica ranked first (bounded: a request cancelled
        # before it was routed never pops its entry).
        self.first_choice: OrderedDict[str, str] = OrderedDict()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.drop.remote(replica_id.unique_id)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """One replica per rank, in the index's order; if the index does not answer
        within INDEX_TIMEOUT_S (restarting), every replica in one rank (Serve then
        takes the shortest queue)."""
        if pending_request is not None:
            # When no replica takes the request, Serve asks again: after a pause that
            # doubles (25 ms to 0.5 s) only with this set, else at once, in a loop on
            # the KV index (Serve's own routers set it too).
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        if len(candidate_replicas) == 1:
            # The ranking of one candidate is known: tell the index (it records the
            # chain, counts the decision, binds the session) without waiting for
            # its answer. Awaited, that round trip queued a lane's arrivals one
            # behind another, about 8 ms apart while the forward held both cores.
            only = candidate_replicas[0]
            try:
                self._ask([only.replica_id.unique_id], pending_request)
            except Exception as exc:  # the request goes on without the index
                logger.warning("KV index unavailable (%s); routing to the only replica", exc)
            return [[only]]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        try:
            ranked = await asyncio.wait_for(
                self._rank(list(by_id), pending_request), INDEX_TIMEOUT_S
            )
        except Exception as exc:
            logger.warning("KV index unavailable (%s); routing by queue length", exc)
            return [candidate_replicas]
        return [[by_id[rid]] for rid in ranked if rid in by_id]

    def _ask(self, replica_ids: list[str], pending: PendingRequest | None) -> Any:
        """Send the index this policy's ranking call for `replica_ids`; its ObjectRef
        (the ranked ids) to await, or to drop when the ranking is already known."""
        raise NotImplementedError

    async def _rank(self, replica_ids: list[str], pending: PendingRequest | None) -> list[str]:
        ranked: list[str] = await self._ask(replica_ids, pending)
        return ranked


class PrefixRouter(_IndexRouter):
    """Longest cached prefix, balanced against load (see `routing/policy.py`)."""

    def _ask(self, replica_ids: list[str], pending: PendingRequest | None) -> Any:
        payload = _payload(pending)
        chain = payload.get("block_hashes") or []
        request_id = pending.metadata.internal_request_id if pending is not None else None
        return self.index.route.remote(
            self.lane,
            replica_ids,
            chain,
            self.weights,
            payload.get("session"),
            request_id,
            payload.get("request_id"),  # the engine's id: load until the engine has it
        )

    async def _rank(self, replica_ids: list[str], pending: PendingRequest | None) -> list[str]:
        ranked = await super()._rank(replica_ids, pending)
        if pending is not None and ranked:
            self.first_choice[pending.metadata.internal_request_id] = ranked[0]
            while len(self.first_choice) > 10_000:
                self.first_choice.popitem(last=False)
        return ranked

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request_id = pending_request.metadata.internal_request_id
        first = self.first_choice.pop(request_id, None)
        chosen = replica_id.unique_id
        if first is not None and first != chosen:
            chain = _payload(pending_request).get("block_hashes") or []
            self.index.routed_elsewhere.remote(
                chosen, chain, request_id, _payload(pending_request).get("request_id")
            )


class RoundRobinRouter(_IndexRouter):
    """Healthy replicas in turn, the turn shared through the index."""

    def _ask(self, replica_ids: list[str], pending: PendingRequest | None) -> Any:
        return self.index.round_robin.remote(self.lane, replica_ids)
