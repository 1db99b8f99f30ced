"""Tenants on the NATS side, against a real nats-server with the users `make up` configures:
a tenant's user reads its own experiments' trajectories and ledger and nothing of another
tenant's (asyncrl.nats_tenants); the operator's viewer reads both.

Experiment ids of a tenant are `<tenant>.<slug>-<hex>` (the scheduler makes them), so their
subjects are `asyncrl.traj.<tenant>.<id>.train` and `asyncrl.ledger.<tenant>.<id>`.
"""

from __future__ import annotations

import asyncio
import json

import nats
import nats.errors
import pytest

from asyncrl import client as sdk
from asyncrl.ledger import LEDGER_STREAM, Ledger, ensure_ledger, fetch_report, ledger_subject
from asyncrl.nats_tenants import reader_name
from asyncrl.natsutil import (
    STREAM,
    LocalNatsServer,
    connect,
    connect_options,
    experiment_subjects,
    inbox_prefix,
    iter_stored,
    publish_group,
    read_subject,
    train_subject,
)
from asyncrl.security import ensure_tenant, mint_token, secrets_dir, tenant_nats_user
from asyncrl.types import Sample, TrajectoryGroup

ACME, BCORP = "acme.math-1a2b3c", "bcorp.math-4d5e6f"
OPERATORS = "math-7a8b9c"
DENIED_WAIT_S = 0.5


def _group(experiment_id: str, gid: str, eval_: bool = False) -> TrajectoryGroup:
    return TrajectoryGroup(
        experiment_id=experiment_id,
        group_id=f"{experiment_id}-{gid}",
        prompt_id="p",
        prompt="1+1=",
        answer="2",
        prompt_ids=[1, 2],
        samples=[Sample(output_ids=[3], logprobs=[-0.5], versions=[0])],
        start_version=0,
        eval=eval_,
    )


@pytest.fixture
def nats_server(tmp_path):
    """The server, configured after both tenants' NATS users exist."""
    for tenant in ("acme", "bcorp"):
        ensure_tenant(secrets_dir(), tenant)
    with LocalNatsServer(tmp_path / "jetstream") as srv:
        yield srv


@pytest.fixture
async def stored(js, nc):
    """Two groups and two ledger events per experiment, as rollouts and the scheduler write
    them (the scheduler's connection: it may do anything)."""
    await ensure_ledger(js)
    for exp in (ACME, BCORP, OPERATORS):
        await publish_group(js, _group(exp, "e0-p0-a0"))
        await publish_group(js, _group(exp, "eval-v0-p0-a0", eval_=True))
        ledger = Ledger(js, exp)
        await ledger.record("started", prompts=1, epochs=1)
        group = f"{exp}-e0-p0-a0"
        await ledger.record("dispatched", group=group, prompt="p", epoch=0, index=0)
        await ledger.record("settled", group=group, status="failed", reason=exp)


class Tenant:
    """A connection as tenant `name`'s NATS user, recording what the server refused."""

    def __init__(self, nc: nats.NATS, errors: list[Exception]):
        self.nc, self.errors = nc, errors
        self.js = nc.jetstream(timeout=DENIED_WAIT_S)

    async def refused(self, verb: str, subject: str) -> None:
        want = f'nats: permissions violation for {verb} "{subject.lower()}"'
        for _ in range(50):
            if any(str(e) == want for e in self.errors):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {want!r} among {self.errors}")

    async def request_refused(self, subject: str, body: dict | None = None) -> None:
        with pytest.raises(nats.errors.TimeoutError):
            await self.nc.request(subject, json.dumps(body or {}).encode(), DENIED_WAIT_S)
        await self.refused("publish to", subject)


@pytest.fixture
async def as_tenant(nats_server):
    opened: list[nats.NATS] = []

    async def open_(tenant: str) -> Tenant:
        errors: list[Exception] = []

        async def record(exc: Exception) -> None:
            errors.append(exc)

        user = tenant_nats_user(tenant)
        options = connect_options("viewer") | {
            "user": user,
            "password": (secrets_dir() / "nats" / f"{user}.password").read_text().strip(),
            "inbox_prefix": inbox_prefix(user),
        }
        nc = await nats.connect(nats_server.url, error_cb=record, **options)
        opened.append(nc)
        return Tenant(nc, errors)

    yield open_
    for nc in opened:
        await nc.close()


def _events(messages: list[bytes]) -> list[dict]:
    """The ledger events in stored messages (one event or a batch each: asyncrl.ledger)."""
    out = []
    for data in messages:
        body = json.loads(data)
        out.extend(body if isinstance(body, list) else body.get("events", [body]))
    return out


async def _ids(js, experiment_id: str) -> list[str]:
    subject = experiment_subjects(experiment_id)
    return [msg.headers["Nats-Msg-Id"] async for msg in iter_stored(js, STREAM, subject)]


async def test_tenant_reads_its_own_trajectories_and_ledger(stored, as_tenant):
    acme = await as_tenant("acme")
    assert await _ids(acme.js, ACME) == [f"{ACME}-e0-p0-a0", f"{ACME}-eval-v0-p0-a0"]
    events = await read_subject(acme.js, LEDGER_STREAM, ledger_subject(ACME))
    assert [e["event"] for e in _events(events)] == ["started", "dispatched", "settled"]
    # its reader consumer is gone once read: a second read works the same
    assert len(await _ids(acme.js, ACME)) == 2
    assert not acme.errors


async def test_tenant_reads_nothing_of_another_tenant_or_the_operator(stored, as_tenant):
    acme = await as_tenant("acme")
    for other in (BCORP, OPERATORS):
        assert await _ids(acme.js, other) == []  # as an experiment that does not exist
        assert await read_subject(acme.js, LEDGER_STREAM, ledger_subject(other)) == []
    bcorp = await as_tenant("bcorp")
    assert await _ids(bcorp.js, BCORP) == [f"{BCORP}-e0-p0-a0", f"{BCORP}-eval-v0-p0-a0"]
    assert await _ids(bcorp.js, ACME) == []


async def test_server_refuses_a_tenant_every_other_way_in(stored, as_tenant, js):
    """What the client above does not even try, nats-server refuses."""
    acme = await as_tenant("acme")
    reader = reader_name("acme")
    create = f"$JS.API.CONSUMER.CREATE.{STREAM}.{reader}"
    for subject in (
        f"{create}.{train_subject(BCORP)}",  # another tenant's filter
        f"{create}.asyncrl.traj.>",  # every tenant's
        f"{create}.asyncrl.traj.*.>",
        f"{create}.{train_subject(OPERATORS)}",  # the operator's experiment
        f"$JS.API.CONSUMER.CREATE.{STREAM}.read-bcorp.asyncrl.traj.acme.>",  # bcorp's reader
        f"$JS.API.CONSUMER.CREATE.{STREAM}.trainer-acme_x.asyncrl.traj.acme.>",  # a trainer's
        f"$JS.API.CONSUMER.CREATE.{STREAM}",  # ephemeral, filter in the body
        f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.trainer-bcorp_math-4d5e6f",
        f"$JS.API.STREAM.MSG.GET.{STREAM}",  # message by message, any subject
        f"$JS.API.STREAM.INFO.{STREAM}",  # lists subjects: other tenants' experiment ids
        f"$JS.API.DIRECT.GET.{STREAM}.{train_subject(BCORP)}",
        f"$JS.API.STREAM.MSG.GET.{LEDGER_STREAM}",
        f"$JS.API.CONSUMER.CREATE.{LEDGER_STREAM}.{reader}.{ledger_subject(BCORP)}",
        "$KV.asyncrl_scheduler.experiment.x",
    ):
        await acme.request_refused(subject)
    # live messages: no subscription outside its own inboxes
    for subject in ("asyncrl.traj.bcorp.>", "asyncrl.>", "_INBOX.>", "_INBOX.*"):
        await acme.nc.subscribe(subject)
        await acme.refused("subscription to", subject)


async def test_a_body_filter_other_than_the_subject_is_refused(stored, as_tenant, js):
    """The create subject names the tenant's own prefix but the body asks for another
    tenant's subjects: nats-server answers an error and makes no consumer."""
    acme = await as_tenant("acme")
    reader = reader_name("acme")
    subject = f"$JS.API.CONSUMER.CREATE.{STREAM}.{reader}.asyncrl.traj.acme.>"
    for config in (
        {"name": reader, "filter_subject": train_subject(BCORP), "ack_policy": "none"},
        {"name": reader, "filter_subjects": [train_subject(BCORP)], "ack_policy": "none"},
        {
            "name": reader,
            "filter_subject": "asyncrl.traj.acme.>",
            "filter_subjects": [train_subject(BCORP)],
            "ack_policy": "none",
        },
    ):
        body = {"stream_name": STREAM, "config": config, "action": "create"}
        reply = json.loads((await acme.nc.request(subject, json.dumps(body).encode(), 5)).data)
        assert "error" in reply, reply
    assert [c.name async for c in _consumers(js)] == []


async def _consumers(js):
    for info in await js.consumers_info(STREAM):
        yield info.config


async def test_operator_viewer_reads_every_tenant(stored, nats_server):
    viewer = await connect(nats_server.url, identity="viewer")
    try:
        for exp in (ACME, BCORP, OPERATORS):
            assert len(await _ids(viewer.jetstream(timeout=5), exp)) == 2
    finally:
        await viewer.close()


async def test_cli_readers_as_a_tenant_token(stored, nats_server, tmp_path, monkeypatch):
    """`asyncrl dump` and `asyncrl ledger` with a tenant's token: the NATS user follows the
    token's tenant (ASYNCRL_NATS_PASSWORD from the secrets directory)."""
    token = tmp_path / "alice.jwt"
    token.write_text(mint_token(secrets_dir(), "alice", "viewer", tenant="acme"))
    password = (secrets_dir() / "nats" / "tenant-acme.password").read_text().strip()
    monkeypatch.setenv("ASYNCRL_IDENTITY", "viewer")
    monkeypatch.setenv("ASYNCRL_TOKEN_FILE", str(token))
    monkeypatch.setenv("ASYNCRL_NATS_PASSWORD", password)
    mine = [g.group_id async for g in sdk.read_groups(ACME, nats_server.url, True)]
    assert mine == [f"{ACME}-e0-p0-a0", f"{ACME}-eval-v0-p0-a0"]
    assert [g async for g in sdk.read_groups(BCORP, nats_server.url, True)] == []
    mine = await fetch_report(ACME, nats_server.url)
    assert (mine.totals["failed"], mine.prompts[0].reason) == (1, ACME)
    other = await fetch_report(BCORP, nats_server.url)  # as one that does not exist
    assert other.to_json() == (await fetch_report("acme.none-000000", nats_server.url)).to_json()
    assert other.prompts == [] and sum(other.totals.values()) == 0


async def test_two_reads_of_one_tenant_at_once_each_get_everything(stored, as_tenant):
    """The tenant has one reader consumer per stream: a second read waits for the first
    instead of sharing its consumer (which would split the messages between them)."""
    acme = await as_tenant("acme")
    first, second = await asyncio.gather(_ids(acme.js, ACME), _ids(acme.js, ACME))
    assert first == second == [f"{ACME}-e0-p0-a0", f"{ACME}-eval-v0-p0-a0"]
