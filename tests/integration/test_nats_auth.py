"""NATS under `make up`'s security, against a real nats-server: no anonymous or plain
connections, and each user may do only what NATS_PERMISSIONS grants it.

A denied publish never reaches JetStream: nats-server answers `-ERR 'Permissions Violation'`,
nats-py hands it to the connection's error callback as `nats.errors.Error` and the JetStream
request waiting for an answer raises `nats.errors.TimeoutError`. Each test checks both, and that
the stream or bucket is unchanged, as the scheduler (who may do anything) sees it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket

import nats
import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from asyncrl import natsutil
from asyncrl.natsutil import (
    KV_BUCKET,
    STREAM,
    WEIGHTS_BUCKET,
    connect,
    connect_options,
    iter_stored,
    publish_group,
    train_subject,
)
from asyncrl.types import Sample, TrajectoryGroup
from asyncrl.weights_nats import fetch_version, prune_versions, upload_version, uploaded

DENIED_WAIT_S = 0.5
"""How long a JetStream request waits for the answer a denied publish never gets."""


def _group(gid: str, experiment_id: str = "exp1") -> TrajectoryGroup:
    return TrajectoryGroup(
        experiment_id=experiment_id,
        group_id=gid,
        prompt_id="p",
        prompt="1+1=",
        answer="2",
        prompt_ids=[1, 2],
        samples=[Sample(output_ids=[3], logprobs=[-0.5], versions=[0])],
        start_version=0,
    )


class User:
    """A connection as one identity that records the errors the server reports to it."""

    def __init__(self, nc: nats.NATS, errors: list[Exception]):
        self.nc = nc
        self.js = nc.jetstream(timeout=DENIED_WAIT_S)
        self.errors = errors

    async def violation(self, verb: str, subject: str) -> Exception:
        """The error nats-py reported for the denied `verb` ("publish to", "subscription to")
        on `subject` (nats-py lower-cases the server's message)."""
        want = f'nats: permissions violation for {verb} "{subject.lower()}"'
        for _ in range(50):
            found = [e for e in self.errors if str(e) == want]
            if found:
                assert type(found[0]) is nats.errors.Error
                return found[0]
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {want!r} among {self.errors}")

    async def denied(self, call, subject: str) -> None:
        """`call` (a JetStream request) times out, and the server said why: publishing the
        request to `subject` is not permitted."""
        with pytest.raises(nats.errors.TimeoutError):
            await call
        await self.violation("publish to", subject)


@pytest.fixture
async def as_user(nats_server):
    """Open a `User` connection as an identity (closed after the test)."""
    opened: list[nats.NATS] = []

    async def open_(identity: str) -> User:
        errors: list[Exception] = []

        async def record(exc: Exception) -> None:
            errors.append(exc)

        nc = await connect(nats_server.url, identity=identity, error_cb=record)
        opened.append(nc)
        return User(nc, errors)

    yield open_
    for nc in opened:
        await nc.close()


@pytest.fixture
async def bucket(js):
    """The scheduler's KV bucket with one record in it, as the scheduler writes it."""
    kv = await js.create_key_value(bucket=KV_BUCKET)
    await kv.put("experiment.e1", b'{"state": "RUNNING"}')
    return kv


async def _refused(url: str, **options) -> Exception:
    errors: list[Exception] = []

    async def record(exc: Exception) -> None:
        errors.append(exc)

    with pytest.raises(Exception) as refused:
        await nats.connect(
            url,
            connect_timeout=3,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            error_cb=record,
            **options,
        )
    return refused.value


async def test_connect_without_credentials_refused_authorization_violation(nats_server):
    opts = connect_options("rollout")
    anonymous = await _refused(nats_server.url, tls=opts["tls"])
    assert type(anonymous) is nats.errors.Error
    assert str(anonymous) == "nats: 'Authorization Violation'"
    wrong = await _refused(nats_server.url, **{**opts, "password": "not-the-password"})
    assert type(wrong) is nats.errors.Error
    assert str(wrong) == "nats: 'Authorization Violation'"


async def test_connect_without_trusting_the_ca_refused_certificate_verify_failed(nats_server):
    import ssl

    opts = connect_options("rollout")
    # nats-py upgrades to TLS when the server requires it; the system CAs do not know ours
    untrusted = await _refused(
        nats_server.url,
        user=opts["user"],
        password=opts["password"],
        tls=ssl.create_default_context(),
    )
    assert type(untrusted) is ssl.SSLCertVerificationError


def test_plain_connection_with_valid_credentials_closed_without_pong(nats_server):
    opts = connect_options("scheduler")
    with socket.create_connection(("127.0.0.1", nats_server.port), timeout=5) as sock:
        info = json.loads(sock.recv(65536).decode().removeprefix("INFO ").strip())
        assert info["tls_required"] is True and info["auth_required"] is True
        connect_line = {"user": opts["user"], "pass": opts["password"], "verbose": False}
        sock.sendall(f"CONNECT {json.dumps(connect_line)}\r\nPING\r\n".encode())
        assert sock.recv(65536) == b""  # no PONG: the server hung up on the plain text


async def test_rollout_cannot_delete_or_purge_the_trajectory_stream(js, as_user):
    await publish_group(js, _group("g1"))
    rollout = await as_user("rollout")
    await rollout.denied(rollout.js.delete_stream(STREAM), f"$JS.API.STREAM.DELETE.{STREAM}")
    await rollout.denied(rollout.js.purge_stream(STREAM), f"$JS.API.STREAM.PURGE.{STREAM}")
    await rollout.denied(rollout.js.delete_msg(STREAM, 1), f"$JS.API.STREAM.MSG.DELETE.{STREAM}")
    assert (await js.stream_info(STREAM)).state.messages == 1
    # what it is there for still works on the same connection
    assert await publish_group(rollout.js, _group("g2")) == (2, False)


async def test_rollout_cannot_read_or_write_the_scheduler_kv_bucket(js, bucket, as_user):
    rollout = await as_user("rollout")
    kv_stream = f"KV_{KV_BUCKET}"
    await rollout.denied(rollout.js.key_value(KV_BUCKET), f"$JS.API.STREAM.INFO.{kv_stream}")
    await rollout.denied(
        rollout.js.get_msg(kv_stream, subject=f"$KV.{KV_BUCKET}.experiment.e1", direct=True),
        f"$JS.API.DIRECT.GET.{kv_stream}.$KV.{KV_BUCKET}.experiment.e1",
    )
    await rollout.nc.publish(f"$KV.{KV_BUCKET}.experiment.e1", b'{"state": "FAILED"}')
    await rollout.violation("publish to", f"$KV.{KV_BUCKET}.experiment.e1")
    # nor listen in: to the bucket's subjects, or to the scheduler's replies (its KV reads)
    for subject in (f"$KV.{KV_BUCKET}.>", "_INBOX.>", "_INBOX.scheduler.>"):
        await rollout.nc.subscribe(subject)
        await rollout.violation("subscription to", subject)
    entry = await bucket.get("experiment.e1")
    assert (entry.value, entry.revision) == (b'{"state": "RUNNING"}', 1)


async def test_trainer_cannot_read_the_kv_bucket_or_delete_the_stream(js, bucket, as_user):
    await publish_group(js, _group("g1"))
    trainer = await as_user("trainer")
    await trainer.denied(trainer.js.key_value(KV_BUCKET), f"$JS.API.STREAM.INFO.KV_{KV_BUCKET}")
    await trainer.denied(trainer.js.delete_stream(STREAM), f"$JS.API.STREAM.DELETE.{STREAM}")
    await trainer.denied(
        trainer.js.publish(train_subject("exp1"), b"forged"), train_subject("exp1")
    )
    assert (await js.stream_info(STREAM)).state.messages == 1
    denied = len(trainer.errors)
    # its own work: a durable consumer of the train subject (configured as the trainer's
    # GroupConsumer does it), pulled, acked, deleted
    cfg = ConsumerConfig(
        name="trainer-exp1",
        durable_name="trainer-exp1",
        ack_policy=AckPolicy.EXPLICIT,
        filter_subject=train_subject("exp1"),
    )
    await trainer.js.add_consumer(STREAM, config=cfg)
    sub = await trainer.js.pull_subscribe_bind(durable="trainer-exp1", stream=STREAM)
    (msg,) = await sub.fetch(1, timeout=5)
    await msg.ack_sync()
    assert await trainer.js.delete_consumer(STREAM, "trainer-exp1")
    assert len(trainer.errors) == denied  # nothing more was refused


async def test_viewer_cannot_publish_trajectories_or_touch_consumers_reads_stored(
    js, as_user, monkeypatch
):
    await publish_group(js, _group("g1"))
    # a refused publish times out like a broker away: retried for PUBLISH_RETRY_S, not 30 s
    monkeypatch.setattr(natsutil, "PUBLISH_RETRY_S", 2 * DENIED_WAIT_S)
    trainer_cfg = ConsumerConfig(
        durable_name="trainer-exp1",
        ack_policy=AckPolicy.EXPLICIT,
        filter_subject=train_subject("exp1"),
    )
    await js.add_consumer(STREAM, config=trainer_cfg)
    viewer = await as_user("viewer")
    await viewer.denied(publish_group(viewer.js, _group("forged")), train_subject("exp1"))
    # a consumer create with the trainer's consumer's name would rewrite its filter
    hijack = ConsumerConfig(name="trainer-exp1", filter_subject=train_subject("other"))
    await viewer.denied(
        viewer.js.add_consumer(STREAM, config=hijack),
        f"$JS.API.CONSUMER.CREATE.{STREAM}.trainer-exp1.{train_subject('other')}",
    )
    await viewer.denied(
        viewer.js.delete_consumer(STREAM, "trainer-exp1"),
        f"$JS.API.CONSUMER.DELETE.{STREAM}.trainer-exp1",
    )
    info = await js.consumer_info(STREAM, "trainer-exp1")
    assert info.config.filter_subject == train_subject("exp1")
    assert (await js.stream_info(STREAM)).state.messages == 1
    # reading is what it may do
    stored = [m async for m in iter_stored(viewer.js, STREAM, train_subject("exp1"))]
    assert [m.seq for m in stored] == [1]


async def test_rollout_reads_the_weights_bucket_cannot_put_or_delete(as_user, tmp_path):
    """The trainer creates the bucket and puts and prunes versions in it; a rollout fetches a
    version (an object's info, its chunks through an ordered consumer) and may do nothing
    else: no put, no delete, no purge of the bucket's stream."""
    trainer = await as_user("trainer")
    src = tmp_path / "v1"
    src.mkdir()
    (src / "model.safetensors").write_bytes(bytes(range(256)) * 4096)  # 1 MiB: two chunks
    uri = await upload_version(trainer.js, src, "exp1", 1)
    await upload_version(trainer.js, src, "exp1", 2)
    await prune_versions(trainer.js, "exp1", keep=1)
    assert not await uploaded(trainer.js, "exp1", 1)
    uri = await upload_version(trainer.js, src, "exp1", 1)  # uploaded again: replaced
    assert trainer.errors == []

    rollout = await as_user("rollout")
    got = await fetch_version(rollout.js, uri, tmp_path / "cache")
    assert (got / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    obs = await rollout.js.object_store(WEIGHTS_BUCKET)
    with pytest.raises(nats.errors.TimeoutError):  # its first chunk, on a subject of its own
        await obs.put("exp1/v000009/x", b"forged")
    chunk = f'"$o.{WEIGHTS_BUCKET}.c.'
    assert any(
        str(e).startswith(f"nats: permissions violation for publish to {chunk}")
        for e in rollout.errors
    )
    name = base64.urlsafe_b64encode(b"exp1/v000001/model.safetensors").decode()
    await rollout.denied(
        obs.delete("exp1/v000001/model.safetensors"), f"$O.{WEIGHTS_BUCKET}.M.{name}"
    )
    stream = f"OBJ_{WEIGHTS_BUCKET}"
    await rollout.denied(rollout.js.purge_stream(stream), f"$JS.API.STREAM.PURGE.{stream}")
    await rollout.denied(rollout.js.delete_stream(stream), f"$JS.API.STREAM.DELETE.{stream}")
    assert await uploaded(trainer.js, "exp1", 1) and await uploaded(trainer.js, "exp1", 2)
    assert not await uploaded(trainer.js, "exp1", 9)
