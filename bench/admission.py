"""Staleness admission overhead: the scheduler's StalenessManager per dispatched group.

Per group the scheduler asks `capacity()`, then reports `on_submit()` and an outcome
(`on_accept()` here); the fleet version follows the trainer (accepted // B) so capacity stays
open, as in a running experiment. Peers:
- a bare loop making the same three Python method calls on a no-op object (the call floor);
- the limit: one group's generation time on the KV-cache engine (the rollout benchmark's
  measurement, or measured here when run alone). The policy must be negligible against it.
"""

from __future__ import annotations

import importlib

from bench.report import Context, Result, Skip, best_of
from bench.rollout import group_seconds

NAME = "admission"
CALLS_PER_GROUP = 3  # capacity, on_submit, on_accept


class _Noop:
    def capacity(self) -> int:
        return 1

    def on_submit(self) -> None:
        pass

    def on_accept(self) -> None:
        pass


def _loop(manager, groups: int) -> None:
    for _ in range(groups):
        if manager.capacity() > 0:
            manager.on_submit()
            manager.on_accept()


def run(ctx: Context) -> list[Result]:
    try:
        policy = importlib.import_module("services.scheduler.policy")
        staleness_manager = policy.StalenessManager
    except (ImportError, AttributeError) as exc:
        raise Skip(f"services/scheduler/policy.py has no StalenessManager yet ({exc})") from exc

    groups, batch_size, eta = ctx.size(200_000, 2_000), 8, 2

    def policy_loop():
        manager = staleness_manager(
            max_concurrent=64,
            batch_size=batch_size,
            eta=eta,
            version_provider=lambda: manager.counts.accepted // batch_size,
        )
        _loop(manager, groups)
        assert manager.counts.accepted == groups, manager.counts  # capacity never closed

    policy_s = best_of(policy_loop, ctx.repeats)
    bare_s = best_of(lambda: _loop(_Noop(), groups), ctx.repeats)
    per_group = policy_s / groups
    generation = group_seconds(ctx)

    settings = {
        "groups": groups,
        "calls_per_group": CALLS_PER_GROUP,
        "batch_size": batch_size,
        "eta": eta,
        "max_concurrent": 64,
        "repeats": ctx.repeats,
    }
    calls = groups * CALLS_PER_GROUP
    return [
        Result(
            NAME,
            "StalenessManager calls/s",
            calls / policy_s,
            "calls/s",
            "bare loop of no-op calls",
            calls / bare_s,
            settings,
        ),
        Result(
            NAME,
            "policy cost per group",
            per_group,
            "s",
            "limit: one group's generation (rollout, KV cache)",
            generation,
            {**settings, "group": "rollout benchmark's group"},
        ),
    ]
