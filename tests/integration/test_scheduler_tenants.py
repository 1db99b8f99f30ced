"""Tenant isolation on every experiment RPC of a real scheduler (gRPC on port 0, a real
nats-server, fake workers of tests/fakes/scheduler_env.py): the own tenant's tokens see and
act, another tenant's get NOT_FOUND exactly as for an id that does not exist (never
PERMISSION_DENIED), the operator (a token without a tenant) sees every experiment; and the
ledger the scheduler writes for a tenant's experiment is readable by that tenant's NATS user
only (asyncrl.nats_tenants)."""

from __future__ import annotations

import grpc
import nats
import pytest

from asyncrl.ledger import fetch_report
from asyncrl.natsutil import LocalNatsServer, wait_until
from asyncrl.security import ensure_tenant, mint_token, secrets_dir
from asyncrl.v1 import (
    common_pb2,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    scheduler_pb2_grpc,
)
from asyncrl.v1 import scheduler_pb2 as pb
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import REWARD, ROLLOUT, TRAINER, FakeRollout, FakeTrainer, spec

cluster = scheduler_env.cluster
files = scheduler_env.files
NOT_FOUND = grpc.StatusCode.NOT_FOUND


@pytest.fixture
def nats_server(tmp_path):
    """The server, configured after both tenants' NATS users exist."""
    for tenant in ("acme", "bcorp"):
        ensure_tenant(secrets_dir(), tenant)
    with LocalNatsServer(tmp_path / "jetstream") as srv:
        yield srv


@pytest.fixture
async def as_token():
    """Factory: a stub of `service` at `address` calling with a freshly minted token."""
    channels: list[grpc.aio.Channel] = []

    def make(address: str, subject: str, role: str, tenant: str = "", stub=None):
        token = mint_token(secrets_dir(), subject, role, tenant=tenant)
        creds = grpc.composite_channel_credentials(
            grpc.ssl_channel_credentials((secrets_dir() / "ca.pem").read_bytes()),
            grpc.access_token_call_credentials(token),
        )
        ch = grpc.aio.secure_channel(address, creds)
        channels.append(ch)
        return (stub or scheduler_pb2_grpc.SchedulerStub)(ch)

    yield make
    for ch in channels:
        await ch.close()


@pytest.fixture
async def fleet(cluster, files, as_token):
    """A scheduler with a rollout, trainer and reward worker; tokens: acme's admin and viewer,
    bcorp's admin and viewer, the operator's admin and viewer. `submit(stub)` submits the
    test spec with that stub's token."""
    await cluster.start_scheduler()
    await cluster.worker(REWARD)
    await cluster.worker(TRAINER, FakeTrainer())
    await cluster.worker(ROLLOUT, FakeRollout())
    addr = cluster.address
    f = type("Fleet", (), {})()
    f.cluster = cluster
    f.acme, f.acme_viewer = (
        as_token(addr, "a1", "admin", "acme"),
        as_token(addr, "a2", "viewer", "acme"),
    )
    f.bcorp, f.bcorp_viewer = (
        as_token(addr, "b1", "admin", "bcorp"),
        as_token(addr, "b2", "viewer", "bcorp"),
    )
    f.operator, f.op_viewer = as_token(addr, "op", "admin"), as_token(addr, "opv", "viewer")

    async def submit(stub, total_steps: int = 3) -> pb.Experiment:
        request = pb.SubmitExperimentRequest(
            spec_json=spec(files, trainer={"total_steps": total_steps})
        )
        return await stub.SubmitExperiment(request, timeout=10)

    f.submit = submit
    return f


async def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value.code(), e.value.details()


async def _missing_like(call_for, experiment_id: str) -> None:
    """`call_for(id)` fails NOT_FOUND for `experiment_id` with the very answer it gives for an
    id that does not exist (the id itself aside)."""
    code, details = await _code(call_for(experiment_id))
    ghost = "acme.ghost-000000"
    ghost_code, ghost_details = await _code(call_for(ghost))
    assert (code, ghost_code) == (NOT_FOUND, NOT_FOUND), details
    assert details.replace(experiment_id, "ID") == ghost_details.replace(ghost, "ID")


def _get(stub, with_history: bool = False):
    return lambda i: stub.GetExperiment(
        pb.GetExperimentRequest(experiment_id=i, with_history=with_history), timeout=5
    )


def _cancel(stub):
    return lambda i: stub.CancelExperiment(pb.CancelExperimentRequest(experiment_id=i), timeout=5)


async def _first_event(stub, experiment_id: str) -> pb.ProgressEvent:
    stream = stub.WatchExperiment(pb.WatchExperimentRequest(experiment_id=experiment_id))
    try:
        return await stream.read()
    finally:
        stream.cancel()


async def _listed(stub) -> list[str]:
    return [
        e.id
        for e in (await stub.ListExperiments(pb.ListExperimentsRequest(), timeout=5)).experiments
    ]


async def test_submit_records_the_tenant_and_the_id_carries_it(fleet):
    mine = await fleet.submit(fleet.acme)
    assert (mine.tenant, mine.id.split(".")[0]) == ("acme", "acme")
    assert fleet.cluster.scheduler.get(mine.id).record.tenant == "acme"
    ops = await fleet.submit(fleet.operator)
    assert ops.tenant == "" and "." not in ops.id
    # a tenant's viewer may not submit: its role, not its tenant, says so
    code, details = await _code(fleet.submit(fleet.acme_viewer))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "role viewer" in details


async def test_get_own_ok_other_tenant_not_found_operator_ok(fleet):
    a, b = await fleet.submit(fleet.acme), await fleet.submit(fleet.bcorp)
    for stub in (fleet.acme, fleet.acme_viewer, fleet.operator, fleet.op_viewer):
        assert (await _get(stub, True)(a.id)).tenant == "acme"
    assert (await _get(fleet.bcorp_viewer)(b.id)).id == b.id
    for stub in (fleet.bcorp, fleet.bcorp_viewer):
        await _missing_like(_get(stub), a.id)
        await _missing_like(_get(stub, True), a.id)
    await _missing_like(_get(fleet.acme_viewer), b.id)


async def test_list_returns_only_the_callers_tenant_operator_all(fleet):
    a1, a2 = await fleet.submit(fleet.acme), await fleet.submit(fleet.acme)
    b, op = await fleet.submit(fleet.bcorp), await fleet.submit(fleet.operator)
    assert await _listed(fleet.acme_viewer) == [a1.id, a2.id]
    assert await _listed(fleet.acme) == [a1.id, a2.id]
    assert await _listed(fleet.bcorp_viewer) == [b.id]
    assert await _listed(fleet.op_viewer) == [a1.id, a2.id, b.id, op.id]
    assert await _listed(fleet.operator) == [a1.id, a2.id, b.id, op.id]


async def test_watch_own_ok_other_tenant_not_found_operator_ok(fleet):
    a = await fleet.submit(fleet.acme)
    for stub in (fleet.acme_viewer, fleet.acme, fleet.op_viewer):
        event = await _first_event(stub, a.id)
        assert (event.kind, event.experiment.id, event.experiment.tenant) == (
            "snapshot",
            a.id,
            "acme",
        )

    def watch(i):
        return _first_event(fleet.bcorp_viewer, i)

    await _missing_like(watch, a.id)


async def test_cancel_other_tenant_not_found_and_unchanged_own_and_operator_cancel(fleet):
    a1, a2 = await fleet.submit(fleet.acme, 1000), await fleet.submit(fleet.acme, 1000)
    scheduler = fleet.cluster.scheduler
    await _missing_like(_cancel(fleet.bcorp), a1.id)
    assert not scheduler.get(a1.id).terminal  # nothing happened to it
    done = await _cancel(fleet.acme)(a1.id)
    assert done.state == pb.EXPERIMENT_STATE_CANCELLED
    done = await _cancel(fleet.operator)(a2.id)
    assert done.state == pb.EXPERIMENT_STATE_CANCELLED
    b = await fleet.submit(fleet.bcorp, 1000)
    await _missing_like(_cancel(fleet.acme), b.id)
    assert not scheduler.get(b.id).terminal


async def test_list_workers_hides_which_experiment_another_tenant_is_served(fleet):
    a = await fleet.submit(fleet.acme, 1000)
    scheduler = fleet.cluster.scheduler
    await wait_until(lambda: scheduler.get(a.id).state.value == "RUNNING", 10)

    async def bound(stub) -> set[str]:
        got = await stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
        assert len(got.workers) == 3  # the fleet is shared: every worker is listed
        return {
            (w.experiment_id, w.version)
            for w in got.workers
            if w.kind == common_pb2.WORKER_KIND_ROLLOUT
        }

    assert await bound(fleet.acme_viewer) == {(a.id, 0)}
    assert await bound(fleet.op_viewer) == {(a.id, 0)}
    assert await bound(fleet.bcorp_viewer) == {("", -1)}


async def test_tenant_token_may_not_call_workers_own_methods(fleet, as_token, reward_address):
    """A rollout's GetStatus names the experiment it serves: PERMISSION_DENIED to a tenant
    (whatever the experiment), let through to the operator's viewer; reward functions' names
    are for everyone."""
    [rollout] = [w for w in fleet.cluster.scheduler.workers() if w.kind.value == "rollout"]
    request = rollout_pb2.GetRolloutStatusRequest()
    for tenant in ("acme", "bcorp"):
        stub = as_token(rollout.address, "t", "viewer", tenant, rollout_pb2_grpc.RolloutStub)
        code, details = await _code(stub.GetStatus(request, timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED and f"tenant {tenant}" in details
    operator = as_token(rollout.address, "v", "viewer", "", rollout_pb2_grpc.RolloutStub)
    code, details = await _code(operator.GetStatus(request, timeout=5))
    # past the interceptor: the fake rollout has no GetStatus of its own
    assert code == grpc.StatusCode.INTERNAL and "NotImplementedError" in details, details
    reward = as_token(reward_address, "t", "viewer", "acme", reward_pb2_grpc.RewardStub)
    names = await reward.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest(), timeout=5)
    assert "exact_match" in names.names


async def test_ledger_of_a_tenants_experiment_read_by_that_tenant_only(
    fleet, nats_server, tmp_path, monkeypatch
):
    """The ledger the real scheduler writes for acme's experiment (`started`: its dataset):
    acme's NATS user reads it, bcorp's reads nothing, as for an experiment that does not
    exist; the operator's viewer reads it."""
    a = await fleet.submit(fleet.acme)
    operator = await fetch_report(a.id, nats_server.url)
    assert operator.dataset["prompts"] == 20
    for tenant, prompts in (("acme", 20), ("bcorp", None)):
        token = tmp_path / f"{tenant}.jwt"
        token.write_text(mint_token(secrets_dir(), "t", "viewer", tenant=tenant))
        password = (secrets_dir() / "nats" / f"tenant-{tenant}.password").read_text().strip()
        monkeypatch.setenv("ASYNCRL_TOKEN_FILE", str(token))
        monkeypatch.setenv("ASYNCRL_NATS_PASSWORD", password)
        got = await fetch_report(a.id, nats_server.url)
        assert got.dataset.get("prompts") == prompts
    # bcorp's user with acme's password: refused at connect
    monkeypatch.setenv(
        "ASYNCRL_NATS_PASSWORD",
        (secrets_dir() / "nats" / "tenant-acme.password").read_text().strip(),
    )
    with pytest.raises(nats.errors.Error):
        await fetch_report(a.id, nats_server.url, timeout_s=2)
