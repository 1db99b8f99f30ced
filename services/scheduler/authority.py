"""Who may act for an experiment as its trainer: commit weights, report dropped groups."""

from __future__ import annotations

import asyncio

from asyncrl.errors import PermissionDenied, Unavailable
from asyncrl.security import Principal
from services.scheduler.lifecycle import Lifecycle
from services.scheduler.registry import Registry
from services.scheduler.supervisor import TrainerSupervisor

TRAINER_WAIT_S = 10.0
"""How long a trainer's call waits for the experiment to know its trainer (after a scheduler
restart, until the trainer registered again and was started) before it is refused."""


class TrainerAuthority:
    def __init__(
        self,
        experiment_id: str,
        registry: Registry,
        supervisor: TrainerSupervisor,
        lifecycle: Lifecycle,
        log,
    ):
        self.experiment_id = experiment_id
        self.registry = registry
        self.supervisor = supervisor
        self.lifecycle = lifecycle
        self.log = log

    async def authorize(self, caller: Principal | None, trainer_id: str) -> None:
        """Only this experiment's trainer may commit or report drops: the bound one, or once
        none is bound (the run ended, its lease lapsed) the one last started. The caller must
        be the identity that registered it, and a `trainer_id` must be its worker id; else
        PermissionDenied. Right after a scheduler restart no trainer is known yet: the call
        waits up to TRAINER_WAIT_S for one to be started. A `trainer_id` registered nowhere
        is Unavailable: the trainer's registration is older than this scheduler (or lapsed),
        and it retries under the id it registers again with."""
        if caller is None and not trainer_id:
            return  # security is off and the call does not say who it is
        s = self.supervisor
        trainer = s.bound() or s.started
        if trainer is None and not self.lifecycle.terminal:
            try:
                await asyncio.wait_for(s.known.wait(), TRAINER_WAIT_S)
            except TimeoutError:
                pass
            trainer = s.bound() or s.started
        who = caller.subject if caller is not None else trainer_id
        exp = self.experiment_id
        if trainer is None:
            reason = f"experiment_id: {exp} has no trainer; {who} may not act for it"
        elif caller is not None and caller.subject != trainer.principal:
            reason = (
                f"experiment_id: {exp} belongs to trainer {trainer.worker_id} of"
                f" {trainer.principal}, not to {who}"
            )
        elif trainer_id and self.registry.get(trainer_id) is None:
            raise Unavailable(
                f"trainer_id: {trainer_id} is not registered (the scheduler restarted or its"
                " lease lapsed): register again and retry with the new id"
            )
        elif trainer_id and trainer_id != trainer.worker_id:
            reason = f"trainer_id: {trainer_id} is not {trainer.worker_id}, the trainer of {exp}"
        else:
            return
        self.log.warning("trainer_call_refused", caller=who, trainer_id=trainer_id, reason=reason)
        raise PermissionDenied(reason)
