"""Authorisation beyond roles, in the scheduler: a worker's identity is bound to its
registration, only the trainer bound to an experiment may commit or report drops for it, a
drop report names only groups the scheduler dispatched, and no plugin is imported by the
scheduler (the workers that run one refuse it at bind, and the experiment fails with that).

The first part uses the fakes of tests/fakes/scheduler_env.py; the real runs use an
in-process scheduler, reward worker, torch rollout and torch trainer on the tiny model."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from dataclasses import replace

import grpc
import pytest

from asyncrl.natsutil import wait_until
from asyncrl.security import mint_token, secrets_dir
from asyncrl.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.reward.server import create_reward
from services.rollout.server import create_rollout
from services.rollout.torch_engine import TorchEngine
from services.scheduler.registry import WorkerKind
from services.scheduler.server import create_scheduler
from services.trainer.scheduler_calls import SchedulerCalls
from services.trainer.server import create_trainer
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import (
    ROLLOUT,
    TRAINER,
    FakeRollout,
    FakeTrainer,
    attempt,
    running_experiment,
)

cluster = scheduler_env.cluster
files = scheduler_env.files
DENIED = grpc.StatusCode.PERMISSION_DENIED
INVALID = grpc.StatusCode.INVALID_ARGUMENT
MARKER = "tests.fixtures_plugins.marker"


def stub_as(address: str, subject: str, role: str) -> tuple[grpc.aio.Channel, object]:
    """A channel and stub to the scheduler with a freshly minted token for `subject`."""
    token = mint_token(secrets_dir(), subject, role)
    creds = grpc.composite_channel_credentials(
        grpc.ssl_channel_credentials((secrets_dir() / "ca.pem").read_bytes()),
        grpc.access_token_call_credentials(token),
    )
    ch = grpc.aio.secure_channel(address, creds)
    return ch, scheduler_pb2_grpc.SchedulerStub(ch)


@pytest.fixture
async def as_identity(cluster):
    """Factory: a scheduler stub of the cluster with a minted identity (closed at the end)."""
    channels = []

    def make(subject: str, role: str):
        ch, stub = stub_as(cluster.address, subject, role)
        channels.append(ch)
        return stub

    yield make
    for ch in channels:
        await ch.close()


def register(kind, address: str, name: str = ""):
    return scheduler_pb2.RegisterWorkerRequest(kind=kind, address=address, name=name, capacity=1)


def commit_request(exp_id: str, version: int, trainer_id: str = ""):
    return scheduler_pb2.CommitWeightsRequest(
        experiment_id=exp_id,
        version=version,
        uri=f"file:///forged/v{version}",
        metrics=common_pb2.StepMetrics(step=version, version=version, groups=2),
        trainer_id=trainer_id,
    )


def dropped(exp_id: str, *group_ids: str):
    return scheduler_pb2.ReportDroppedRequest(
        experiment_id=exp_id, groups=[scheduler_pb2.DroppedGroup(group_id=g) for g in group_ids]
    )


async def expect(code: grpc.StatusCode, call) -> str:
    """Await `call`, which must fail with `code`; returns the details."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == code, e.value.details()
    return e.value.details()


# ---- registration and heartbeats -------------------------------------------------------------


async def test_register_other_kind_than_role_permission_denied(cluster, as_identity):
    await cluster.start_scheduler()
    rollout = as_identity("rollout-1", "rollout")
    details = await expect(
        DENIED, rollout.RegisterWorker(register(TRAINER, "127.0.0.1:9"), timeout=5)
    )
    assert details.startswith("kind:") and "rollout-1" in details
    assert not cluster.scheduler.workers()
    resp = await rollout.RegisterWorker(register(ROLLOUT, "127.0.0.1:9"), timeout=5)
    [worker] = cluster.scheduler.workers()
    assert (worker.worker_id, worker.principal) == (resp.worker_id, "rollout-1")


async def test_heartbeat_for_worker_of_another_identity_permission_denied(cluster, as_identity):
    await cluster.start_scheduler()
    owner, other = as_identity("rollout-1", "rollout"), as_identity("rollout-2", "rollout")
    resp = await owner.RegisterWorker(register(ROLLOUT, "127.0.0.1:9"), timeout=5)
    beat = scheduler_pb2.HeartbeatRequest(worker_id=resp.worker_id)
    details = await expect(DENIED, other.Heartbeat(beat, timeout=5))
    assert details.startswith("worker_id:") and "rollout-1" in details
    assert (await owner.Heartbeat(beat, timeout=5)).known
    unknown = scheduler_pb2.HeartbeatRequest(worker_id="rollout-00000000")
    assert (await other.Heartbeat(unknown, timeout=5)).known is False  # register again


async def test_register_address_of_another_identity_permission_denied(cluster, as_identity):
    await cluster.start_scheduler()
    owner, other = as_identity("rollout-1", "rollout"), as_identity("rollout-2", "rollout")
    first = await owner.RegisterWorker(register(ROLLOUT, "127.0.0.1:9", "mine"), timeout=5)
    details = await expect(
        DENIED, other.RegisterWorker(register(ROLLOUT, "127.0.0.1:9", "theirs"), timeout=5)
    )
    assert details.startswith("address:")
    [worker] = cluster.scheduler.workers()
    assert (worker.name, worker.principal) == ("mine", "rollout-1")
    again = await owner.RegisterWorker(register(ROLLOUT, "127.0.0.1:9"), timeout=5)
    assert again.worker_id == first.worker_id  # its own re-registration keeps the id


# ---- commits and drop reports from the bound trainer only -------------------------------------


async def test_commit_from_other_identity_or_trainer_id_denied_run_continues(
    cluster, files, as_identity
):
    await cluster.start_scheduler()
    rollout = FakeRollout()
    exp_id = await running_experiment(cluster, files, rollout, trainer={"total_steps": 10})
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: rollout.group_ids())
    imposter = as_identity("trainer-imposter", "trainer")
    details = await expect(DENIED, imposter.CommitWeights(commit_request(exp_id, 1), timeout=5))
    assert details.startswith("experiment_id:") and "trainer-imposter" in details
    # the right identity (the in-process trainers share one) with another trainer's id
    other, _ = await cluster.worker(TRAINER, FakeTrainer())
    forged_id = commit_request(exp_id, 1, trainer_id=other.worker_id)
    details = await expect(DENIED, cluster.trainer_stub.CommitWeights(forged_id, timeout=5))
    assert details.startswith("trainer_id:") and other.worker_id in details
    # an id registered nowhere (a registration older than a scheduler restart): retry later
    stale_id = commit_request(exp_id, 1, trainer_id="trainer-0badf00d")
    details = await expect(
        grpc.StatusCode.UNAVAILABLE, cluster.trainer_stub.CommitWeights(stale_id, timeout=5)
    )
    assert details.startswith("trainer_id:") and "register again" in details
    report = dropped(exp_id, rollout.group_ids()[0])
    await expect(DENIED, imposter.ReportDropped(report, timeout=5))
    assert runner.version == 0 and runner.record.fleet_uri == files["model"]
    assert [v for v, _ in rollout.updates] == [0]  # no forged weights reached the rollout
    assert runner.staleness.counts.stale_dropped == 0
    bound = commit_request(exp_id, 1, trainer_id=runner.trainer().worker_id)
    assert (await cluster.trainer_stub.CommitWeights(bound, timeout=5)).stop is False
    assert runner.committed_version == 1
    assert runner.state.value == "RUNNING"


async def test_report_dropped_unknown_group_invalid_argument_nothing_changed(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout()
    exp_id = await running_experiment(cluster, files, rollout, trainer={"total_steps": 10})
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted == 2)
    await asyncio.wait_for(runner.settled(), 5)
    accepted = rollout.group_ids()[0]

    def state():
        d = runner.dispatcher
        return (
            replace(d.staleness.counts),
            d.cursor.state(),
            dict(d.awaiting),
            len(rollout.requests),
        )

    before = state()
    for forged in (
        f"{exp_id}-e0-p999999-a0",  # an index past the dataset: it used to crash the run
        f"{exp_id}-e0-p5-a0",  # a real prompt never dispatched
        "other-000000-e0-p0-a0",
        f"{exp_id}-eval-v0-p0-a0",
        "garbage",
    ):
        details = await expect(
            INVALID,
            cluster.trainer_stub.ReportDropped(dropped(exp_id, accepted, forged), timeout=5),
        )
        assert details.startswith("groups:") and repr(forged) in details
    await asyncio.wait_for(runner.settled(), 5)  # every event so far handled
    assert state() == before
    assert runner.state.value == "RUNNING"
    await cluster.trainer_stub.ReportDropped(dropped(exp_id, accepted), timeout=5)
    await wait_until(lambda: attempt(accepted, 1) in rollout.group_ids())
    assert (await cluster.commit(exp_id, 1)).stop is False
    assert runner.committed_version == 1


async def test_report_dropped_after_scheduler_restart_knows_accepted_groups(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout()
    exp_id = await running_experiment(cluster, files, rollout, trainer={"total_steps": 10})
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted == 2)
    accepted = rollout.group_ids()[0]
    await cluster.scheduler.store.flush()
    await cluster.stop_scheduler()
    await cluster.start_scheduler(port=cluster.port)
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.state.value == "RUNNING", timeout=10)
    await cluster.trainer_stub.ReportDropped(
        dropped(exp_id, accepted), timeout=5, wait_for_ready=True
    )
    assert runner.staleness.counts.stale_dropped == 1


# ---- real runs: the scheduler, a reward worker, a torch rollout and a torch trainer -----------


class Stack:
    def __init__(self, nats_url: str, model: str, tmp_path):
        self.nats_url, self.model, self.tmp_path = nats_url, model, tmp_path
        self._closers = []

    async def start_scheduler(self, port: int = 0) -> None:
        self.runtime, self.scheduler = await create_scheduler(
            self.nats_url, port=port, grace_s=0, lease_ttl_s=5.0, heartbeat_interval_s=0.2
        )
        self.address = f"127.0.0.1:{self.runtime.port}"

    async def start(self, workers: bool = True) -> None:
        await self.start_scheduler()
        self._closers.append(lambda: self.runtime.close())
        ch, self.admin = stub_as(self.address, "admin", "admin")
        self._closers.append(ch.close)
        if not workers:
            return
        reward, _ = await create_reward(workers=1, scheduler=self.address, nats_url=self.nats_url)
        self._closers.append(reward.close)
        rollout, _ = await create_rollout(
            self.nats_url, TorchEngine(seed=0), scheduler=self.address, capacity=8
        )
        self._closers.append(rollout.close)
        trainer, self.trainer = await create_trainer(
            self.nats_url,
            scheduler=self.address,
            var_dir=self.tmp_path / "var",
            weights_dir=self.tmp_path / "weights",
        )
        self._closers.append(trainer.close)

    async def close(self) -> None:
        for close in reversed(self._closers):
            await close()

    def spec(self, **sections) -> str:
        data = self.tmp_path / "train.jsonl"
        data.write_text(
            "".join(
                json.dumps({"prompt": f"{i % 10}+1=", "answer": str(i % 10 + 1)}) + "\n"
                for i in range(16)
            )
        )
        spec = {
            "name": "authz",
            "model": {"path": self.model},
            "dataset": {"path": str(data), "epochs": 20},
            "rollout": {
                "engine": "torch",
                "n_samples": 2,
                "max_head_offpolicyness": 1,
                "max_concurrent_rollouts": 4,
                "filter": "none",
                "gconfig": {"temperature": 1.0, "max_new_tokens": 3},
            },
            "reward": {"function": "exact_match"},
            "trainer": {"backend": "torch", "batch_size": 2, "total_steps": 4, "lr": 1e-3},
        }
        for key, value in sections.items():
            spec[key] = {**spec.get(key, {}), **value}
        return json.dumps(spec)

    async def submit(self, spec_json: str) -> str:
        req = scheduler_pb2.SubmitExperimentRequest(spec_json=spec_json)
        return (await self.admin.SubmitExperiment(req, timeout=10)).id

    async def finished(self, exp_id: str, timeout: float = 120.0):
        runner = self.scheduler.get(exp_id)
        await wait_until(lambda: runner.terminal, timeout=timeout)
        req = scheduler_pb2.GetExperimentRequest(experiment_id=exp_id, with_history=True)
        return await self.admin.GetExperiment(req, timeout=5)


@pytest.fixture
async def stack(nats_server, tiny, tmp_path):
    s = Stack(nats_server.url, str(tiny[0]), tmp_path)
    yield s
    await s.close()


def hold_commits_from(monkeypatch, version: int) -> asyncio.Event:
    """The trainer's commits (`SchedulerCalls.commit`, made per experiment) of `version` and
    later wait until the returned Event is set: the run stays at version - 1, RUNNING, for as
    long as the test acts on it. (A real step of the tiny model takes ~30 ms: six steps were
    over in 0.25 s, before or during what a test did "mid-run".)"""
    commit = SchedulerCalls.commit
    release = asyncio.Event()

    async def gated(self, uri, metrics, *args, **kwargs):
        if metrics.version >= version:
            await release.wait()
        return await commit(self, uri, metrics, *args, **kwargs)

    monkeypatch.setattr(SchedulerCalls, "commit", gated)
    return release


@pytest.mark.slow  # a real run on the tiny model: left out of make test-fast
async def test_real_run_imposter_commit_and_forged_drop_refused_run_completes(stack, monkeypatch):
    await stack.start()
    release = hold_commits_from(monkeypatch, 2)
    exp_id = await stack.submit(stack.spec(trainer={"total_steps": 6}))
    runner = stack.scheduler.get(exp_id)
    await wait_until(lambda: runner.version >= 1, timeout=120)
    version = runner.version
    ch, imposter = stub_as(stack.address, "trainer-imposter", "trainer")
    async with ch:
        await expect(DENIED, imposter.CommitWeights(commit_request(exp_id, version + 1)))
    ch, trainer = stub_as(stack.address, "trainer", "trainer")  # the real trainer's identity
    async with ch:
        forged = f"{exp_id}-e0-p999999-a0"
        details = await expect(INVALID, trainer.ReportDropped(dropped(exp_id, forged)))
    assert repr(forged) in details
    assert (runner.state.value, runner.version) == ("RUNNING", 1)  # refused mid-run
    release.set()
    exp = await stack.finished(exp_id)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_COMPLETED, exp.message
    assert [h.version for h in exp.history] == [1, 2, 3, 4, 5, 6]
    assert "forged" not in runner.record.fleet_uri
    assert all("forged" not in uri for uri in runner.record.weight_uris.values())


@pytest.mark.slow  # a real run on the tiny model: left out of make test-fast
async def test_real_run_scheduler_restart_trainer_commits_as_its_new_registration(
    stack, monkeypatch
):
    await stack.start()
    release = hold_commits_from(monkeypatch, 2)
    exp_id = await stack.submit(stack.spec(trainer={"total_steps": 6}))
    runner = stack.scheduler.get(exp_id)
    await wait_until(lambda: runner.version >= 1, timeout=120)
    old_trainer = runner.trainer().worker_id
    await stack.runtime.close()
    assert (runner.state.value, runner.version) == ("RUNNING", 1)  # restarted mid-run
    release.set()  # version 2's commit meets the scheduler away, then restarted
    await stack.start_scheduler(port=int(stack.address.rsplit(":", 1)[1]))
    await wait_until(lambda: exp_id in stack.scheduler.runners, timeout=10)
    exp = await stack.finished(exp_id)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_COMPLETED, exp.message
    runner = stack.scheduler.get(exp_id)
    assert runner.version == 6
    trainers = stack.scheduler.registry.workers(WorkerKind.TRAINER)
    assert [t.worker_id for t in trainers] != [old_trainer]  # it registered anew
    # its commits went on under the new registration: it never failed and resumed from a
    # checkpoint (StartExperiment after the restart found it running)
    assert stack.trainer.resumed is False


@pytest.mark.slow  # a real run on the tiny model: left out of make test-fast
async def test_missing_workflow_plugin_fails_experiment_with_rollout_message(stack):
    await stack.start()
    exp_id = await stack.submit(
        stack.spec(rollout={"workflow": {"name": "tests.fixtures_plugins.nope:x"}})
    )
    exp = await stack.finished(exp_id, timeout=60)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_FAILED
    assert exp.message.startswith("rollout ") and "refused the experiment" in exp.message
    assert "rollout.workflow:" in exp.message
    assert "No module named 'tests.fixtures_plugins.nope'" in exp.message
    assert "tests.fixtures_plugins.nope" not in sys.modules


@pytest.mark.slow  # a real run on the tiny model: left out of make test-fast
async def test_missing_reward_plugin_function_fails_experiment_with_worker_message(stack):
    await stack.start()
    # the module exists (a missing one is refused at submit): its function does not
    function = "plugin:tests.fixtures_plugins.rewards:nope"
    exp_id = await stack.submit(stack.spec(reward={"function": function}))
    exp = await stack.finished(exp_id, timeout=60)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_FAILED
    assert exp.message.startswith("reward worker ") and "refused the experiment" in exp.message
    assert "reward.function:" in exp.message and (
        "tests.fixtures_plugins.rewards has no function nope" in exp.message
    )
    assert exp.progress.dispatched == 0  # it failed before the trainer started


@pytest.mark.slow  # a real run on the tiny model: left out of make test-fast
async def test_scheduler_never_imports_a_submitted_plugin(stack):
    assert importlib.util.find_spec(MARKER) is not None  # importable: it is not a missing one
    await stack.start(workers=False)
    spec_json = stack.spec(
        rollout={"workflow": {"name": f"{MARKER}:Marker"}},
        reward={"function": f"plugin:{MARKER}:score"},
    )
    exp_id = await stack.submit(spec_json)
    assert stack.scheduler.get(exp_id).state.value == "PENDING"
    assert MARKER not in sys.modules
