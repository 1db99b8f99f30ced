"""A rollout's side of the weight announcements (asyncrl.liveness): it follows the
experiments it is bound to, loads an announced version as its UpdateWeights RPC would, and
answers on NATS with that answer (its fingerprint) or the error.

`WeightsFollower.follow(experiment_id)` subscribes when the experiment binds (BindExperiment,
before the scheduler may name the rollout in an announcement: the subscription is flushed to
the server first). An announcement that does not name this worker is none of its business.
Announcements of one experiment are handled one after the other, in order. The scheduler
sends an announcement again to whoever has not answered (one may be lost while NATS
reconnects): a repeat of the version last loaded is answered with the answer already given.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError

from asyncrl.errors import status_for
from asyncrl.liveness import ack_subject, weights_subject
from asyncrl.logging import get_logger
from asyncrl.v1 import rollout_pb2, scheduler_pb2

log = get_logger()

FOLLOWED_MAX = 16
"""Experiments followed at once (a LoRA rollout serves several); the oldest is dropped."""

Update = Callable[[rollout_pb2.UpdateWeightsRequest, object], Awaitable]
"""The rollout's UpdateWeights handler: (request, context) -> UpdateWeightsResponse."""


class WeightsFollower:
    """Follows announcements for the worker `agent` keeps registered (`asyncrl.worker`)."""

    def __init__(self, agent, update: Update):
        self.agent = agent
        self.update = update
        self._subs: OrderedDict[str, object] = OrderedDict()
        self._answered: dict[str, tuple[tuple, bytes]] = {}
        """Per experiment: the announcement last handled (version, uri, fingerprint) and the
        answer sent (a rewound lineage announces a lower version: handled as new)."""

    async def follow(self, experiment_id: str) -> None:
        nc = self.agent.nc
        if nc is None or experiment_id in self._subs:
            return  # no NATS (the scheduler then calls UpdateWeights), or followed already
        self._subs[experiment_id] = await nc.subscribe(
            weights_subject(experiment_id), cb=self._announced
        )
        await nc.flush()
        while len(self._subs) > FOLLOWED_MAX:
            _, sub = self._subs.popitem(last=False)
            await sub.unsubscribe()

    async def close(self) -> None:
        nc = self.agent.nc
        if nc is not None and not nc.is_closed:  # else its subscriptions went with it
            for sub in self._subs.values():
                await sub.unsubscribe()
        self._subs.clear()

    async def _announced(self, msg) -> None:
        try:
            ann = scheduler_pb2.WeightsAnnouncement.FromString(msg.data)
        except DecodeError:
            return
        worker_id = self.agent.worker_id
        if worker_id not in ann.workers:
            return
        which = (ann.version, ann.uri, ann.fingerprint)
        last = self._answered.get(ann.experiment_id)
        if last is not None and last[0] == which:  # a repeat: the answer already given
            await self.agent.nc.publish(ack_subject(ann.experiment_id), last[1])
            return
        ack = scheduler_pb2.WeightsAck(
            worker_id=worker_id,
            lease_key=self.agent.lease_key,
            experiment_id=ann.experiment_id,
            version=ann.version,
        )
        request = rollout_pb2.UpdateWeightsRequest(
            experiment_id=ann.experiment_id,
            version=ann.version,
            uri=ann.uri,
            fingerprint=ann.fingerprint,
        )
        try:
            ack.answer.CopyFrom(await self.update(request, None))
        except Exception as e:  # noqa: BLE001 - the scheduler fences with this reason
            code = status_for(e).name  # as the RPC's failure reads: `CODE: details`
            ack.error = f"{code}: {e}" if str(e) else code
            log.warning("announced_weights_failed", version=ann.version, error=ack.error)
        answer = ack.SerializeToString()
        self._answered[ann.experiment_id] = (which, answer)
        await self.agent.nc.publish(ack_subject(ann.experiment_id), answer)
