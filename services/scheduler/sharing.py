"""Who holds which rollout replicas: whole replicas per full-parameter experiment, and shared
replicas per LoRA pool, whose group slots are divided between its experiments.

A *unit* holds rollouts: a full-parameter experiment alone, or a *pool*, every running LoRA
experiment on one base model (`pool_key`). Units get whole replicas as experiments always did:
an idle rollout goes to the unit with the fewest, and a unit with none takes one from a unit
with two or more. Every experiment of a pool is bound to each of the pool's rollouts
(`Registry.share`): one rollout serves all their adapters on the one base, in one batch
(services/rollout/adapters.py). The pool's slots (its rollouts' summed capacity) are divided
between its experiments by their spec `share` (`policy.divide_slots`), each experiment's
`Dispatcher.slots`: it dispatches no more groups than that, whatever the others do.
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


def bind_rollouts(registry: Registry, eligible: list[ExperimentRunner], log) -> None:
    """Whole rollouts to units (module docstring), every pool experiment on each of its pool's
    rollouts, then each pool's slots divided (`assign_slots`)."""
    units = fleet_units(eligible)
    held = {key: unit_rollouts(members) for key, members in units.items()}
    for key, members in units.items():  # an experiment that joined a pool shares its rollouts
        if key.startswith(POOL):
            for worker in held[key]:
                joining = [r for r in members if not registry.serves(worker, r.id)]
                give(registry, worker, joining, log)
    counts = {key: len(workers) for key, workers in held.items()}
    for key, members in units.items():  # a starving unit takes one from a rich one
        if counts[key] == 0 and not registry.idle(WorkerKind.ROLLOUT):
            donor = max(units, key=lambda k: counts[k])
            if counts[donor] >= 2:
                worker = held[donor].pop()
                for runner in units[donor]:
                    runner.release_rollout(worker, f"rebalanced to {members[0].id}")
                counts[donor] -= 1
    for worker in registry.idle(WorkerKind.ROLLOUT):
        key = min(units, key=lambda k: (counts[k], units[k][0].record.created_unix_ms))
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
