"""Who holds which rollout replicas: whole replicas per full-parameter experiment, and shared
replicas per LoRA pool, whose group slots are divided between its experiments.

A *unit* holds rollouts: a full-parameter experiment alone, or a *pool*, every running LoRA
experiment on one base model (`pool_key`). Units get whole replicas by their weight (spec
`share`; a pool's is its experiments' mean): each unit's target is its part of every rollout
there is (`fair_targets`, at least one each), an idle rollout goes to the unit furthest below
its target, and when an experiment starts or ends (or rollouts come or go) the units above
their target give rollouts to those below (`rebalance`; the least busy goes, its groups
re-queued). No experiment takes every idle rollout because it came first. Every experiment of a pool is bound to each of the pool's rollouts
(`Registry.share`): one rollout serves all their adapters on the one base, in one batch
(services/rollout/adapters.py). The pool's slots (its rollouts' summed capacity) are divided
between its experiments by their spec `share` (`policy.divide_slots`), each experiment's
`Dispatcher.slots`: it dispatches no more groups than that, whatever the others do.

Reward workers are divided likewise (`reward_slices`): each experiment's groups carry its own
slice of them, by share, instead of every address to every group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.policy import divide_slots
from services.scheduler.registry import Registry, Worker, WorkerKind

if TYPE_CHECKING:
    from services.scheduler.experiments import ExperimentRunner

POOL = "lora:"
"""Prefix of a pool's unit key (an experiment id never has a colon)."""


def pool_key(runner: ExperimentRunner) -> str:
    """The unit an experiment's rollouts belong to: its own id (full-parameter, or LoRA on the
    SGLang engine, whose adapters are not per experiment here), or the pool of torch-engine
    LoRA experiments on the same base model and tokenizer."""
    if runner.spec.trainer.lora is None or runner.spec.rollout.engine != "torch":
        return runner.id
    model = runner.spec.model
    return f"{POOL}{model.path}|{model.tokenizer_path or ''}"


def fleet_units(runners: list[ExperimentRunner]) -> dict[str, list[ExperimentRunner]]:
    """The units of `runners` (oldest first), each with its experiments in the same order."""
    units: dict[str, list[ExperimentRunner]] = {}
    for runner in runners:
        units.setdefault(pool_key(runner), []).append(runner)
    return units


def unit_rollouts(members: list[ExperimentRunner]) -> list[Worker]:
    """The rollouts a unit holds: those bound to, or shared with, any of its experiments."""
    return list({w.worker_id: w for r in members for w in r.rollouts()}.values())


def give(registry: Registry, worker: Worker, members: list[ExperimentRunner], log) -> None:
    """Bind `worker` to a unit: to its one full-parameter experiment, or shared with every
    experiment of a pool; each loads its weights (`attach_rollout`)."""
    pooled = bool(members) and pool_key(members[0]).startswith(POOL)
    for runner in members:
        if pooled and not registry.share(worker, runner.id):
            continue  # it fenced this rollout a moment ago
        if not pooled:
            registry.bind(worker, runner.id)
        log.info(
            "worker_bound",
            worker=worker.worker_id,
            kind="rollout",
            experiment=runner.id,
            shared=pooled,
        )
        runner.attach_rollout(worker)


def unit_weight(members: list[ExperimentRunner]) -> float:
    """A unit's weight in the spread of rollouts: a full-parameter experiment's spec `share`,
    a pool's the mean of its experiments' (they divide its slots by theirs)."""
    return sum(r.spec.share for r in members) / len(members)


def fair_targets(total: int, weights: dict[str, float]) -> dict[str, int]:
    """How many of `total` rollouts each unit should hold: by weight, at least one each
    (`divide_slots`: largest remainders, ties to the older unit, listed first)."""
    return divide_slots(total, weights) if weights else {}


def rebalance(counts: dict[str, int], targets: dict[str, int]) -> list[tuple[str, str]]:
    """The moves (donor, taker) that bring units below their target up to it, each from the
    unit furthest above its own (ties to the later unit: the younger gives first); a unit
    never gives below its target. Pure: `counts` is not changed."""
    counts = dict(counts)
    moves = []
    for taker in targets:
        while counts[taker] < targets[taker]:
            surplus = {k: counts[k] - targets[k] for k in targets if counts[k] > targets[k]}
            if not surplus:
                return moves
            donor = max(reversed(list(surplus)), key=lambda k: surplus[k])
            counts[donor] -= 1
            counts[taker] += 1
            moves.append((donor, taker))
    return moves


def bind_rollouts(registry: Registry, eligible: list[ExperimentRunner], log) -> None:
    """Every pool experiment on each of its pool's rollouts; whole rollouts to units by their
    weight (`fair_targets`): rollouts move from the units above their target to those below
    (an experiment started or ended, rollouts came or went), idle ones go to the unit furthest
    below; then each pool's slots divided (`assign_slots`)."""
    units = fleet_units(eligible)
    held = {key: unit_rollouts(members) for key, members in units.items()}
    for key, members in units.items():  # an experiment that joined a pool shares its rollouts
        if key.startswith(POOL):
            for worker in held[key]:
                joining = [r for r in members if not registry.serves(worker, r.id)]
                give(registry, worker, joining, log)
    idle = registry.idle(WorkerKind.ROLLOUT)
    counts = {key: len(workers) for key, workers in held.items()}
    total = sum(counts.values()) + len(idle)
    targets = fair_targets(total, {key: unit_weight(m) for key, m in units.items()})
    for _ in range(len(idle)):  # the idle ones first: no move needed for them
        key = max(
            units, key=lambda k: (targets[k] - counts[k], -units[k][0].record.created_unix_ms)
        )
        counts[key] += 1
    for donor, taker in rebalance(counts, targets):
        worker = min(held[donor], key=lambda w: (w.running, w.worker_id))  # the least busy
        held[donor].remove(worker)
        for runner in units[donor]:
            runner.release_rollout(worker, f"rebalanced to {units[taker][0].id}")
    counts = {key: len(workers) for key, workers in held.items()}
    for worker in registry.idle(WorkerKind.ROLLOUT):
        key = max(
            units, key=lambda k: (targets[k] - counts[k], -units[k][0].record.created_unix_ms)
        )
        give(registry, worker, units[key], log)
        counts[key] += 1
    assign_slots(units)


def assign_slots(units: dict[str, list[ExperimentRunner]]) -> None:
    """Each pool experiment's `Dispatcher.slots`: its part of the pool's rollouts' summed
    capacity by spec `share` (`divide_slots`); None (no cap) for a full-parameter one."""
    for key, members in units.items():
        if not key.startswith(POOL):
            members[0].dispatcher.slots = None
            continue
        total = sum(max(1, w.capacity) for w in unit_rollouts(members))
        quotas = divide_slots(total, {r.id: r.spec.share for r in members})
        for runner in members:
            if runner.dispatcher.slots != quotas[runner.id]:
                runner.log.info("slots_divided", slots=quotas[runner.id], of=total)
            runner.dispatcher.slots = quotas[runner.id]


def reward_slices(addresses: list[str], shares: dict[str, float]) -> dict[str, list[str]]:
    """The reward workers each experiment's groups go to: `addresses` cut into consecutive
    slices by `shares` (`divide_slots`: at least one each; with fewer workers than experiments
    the slices wrap around and overlap), in the order given (oldest experiment first)."""
    if not addresses:
        return {eid: [] for eid in shares}
    slices, at = {}, 0
    for eid, n in divide_slots(len(addresses), shares).items():
        slices[eid] = [addresses[(at + i) % len(addresses)] for i in range(n)]
        at += n
    return slices


def assign_rewards(registry: Registry, live: list[ExperimentRunner]) -> None:
    """Each live experiment's reward workers (`reward_slices`, by spec `share`): its groups
    carry those addresses only, and it binds only those (a rollout binds a reward worker it
    is sent to on its own first call)."""
    shares = {r.id: r.spec.share for r in live}
    for runner, addresses in zip(
        live, reward_slices(registry.reward_addresses(), shares).values(), strict=True
    ):
        runner.reward_slice = addresses
