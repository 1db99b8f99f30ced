"""Client of Reward.Score with fail-over across reward replicas.

Score is idempotent, so a transient failure (UNAVAILABLE, DEADLINE_EXCEEDED) goes at once to
each other replica not tried yet (the newest heartbeat's list first: a replica that left on a
hand-over or scale-down costs one refused attempt, no backoff), then is retried through
`asyncrl.retry.idempotent_rpc` for up to `max_wait_s`, every attempt to the next address of the
newest list: a dead replica costs one fast failure, not the group, and a restarted one is found
again. A reward service that stays unreachable is an infrastructure fault, not the sample's
fate: `RewardUnavailable`, which the rollout turns into an UNAVAILABLE GenerateGroup so the
scheduler retries the group under the same id. A slow or hung reward function is not: the
service answers every call before its deadline (`score_deadline`), an item it could not score
by then FAILED with the reason, so a DEADLINE_EXCEEDED here means a service that does not
answer at all. Any other error status is the reward service's
answer about these items: FAILED scores with the reason. Addresses are picked round-robin across
calls so the load spreads over the replicas.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from dataclasses import dataclass, field

import grpc

from asyncrl.convert import status_from_proto
from asyncrl.grpcutil import channel
from asyncrl.logging import get_logger
from asyncrl.retry import RETRYABLE_CODES, idempotent_rpc
from asyncrl.types import RewardStatus, Score, ScoreItem
from asyncrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc

log = get_logger(component="reward_client")


class RewardUnavailable(RuntimeError):
    """No reward service answered within the client's `max_wait_s`; the message says what the
    last attempt got."""


def score_deadline(timeout_s: float, n_items: int) -> float:
    """RPC deadline for one Score call: the reward service enforces `timeout_s` per item, and
    in the worst case scores items one after another; plus slack for transport."""
    return 10.0 + timeout_s * max(1, n_items)


@dataclass(frozen=True)
class RewardBinding:
    """What a reward worker needs to score an experiment's items: sent once per worker."""

    experiment_id: str
    spec_json: str
    timeout_s: float
    """Per-item timeout of the experiment's reward function."""


class RewardClient:
    def __init__(self, max_wait_s: float = 10.0):
        self.max_wait_s = max_wait_s
        """How long one Score call keeps retrying unreachable replicas: a supervisor restarts a
        dead one in about a second, and the scheduler's next dispatch carries the addresses
        of replicas that registered meanwhile."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, reward_pb2_grpc.RewardStub] = {}
        self._bound: set[tuple[str, str]] = set()
        """(address, experiment) pairs already bound."""
        self._rr = itertools.count()
        self._pending: dict[tuple[RewardBinding, tuple[str, ...]], _Batch] = {}
        """Items asked for in this pass of the event loop, sent together at its end."""
        self._sending: set[asyncio.Task] = set()
        self._latest: tuple[str, ...] = ()
        """The addresses of the newest call (a replica that stopped has left the scheduler's
        list, the one started in its place is on it)."""
        self._heard: tuple[str, ...] = ()
        """The scheduler's list at the newest heartbeat (`known`): newer than a call's list,
        which was the list when its group was dispatched."""

    def known(self, addresses) -> None:
        """The scheduler's list of reward addresses now (`asyncrl.fleet.rewards`): retries
        go there. An empty list (the only replica is restarting) keeps the last one."""
        if addresses:
            self._heard = tuple(addresses)

    def _newest(self, own: tuple[str, ...]) -> tuple[str, ...]:
        """Where a failed call turns: the heartbeat's list, else the newest call's, else its
        own."""
        return self._heard or self._latest or own

    def _stub(self, address: str) -> reward_pb2_grpc.RewardStub:
        stub = self._stubs.get(address)
        if stub is None:
            self._channels[address] = channel(address, "rollout")
            stub = self._stubs[address] = reward_pb2_grpc.RewardStub(self._channels[address])
        return stub

    async def score(
        self, addresses: list[str], binding: RewardBinding, items: list[ScoreItem]
    ) -> list[Score]:
        """Scores of `items`, in their order. Calls made in the same pass of the event loop
        for the same experiment and replicas share one Score call (the groups that finish
        together: one RPC, not one per group); each caller gets its own items' scores, or the
        shared call's failure. Raises RewardUnavailable when no address answers within
        `max_wait_s`."""
        if not addresses:
            raise RewardUnavailable("no reward service address")
        key = (binding, tuple(addresses))
        self._latest = key[1]
        loop = asyncio.get_running_loop()
        batch = self._pending.get(key)
        if batch is None:
            batch = self._pending[key] = _Batch(list(addresses), binding)
            loop.call_soon(self._send, key)
        waiter = loop.create_future()  # its own: one caller cancelled cancels no other's
        batch.callers.append((waiter, len(batch.items), len(items)))
        batch.items.extend(items)
        return await waiter

    def _send(self, key: tuple[RewardBinding, tuple[str, ...]]) -> None:
        batch = self._pending.pop(key)
        task = asyncio.ensure_future(self._score_batch(batch.addresses, batch.binding, batch.items))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        task.add_done_callback(batch.settle)

    async def _score_batch(
        self, addresses: list[str], binding: RewardBinding, items: list[ScoreItem]
    ) -> list[Score]:
        """Score `items` with one Score call (failing over between `addresses`)."""
        req = reward_pb2.ScoreRequest(experiment_id=binding.experiment_id)
        add = req.items.add  # built in place: messages passed in would be copied (~2 µs a group)
        for i in items:
            add(id=i.id, prompt=i.prompt, completion=i.completion, answer=i.answer)
        start = next(self._rr)
        order = tuple(addresses[(start + k) % len(addresses)] for k in range(len(addresses)))
        deadline = score_deadline(binding.timeout_s, len(items))
        resp = None
        try:
            for address in self._fail_over(order):  # no wait: each replica not tried yet
                try:
                    resp = await self._score_once(address, binding, req, deadline)
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() not in RETRYABLE_CODES:
                        raise
            if resp is None:
                # bounded by time, not by attempts: each attempt after the first waits up to 2 s
                tried = self._retry_order(order)
                policy = idempotent_rpc(attempts=sys.maxsize, max_delay_s=self.max_wait_s)
                async for attempt in policy:
                    with attempt:
                        address = next(tried)
                        resp = await self._score_once(address, binding, req, deadline)
        except grpc.aio.AioRpcError as e:
            reason = f"reward service {address}: {e.code().name}: {e.details()}"
            log.warning("reward_call_failed", reason=reason, addresses=addresses)
            if e.code() in RETRYABLE_CODES:
                raise RewardUnavailable(reason) from None
            return [Score(reward=0.0, status=RewardStatus.FAILED, reason=reason) for _ in items]
        by_id = {r.id: r for r in resp.results}
        return [_score(by_id.get(i.id)) for i in items]

    def _fail_over(self, order: tuple[str, ...]):
        """`order`'s first address, then at once every other replica not tried yet: the newest
        heartbeat's, the newest call's, this call's (read at each step: a heartbeat may come
        meanwhile). A replica that left (a hand-over, a scale-down) costs one refused attempt,
        not a backoff: its successor or the other replicas answer the same call."""
        tried = {order[0]}
        yield order[0]
        while True:
            known = (*self._heard, *self._latest, *order)
            fresh = [a for a in known if a not in tried]
            if not fresh:
                return
            tried.add(fresh[0])
            yield fresh[0]

    def _retry_order(self, order: tuple[str, ...]):
        """Round-robin over the newest list (`_newest`), after every replica failed once."""
        k = 1
        while True:
            pool = self._newest(order)
            yield pool[k % len(pool)]
            k += 1

    async def _score_once(
        self, address: str, binding: RewardBinding, req: reward_pb2.ScoreRequest, deadline: float
    ) -> reward_pb2.ScoreResponse:
        """Bind the experiment on `address` the first time; once more if the worker forgot it
        (it restarted: FAILED_PRECONDITION)."""
        await self._bind(address, binding)
        try:
            return await self._stub(address).Score(req, timeout=deadline)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
        self._bound.discard((address, binding.experiment_id))
        await self._bind(address, binding)
        return await self._stub(address).Score(req, timeout=deadline)

    async def _bind(self, address: str, binding: RewardBinding) -> None:
        key = (address, binding.experiment_id)
        if key in self._bound:
            return
        request = common_pb2.BindExperimentRequest(
            experiment_id=binding.experiment_id, spec_json=binding.spec_json
        )
        await self._stub(address).BindExperiment(request, timeout=10.0)
        self._bound.add(key)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stubs.clear()
        self._bound.clear()


@dataclass
class _Batch:
    addresses: list[str]
    binding: RewardBinding
    items: list[ScoreItem] = field(default_factory=list)
    callers: list[tuple[asyncio.Future, int, int]] = field(default_factory=list)
    """Each caller's future, and where its items start in `items` and how many there are: a
    future each, not one shielded future shared (that cost each caller a second future and two
    callbacks)."""

    def settle(self, task: asyncio.Task) -> None:
        """Each caller still waiting gets its slice of the scores, or the call's failure (the
        task's exception is retrieved here, even when every caller was cancelled meanwhile)."""
        error = None if task.cancelled() else task.exception()
        scores = None if task.cancelled() or error is not None else task.result()
        for waiter, start, count in self.callers:
            if waiter.done():  # its caller was cancelled
                continue
            if scores is not None:
                waiter.set_result(scores[start : start + count])
            elif error is not None:
                waiter.set_exception(error)
            else:
                waiter.cancel()


def _score(result: reward_pb2.ScoreResult | None) -> Score:
    if result is None:
        return Score(
            reward=0.0, status=RewardStatus.FAILED, reason="no result from the reward service"
        )
    status = status_from_proto(result.status)
    if status is RewardStatus.OK:
        return Score(reward=result.reward)
    return Score(
        reward=0.0, status=status, reason=result.reason or "reward failed without a reason"
    )
