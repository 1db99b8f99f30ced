"""Stand-in workers for `bench.scale`: one process serves many worker identities.

    python -m bench.scale_fleet rollout --count 300 --stats FILE [--group-s 8 --capacity 4]
    python -m bench.scale_fleet reward --count 100 --stats FILE
    python -m bench.scale_fleet trainer --count 10 --stats FILE [--batch 64]

Each identity is a port of its own on 127.0.0.1 (so an address of its own, as the registry
keys workers by address, and inside the TLS certificate), registers with the scheduler
(ASYNCRL_SCHEDULER) and heartbeats at the interval the scheduler answers, as
`asyncrl.worker.WorkerAgent` does: real RPCs over TLS with the role's token. The identities
of a process share one channel to the scheduler (a deployment has one per worker: the
scheduler then holds more connections, the calls are the same). Their work costs nothing:
- a rollout answers each group ACCEPTED after `--group-s` seconds (x0.5-1.5, the engine's
  time, spent asleep) and publishes it first, a sample-less TrajectoryGroup, to the real
  trajectory stream (`publish_group`: JetStream, deduplicated by group id); UpdateWeights and
  BindExperiment are answered at once;
- a reward worker answers BindExperiment (no group calls it: the rollout scores nothing);
- a trainer (a gRPC server each: GetStatus says which experiment it runs) commits version v
  once the experiment's train subject holds B * v groups (JetStream's per-subject count), as
  a trainer whose step costs nothing would.
On SIGTERM each process writes what it saw to `--stats` (heartbeats: wall time sent and
latency; rollouts: each group's wall time of arrival; trainers: commits) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from asyncrl.grpcutil import CHANNEL_OPTIONS, channel
from asyncrl.liveness import UNKNOWN, WEIGHTS_ROOT, Beat, ack_subject
from asyncrl.logging import configure_logging
from asyncrl.natsutil import STREAM, connect, ensure_stream, publish_group, train_subject
from asyncrl.security import credentials, server_interceptors
from asyncrl.types import TrajectoryGroup
from asyncrl.v1 import (
    common_pb2,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.rollout.server import GroupsServicer, answer_groups

KINDS = {
    "rollout": common_pb2.WORKER_KIND_ROLLOUT,
    "reward": common_pb2.WORKER_KIND_REWARD,
    "trainer": common_pb2.WORKER_KIND_TRAINER,
}
RPC_TIMEOUT_S = 10.0


@dataclass
class Stats:
    registering: float = 0.0
    """Wall time the first identity began to register (its server serving)."""
    registered: float = 0.0
    """Wall time the last identity registered (so far)."""
    heartbeats: list[tuple[float, float]] = field(default_factory=list)
    """(wall time sent, seconds to the answer, retries included) of every heartbeat."""
    registrations: list[float] = field(default_factory=list)
    """Wall times of every RegisterWorker answered (the first, and each after a failure)."""
    heartbeat_failures: list[float] = field(default_factory=list)
    """Wall times of the heartbeats that failed (deadline: the interval, as the worker's)."""
    reregistered: list[float] = field(default_factory=list)
    """Wall times a heartbeat was answered `known: false`: the lease of a live worker had
    lapsed (it registers again, under a new id)."""
    arrivals: list[tuple[str, float]] = field(default_factory=list)
    """(group id, wall time its GenerateGroups call arrived) of every group (rollouts)."""
    updates: int = 0
    """UpdateWeights answered (rollouts)."""
    commits: list[tuple[str, int, float]] = field(default_factory=list)
    """(experiment, version, wall time) of every commit (trainers)."""
    commit_failures: int = 0
    register_failures: dict[str, int] = field(default_factory=dict)
    """RegisterWorker calls that failed, by status code (each retried after 0.5 s)."""


class Identity:
    """One worker identity: its registration over the process's channel, its heartbeats on the
    process's NATS connection (as `asyncrl.worker.WorkerAgent`: `asyncrl.liveness`)."""

    def __init__(self, kind: str, address: str, name: str, capacity: int, stub, stats: Stats):
        self.kind, self.address, self.name, self.capacity = kind, address, name, capacity
        self.stub, self.stats = stub, stats
        self.worker_id = ""
        self.interval = 1.0
        self.incarnation = secrets.token_hex(8)
        self.lease_key = self.subject = ""
        self.forgotten = False
        """The scheduler answered a beat `unknown` (its lease lapsed): register again."""

    async def register(self) -> None:
        request = scheduler_pb2.RegisterWorkerRequest(
            kind=KINDS[self.kind], address=self.address, name=self.name,
            capacity=self.capacity, incarnation=self.incarnation,
        )  # fmt: skip
        while True:
            try:
                resp = await self.stub.RegisterWorker(request, timeout=RPC_TIMEOUT_S)
                self.stats.registrations.append(time.time())
                break
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                self.stats.register_failures[code] = self.stats.register_failures.get(code, 0) + 1
                await asyncio.sleep(0.5)
        self.worker_id, self.interval = resp.worker_id, resp.heartbeat_interval_s or 1.0
        self.lease_key, self.subject = resp.lease_key, resp.heartbeat_subject
        self.forgotten = False

    async def beat_forever(self, nc, reply: str, rng: random.Random) -> None:
        """Publish a heartbeat every `interval` (the first after a random part of it more, so
        that the identities of a process do not beat in step), replies to `reply`; register
        again when the scheduler answered that it does not know this worker."""
        await asyncio.sleep(rng.uniform(0, self.interval))
        while True:
            await asyncio.sleep(self.interval)
            wall = time.time()
            if self.forgotten:
                self.stats.reregistered.append(wall)
                await self.register()
            beat = Beat(self.worker_id, self.incarnation, self.lease_key, 0, round(wall, 3))
            try:
                await nc.publish(self.subject, beat.encode(), reply=reply)
                self.stats.heartbeats.append((wall, 0.0))
            except Exception:  # noqa: BLE001 - counted: the scheduler's lease decides
                self.stats.heartbeat_failures.append(wall)


class ZeroRollout(GroupsServicer):
    """Every identity's Rollout service: groups accepted after the engine's time, asleep."""

    def __init__(self, js, stats: Stats, group_s: float, rng: random.Random):
        self.js, self.stats, self.group_s, self.rng = js, stats, group_s, rng
        self.identities: dict[str, Identity] = {}
        """The process's identities by worker id (`announced`)."""

    async def BindExperiment(self, request, context):
        return common_pb2.BindExperimentResponse()

    async def GenerateGroups(self, request, context):
        wall = time.time()
        self.stats.arrivals.extend((g.group_id, wall) for g in request.groups)
        async for summaries in answer_groups(request, self._group):
            yield summaries

    async def _group(self, request: rollout_pb2.GenerateGroupRequest) -> rollout_pb2.GroupSummary:
        await asyncio.sleep(self.group_s * self.rng.uniform(0.5, 1.5))
        group = TrajectoryGroup(
            experiment_id=request.experiment_id,
            group_id=request.group_id,
            prompt_id=request.prompt_id,
            prompt=request.prompt,
            answer=request.answer,
            prompt_ids=[],
            epoch=request.epoch,
        )
        _, duplicate = await publish_group(self.js, group)
        return rollout_pb2.GroupSummary(
            group_id=request.group_id,
            status=rollout_pb2.GROUP_STATUS_ACCEPTED,
            published=True,
            duplicate=duplicate,
        )

    async def AbortGroups(self, request, context):
        return rollout_pb2.AbortGroupsResponse()  # none: each publishes; the trainer may drop

    async def UpdateWeights(self, request, context):
        self.stats.updates += 1
        return rollout_pb2.UpdateWeightsResponse(version=request.version)

    async def announced(self, msg) -> None:
        """A weight announcement: each identity of this process it names answers at once."""
        ann = scheduler_pb2.WeightsAnnouncement.FromString(msg.data)
        subject = ack_subject(ann.experiment_id)
        answer = rollout_pb2.UpdateWeightsResponse(version=ann.version)
        for worker_id in ann.workers:
            ident = self.identities.get(worker_id)
            if ident is not None:
                self.stats.updates += 1
                ack = scheduler_pb2.WeightsAck(
                    worker_id=worker_id, lease_key=ident.lease_key,
                    experiment_id=ann.experiment_id, version=ann.version, answer=answer,
                )  # fmt: skip
                await self.js._nc.publish(subject, ack.SerializeToString())


class ZeroReward(reward_pb2_grpc.RewardServicer):
    async def BindExperiment(self, request, context):
        return common_pb2.BindExperimentResponse()

    async def Score(self, request, context):
        return reward_pb2.ScoreResponse()


class ZeroTrainer(trainer_pb2_grpc.TrainerServicer):
    """One trainer identity: commits version v once its experiment's train subject holds B * v
    groups (polled every `poll_s`)."""

    def __init__(self, identity: Identity, js, stats: Stats, batch: int, poll_s: float = 0.2):
        self.identity, self.js, self.stats, self.batch, self.poll_s = (
            identity, js, stats, batch, poll_s,
        )  # fmt: skip
        self.experiment_id = ""
        self.version = 0
        self.task: asyncio.Task | None = None

    async def GetStatus(self, request, context):
        return trainer_pb2.TrainerStatus(
            worker_id=self.identity.worker_id,
            experiment_id=self.experiment_id,
            version=self.version,
            step=self.version,
            backend="zero",
            state="training" if self.task and not self.task.done() else "idle",
        )

    async def StartExperiment(self, request, context):
        if self.task is not None:
            self.task.cancel()
        self.experiment_id, self.version = request.experiment_id, 0
        self.task = asyncio.create_task(self._commit_forever(request.experiment_id))
        return trainer_pb2.StartExperimentResponse(version=0)

    async def StopExperiment(self, request, context):
        if self.task is not None and request.experiment_id == self.experiment_id:
            self.task.cancel()
        return trainer_pb2.StopExperimentResponse()

    async def _commit_forever(self, experiment_id: str) -> None:
        subject = train_subject(experiment_id)
        while True:
            await asyncio.sleep(self.poll_s)
            info = await self.js.stream_info(STREAM, subjects_filter=subject)
            groups = (info.state.subjects or {}).get(subject, 0)
            try:
                if await self._commit_up_to(experiment_id, groups // self.batch):
                    return
            except grpc.aio.AioRpcError:  # e.g. its lease lapsed: next time, under its new id
                self.stats.commit_failures += 1

    async def _commit_up_to(self, experiment_id: str, version: int) -> bool:
        """Commit every version up to `version`; whether the scheduler said stop."""
        while self.version < version:
            v = self.version + 1
            resp = await self.identity.stub.CommitWeights(
                scheduler_pb2.CommitWeightsRequest(
                    experiment_id=experiment_id,
                    version=v,
                    uri=f"zero://{experiment_id}/v{v}",
                    trainer_id=self.identity.worker_id,
                    metrics=common_pb2.StepMetrics(step=v, version=v, groups=self.batch),
                ),
                timeout=RPC_TIMEOUT_S,
            )
            self.version = v
            self.stats.commits.append((experiment_id, v, time.time()))
            if resp.stop:
                return True
        return False


def _server(identity_kind: str) -> tuple[grpc.aio.Server, grpc.ServerCredentials | None]:
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=server_interceptors())
    creds = credentials(identity_kind)
    return server, creds.server_credentials() if creds is not None else None


def _port(server: grpc.aio.Server, creds) -> str:
    """One more port of `server` on 127.0.0.1: the address of one identity."""
    if creds is None:
        return f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    return f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', creds)}"


def _servers(args, stub, stats: Stats, js, rng) -> tuple[list, list[Identity], list]:
    """The gRPC servers (one, a port per identity; a trainer's own each), the identities and
    the rollout servicer (none for other kinds)."""
    kind, servers, identities = args.kind, [], []
    if kind == "trainer":  # GetStatus names the trainer's experiment: a server each
        for i in range(args.count):
            server, creds = _server(kind)
            ident = Identity(kind, _port(server, creds), f"{args.name}-{i}", 1, stub, stats)
            trainer_pb2_grpc.add_TrainerServicer_to_server(
                ZeroTrainer(ident, js, stats, args.batch), server
            )
            servers.append(server)
            identities.append(ident)
        return servers, identities, []
    server, creds = _server(kind)
    for i in range(args.count):
        address = _port(server, creds)
        identities.append(Identity(kind, address, f"{args.name}-{i}", args.capacity, stub, stats))
    if kind == "rollout":
        rollout = ZeroRollout(js, stats, args.group_s, rng)
        rollout_pb2_grpc.add_RolloutServicer_to_server(rollout, server)
        return [server], identities, [rollout]
    reward_pb2_grpc.add_RewardServicer_to_server(ZeroReward(), server)
    return [server], identities, []


async def _live(ident: Identity, registering: asyncio.Semaphore, nc, rng, stats: Stats) -> None:
    """Register (at most REGISTERING at once in a process), then heartbeat at once, as each
    worker's own WorkerAgent does; `unknown` answers come to the identity's own reply subject."""
    async with registering:
        await ident.register()
    stats.registered = max(stats.registered, time.time())
    await ident.beat_forever(nc, f"{nc._inbox_prefix.decode()}.{ident.incarnation}", rng)


REGISTERING = 50


async def _listen(nc, identities: list[Identity], servers) -> None:
    """The scheduler's `unknown` answers, by incarnation; a rollout process follows every
    experiment's weight announcements for its identities."""
    by_incarnation = {i.incarnation: i for i in identities}

    async def answered(msg) -> None:
        ident = by_incarnation.get(msg.subject.rsplit(".", 1)[-1])
        if ident is not None and msg.data == UNKNOWN:
            ident.forgotten = True

    await nc.subscribe(f"{nc._inbox_prefix.decode()}.*", cb=answered)
    for servicer in servers:
        await nc.subscribe(f"{WEIGHTS_ROOT}.>", cb=servicer.announced)


async def serve(args: argparse.Namespace) -> None:
    stats, rng = Stats(), random.Random(args.seed)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    sched = channel(args.scheduler, identity=args.kind)
    stub = scheduler_pb2_grpc.SchedulerStub(sched)
    nc = await connect(identity=args.kind, pending_size=64 * 2**20)
    js = nc.jetstream()
    if args.kind == "rollout":
        await ensure_stream(js)
    servers, identities, rollouts = _servers(args, stub, stats, js, rng)
    for server in servers:
        await server.start()
    await _listen(nc, identities, rollouts)
    stats.registering = time.time()
    registering = asyncio.Semaphore(REGISTERING)
    tasks = [asyncio.create_task(_live(i, registering, nc, rng, stats)) for i in identities]
    if rollouts:
        tasks.append(asyncio.create_task(_index(identities, rollouts[0])))
    await stop.wait()
    for task in tasks:
        task.cancel()
    args.stats.write_text(json.dumps(asdict(stats)))
    for server in servers:
        await server.stop(0.5)
    await sched.close()
    await nc.close()


async def _index(identities: list[Identity], rollout: ZeroRollout) -> None:
    """Keep the rollout servicer's identities by worker id (ids change on re-registering)."""
    while True:
        rollout.identities = {i.worker_id: i for i in identities if i.worker_id}
        await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.scale_fleet", description=__doc__)
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("--count", type=int, required=True, help="worker identities served")
    p.add_argument("--stats", type=Path, required=True, help="JSON written on SIGTERM")
    p.add_argument("--scheduler", default=None, help="default ASYNCRL_SCHEDULER")
    p.add_argument("--name", default="scale", help="identities are named NAME-<i>")
    p.add_argument("--group-s", type=float, default=8.0, help="a group's engine time (mean)")
    p.add_argument("--capacity", type=int, default=4, help="groups at once per rollout")
    p.add_argument("--batch", type=int, default=64, help="groups per trainer step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.scheduler is None:
        from asyncrl.settings import settings

        args.scheduler = settings().scheduler
    configure_logging(f"scale-{args.kind}", json=False, level="WARNING")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
