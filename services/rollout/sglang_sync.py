"""The engine's half of the collective weight update into SGLang (`weight_sync: nccl`).

Protocol (SGLang's `update_weights_from_distributed` with `load_format: "flattened_bucket"`),
the trainer being rank 0 and hosting the group's TCPStore at `nccl_master`:
  1. once: the engine POSTs `/init_weights_update_group` (master address/port of the trainer,
     `rank_offset`, `world_size`, `group_name`, backend) at its first collective update, while
     the trainer joins the same group; both block until the rendezvous completes.
  2. per version v: the engine reads the version's bucket plan from the trainer's store
     (`fetch_plan`: key `<group>/v<v>/plan`, an `asyncrl.buckets.Plan` in packed layout: the
     names, dtypes and shapes of every bucket), then POSTs `/update_weights_from_distributed`
     once per bucket with that bucket's names, dtypes and shapes and `load_format:
     "flattened_bucket"`; SGLang allocates one uint8 tensor of the bucket's bytes, receives
     it in ONE broadcast from the trainer and reconstructs the tensors (back to back, each at a
     multiple of its itemsize: the plan is laid out so). From SGLang 0.5.21 the buckets must
     come between `POST /begin_weight_update` and `POST /end_weight_update` (the session; a
     400 otherwise), closed whatever happens.

Nothing on this path reads the version directory: the plan comes from the trainer, which
packs its buckets from its parameters (services/trainer/weight_sync.py). The directory the
trainer writes to the weight store is what a restarted server reloads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta

from asyncrl import buckets
from asyncrl.collective import open_store, plan_key
from asyncrl.logging import get_logger
from services.rollout.sglang_protocol import SGLangError, session_body

log = get_logger(component="sglang_sync")

Request = Callable[[str, str, dict | None], Awaitable[dict]]
"""An HTTP call to the server: (method, path, JSON body) -> the answer; SGLangError on error."""
LOAD_FORMAT = "flattened_bucket"
"""SGLang's load format of one bucket in one broadcast (`FlattenedTensorBucket`)."""


def fetch_plan(master: str, group: str, version: int, timeout_s: float) -> buckets.Plan:
    """Version `version`'s bucket plan from the trainer's store at `master` (host:port),
    waiting up to `timeout_s` for it (blocking: a worker thread)."""
    host, port = master.rsplit(":", 1)
    store = open_store(host, int(port), False, timeout_s)
    key = plan_key(group, version)
    store.wait([key], timedelta(seconds=timeout_s))
    p = buckets.Plan.from_json(store.get(key).decode())
    if not p.packed:
        raise ValueError(f"v{version}: the trainer's plan is not packed for SGLang: {p.to_json()}")
    return p


def bucket_request(
    bucket: list[buckets.Slot], group_name: str, version: int | None, last: bool
) -> dict:
    """The JSON body of one `/update_weights_from_distributed` call: one flattened bucket."""
    body = {
        "names": [s.name for s in bucket],
        "dtypes": [s.dtype for s in bucket],
        "shapes": [list(s.shape) for s in bucket],
        "group_name": group_name,
        "flush_cache": last,
        "load_format": LOAD_FORMAT,
    }
    if last and version is not None:
        body["weight_version"] = str(version)
    return body


async def receive_version(
    request: Request,
    plan: buckets.Plan,
    *,
    group: str,
    weight_version: int | None,
    session: bool,
) -> None:
    """The engine's calls of one collective update of `plan` (the trainer broadcasts
    concurrently): one per bucket, inside a weight-update session when `session`."""
    if not session:
        await _send_buckets(request, plan, group, weight_version)
        return
    await _begin_session(request)
    received = False
    try:
        await _send_buckets(request, plan, group, weight_version)
        received = True
    finally:
        await _end_session(request, raise_errors=received)


async def _send_buckets(
    request: Request, plan: buckets.Plan, group: str, version: int | None
) -> None:
    n = len(plan.sizes)
    for i in range(n):
        body = bucket_request(plan.bucket(i), group, version, last=i == n - 1)
        await request("POST", "/update_weights_from_distributed", body)


async def _begin_session(request: Request) -> None:
    """`/begin_weight_update`; a session some earlier update left open (the server says so
    with a 400) is closed first, once."""
    try:
        await request("POST", "/begin_weight_update", session_body())
    except SGLangError as exc:
        if exc.status != 400 or "already open" not in str(exc):
            raise
        log.warning("sglang_update_session_left_open", error=str(exc))
        await request("POST", "/end_weight_update", session_body())
        await request("POST", "/begin_weight_update", session_body())


async def _end_session(request: Request, raise_errors: bool) -> None:
    """`/end_weight_update`; its failure is raised only when nothing else failed."""
    try:
        await request("POST", "/end_weight_update", session_body())
    except Exception as exc:
        if raise_errors:
            raise
        log.warning("sglang_end_weight_update_failed", error=str(exc))
