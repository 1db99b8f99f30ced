"""How many groups each call carried, in each service of the control-plane benchmark.

A `bench.zero` patch (`ASYNCRL_BENCH_PATCH=bench.counts`, with ASYNCRL_BENCH_COUNTS=DIR): it
wraps the calls that carry groups between the services and counts them, and a daemon thread
writes the counts to DIR/<service>.json four times a second. The benchmark takes their
differences over a window: groups per GenerateGroups call, summaries per streamed message,
items per Score call, messages per pull. Counting costs a dict update per call.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

COUNTS_ENV = "ASYNCRL_BENCH_COUNTS"
WRITE_EVERY_S = 0.25

counts: Counter[str] = Counter()


def _count_calls(owner, name: str, key: str, size=None) -> None:
    """Wrap `owner.name` (a function or coroutine function): `key` counts its calls and
    `key`_items adds size(args) per call."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        counts[key] += 1
        if size is not None:
            counts[f"{key}_items"] += size(*args, **kwargs)
        return fn(*args, **kwargs)

    setattr(owner, name, wrapper)


def _count_results(owner, name: str, key: str) -> None:
    """Wrap the coroutine function `owner.name`: `key` counts its calls, `key`_items the
    length of what it returns."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        result = await fn(*args, **kwargs)
        counts[key] += 1
        counts[f"{key}_items"] += len(result)
        return result

    setattr(owner, name, wrapper)


def _count_stream(owner, name: str, key: str) -> None:
    """Wrap the async generator function `owner.name`: `key` counts the messages it yields,
    `key`_items their `summaries`."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        async for message in fn(*args, **kwargs):
            counts[key] += 1
            counts[f"{key}_items"] += len(message.summaries)
            yield message

    setattr(owner, name, wrapper)


def apply(service: str) -> None:
    directory = os.environ.get(COUNTS_ENV)
    if not directory:
        return
    try:
        _wrap(service)
    except (ImportError, AttributeError) as e:  # another version of the services: no counts
        print(f"bench.counts: {service} not counted ({e})", file=sys.stderr)
    path = Path(directory) / f"{service}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_writer, args=(path,), daemon=True, name="bench-counts").start()


def _wrap(service: str) -> None:
    if service == "scheduler":
        from services.scheduler.calls import WorkerCalls

        _count_calls(
            WorkerCalls, "generate_groups", "generate_groups", lambda self, w, reqs: len(reqs)
        )
    elif service == "rollout":
        from services.rollout import server
        from services.rollout.reward_client import RewardClient

        _count_stream(server, "answer_groups", "summary_messages")
        _count_calls(
            RewardClient, "_score_batch", "score_calls", lambda self, a, b, items: len(items)
        )
    elif service == "trainer":
        from services.trainer.consumer import GroupConsumer

        _count_calls(GroupConsumer, "_ask", "pull_requests")
        _count_results(GroupConsumer, "pull", "pulls")


def _writer(path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    while True:
        time.sleep(WRITE_EVERY_S)
        tmp.write_text(json.dumps(dict(counts)))
        os.replace(tmp, path)


def read(directory: Path) -> dict[str, int]:
    """Every service's counts, merged (their keys do not overlap)."""
    out: dict[str, int] = {}
    for path in Path(directory).glob("*.json"):
        try:
            out.update(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def per_group(before: dict[str, int], after: dict[str, int], groups: int) -> dict[str, dict]:
    """Over a window of `groups` trained groups: each counted call's calls per group, and the
    items it carried per call where it carries any."""
    out = {}
    for key in sorted(k for k in after if not k.endswith("_items")):
        calls = after[key] - before.get(key, 0)
        row = {"per_group": round(calls / groups, 3)}
        if f"{key}_items" in after and calls:
            items = after[f"{key}_items"] - before.get(f"{key}_items", 0)
            row["items_per_call"] = round(items / calls, 2)
        out[key] = row
    return out
