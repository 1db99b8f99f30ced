"""A `Ticket` names one dispatch of one training prompt: (epoch, row index, attempt). Its group
id is an `asyncrl.types.GroupId`, `<experiment>-e<epoch>-p<index>-a<attempt>`, and where it is stored (the scheduler's
record, the dataset cursor's state) it is the JSON list `[epoch, index, attempt]`. Both forms
are written and read here only.

A prompt re-queued after an infrastructure fault (failed RPC, lost worker, scheduler restart)
keeps its attempt, so a copy the lost call did publish and the retry are one message to
JetStream's dedup (Nats-Msg-Id = group id). Only a group that must be sampled afresh (dropped
or aborted as too stale) gets the next attempt (`retry`).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.types import GroupId


@dataclass(frozen=True)
class Ticket:
    epoch: int
    index: int
    attempt: int = 0

    def group_id(self, experiment_id: str) -> str:
        gid = GroupId(
            experiment_id=experiment_id, epoch=self.epoch, index=self.index, attempt=self.attempt
        )
        return str(gid)

    def retry(self) -> Ticket:
        return Ticket(epoch=self.epoch, index=self.index, attempt=self.attempt + 1)

    def to_json(self) -> list[int]:
        return [self.epoch, self.index, self.attempt]

    @staticmethod
    def from_json(data: list[int]) -> Ticket:
        epoch, index, attempt = data
        return Ticket(epoch=epoch, index=index, attempt=attempt)
