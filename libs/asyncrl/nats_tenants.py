"""Tenants on the NATS side: each tenant's NATS user reads only its own experiments'
trajectories and ledger.

A tenant's experiment ids are `<tenant>.<slug>-<hex>` (services/scheduler/core.py), so every
subject of one carries the tenant as a token of its own: `asyncrl.traj.<tenant>.<id>.train`,
`.eval`, `asyncrl.ledger.<tenant>.<id>`, `asyncrl.dead.<tenant>.<id>`. Nothing else needs to
know the tenant: rollouts, trainer and scheduler make these subjects from the id as before.

The operator's readers (users `admin`, `viewer`) read a stream message by message
(STREAM.MSG.GET), whose request names the subject in its body, out of reach of subject
permissions. A tenant's user (`tenant-<tenant>`) may not: it reads through one consumer of its
own, `read-<tenant>`, created with the filter subject in the API subject
(`$JS.API.CONSUMER.CREATE.<stream>.read-<tenant>.<filter>`; nats-server refuses a body whose
filter differs). Its permissions allow that create only under its own prefix, and pulling from
and deleting only that consumer: no stream info (it lists subjects, hence other tenants'
experiment ids), no KV, no weights, no other consumer, and its own inboxes only.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator

import nats
import nats.errors
from nats.aio.msg import Msg

from asyncrl.security import TENANT_NATS_PREFIX, tenant_nats_user

READ_BATCH = 256
"""Messages asked for per pull."""
BUSY_RETRY_S = 0.2
"""How often a read tries again while another read of the same tenant holds the consumer."""
READER_IDLE_S = 30.0
"""A reader's consumer is removed by nats-server this long after its last pull (a reader that
died before deleting it)."""


def reader_name(tenant: str) -> str:
    """The one consumer (per stream) tenant `tenant` may create, pull from and delete."""
    return f"read-{tenant}"


def _streams() -> dict[str, str]:
    """The streams a tenant reads: name -> the subject root its experiments' ids follow."""
    from asyncrl.ledger import LEDGER_ROOT
    from asyncrl.natsutil import LEDGER_STREAM, STREAM, SUBJECT_ROOT

    return {STREAM: SUBJECT_ROOT, LEDGER_STREAM: LEDGER_ROOT}


def tenant_permissions(tenant: str) -> dict[str, list[str]]:
    """nats-server permissions of tenant `tenant`'s user (see the module's doc)."""
    from asyncrl.natsutil import inbox_prefix

    reader = reader_name(tenant)
    publish = []
    for stream, root in _streams().items():
        publish += [
            f"$JS.API.CONSUMER.CREATE.{stream}.{reader}.{root}.{tenant}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{reader}",
            f"$JS.API.CONSUMER.DELETE.{stream}.{reader}",
        ]
    return {"publish": publish, "subscribe": [f"{inbox_prefix(tenant_nats_user(tenant))}.>"]}


def tenant_of(nc: nats.NATS) -> str:
    """The tenant whose NATS user `nc` is connected as ("": not a tenant's)."""
    user = nc.options.get("user")
    if isinstance(user, str) and user.startswith(TENANT_NATS_PREFIX):
        return user.removeprefix(TENANT_NATS_PREFIX)
    return ""


class ReaderBusy(RuntimeError):
    """Another read of the same tenant holds its consumer: retry once it is done."""


async def _create_reader(
    nc: nats.NATS, stream: str, subject: str, reader: str, start_seq: int, timeout: float
) -> int:
    """Create the reader consumer over `subject` from `start_seq`; returns its pending count."""
    config = {
        "name": reader,
        "description": secrets.token_hex(8),  # two reads never share one consumer
        "filter_subject": subject,
        "ack_policy": "none",
        "deliver_policy": "by_start_sequence" if start_seq > 1 else "all",
        "inactive_threshold": int(READER_IDLE_S * 1e9),
        "mem_storage": True,
        "num_replicas": 1,
    }
    if start_seq > 1:
        config["opt_start_seq"] = start_seq
    request = {"stream_name": stream, "config": config, "action": "create"}
    api = f"$JS.API.CONSUMER.CREATE.{stream}.{reader}.{subject}"
    reply = json.loads((await nc.request(api, json.dumps(request).encode(), timeout)).data)
    error = reply.get("error")
    if error is None:
        return int(reply["num_pending"])
    if error.get("err_code") == 10059:  # stream not found: nothing stored yet
        return 0
    if error.get("err_code") == 10148:  # consumer already exists
        raise ReaderBusy(f"another read of tenant {reader!r} is running on {stream}: retry")
    raise RuntimeError(f"creating reader {reader} on {stream}: {error.get('description')}")


async def _wait_create_reader(
    nc: nats.NATS, stream: str, subject: str, reader: str, start_seq: int, timeout: float
) -> int:
    """`_create_reader`, waiting up to `timeout` for another read of the tenant to finish."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await _create_reader(nc, stream, subject, reader, start_seq, timeout)
        except ReaderBusy:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(BUSY_RETRY_S)


def _status(msg: Msg) -> str:
    return (msg.headers or {}).get("Status", "")


def _check_status(msg: Msg, got: int, what: str) -> None:
    """A pull that ended with nothing read, or with anything but 408 (request expired, e.g. a
    409 when the consumer went away): raise, rather than pull again forever."""
    status = _status(msg)
    if status == "408" and got:
        return
    reason = (msg.headers or {}).get("Description", "")
    raise RuntimeError(f"reading with {what}: status {status} {reason}".strip())


async def iter_tenant_stored(
    nc: nats.NATS,
    stream: str,
    subject: str,
    tenant: str,
    start_seq: int = 1,
    timeout: float = 10.0,
) -> AsyncIterator[Msg]:
    """The messages stored on `subject` from `start_seq`, oldest first, as tenant `tenant`
    reads them (its consumer; see the module's doc). A subject outside the tenant's prefix
    yields nothing, as an experiment that does not exist does (nats-server would refuse it)."""
    root = _streams().get(stream)
    if root is None or not subject.startswith(f"{root}.{tenant}."):
        return
    reader = reader_name(tenant)
    pending = await _wait_create_reader(nc, stream, subject, reader, start_seq, timeout)
    if not pending:
        await _delete_reader(nc, stream, reader, timeout)
        return
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        while pending:
            ask = {"batch": min(READ_BATCH, pending), "expires": int(timeout * 1e9)}
            await nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{reader}",
                json.dumps(ask).encode(),
                reply=inbox,
            )
            for got in range(ask["batch"]):
                msg = await sub.next_msg(timeout + 1)
                if _status(msg):  # the pull ended early: a 408 when it expired
                    _check_status(msg, got, f"{reader} on {stream}")
                    break
                pending = msg.metadata.num_pending
                yield msg
                if not pending:
                    break
    finally:
        await sub.unsubscribe()
        await _delete_reader(nc, stream, reader, timeout)


async def _delete_reader(nc: nats.NATS, stream: str, reader: str, timeout: float) -> None:
    try:
        await nc.request(f"$JS.API.CONSUMER.DELETE.{stream}.{reader}", b"", timeout)
    except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError):
        pass  # it goes by itself after READER_IDLE_S
