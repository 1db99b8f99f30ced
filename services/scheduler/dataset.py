"""The dataset an experiment iterates: JSONL prompts and a resumable cursor over epochs,
handing out `Ticket`s (asyncrl.ticket: one dispatch of one prompt, and its group id)."""

from __future__ import annotations

import json
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from asyncrl.spec import SpecError
from asyncrl.ticket import Ticket


@dataclass(frozen=True)
class Prompt:
    index: int
    prompt: str
    answer: str

    @property
    def prompt_id(self) -> str:
        return f"p{self.index}"


def load_prompts(
    path: str,
    prompt_key: str,
    answer_key: str,
    max_prompts: int | None = None,
    field: str = "dataset.path",
) -> list[Prompt]:
    """Read a JSONL file; SpecError(field, "line N: ...") for a bad row, or no rows at all."""
    prompts: list[Prompt] = []
    with open(Path(path), "rb") as f:  # bytes: a line that is not UTF-8 is named by its number
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SpecError(
                    field, f"line {line_no}: not UTF-8 (byte 0x{raw[e.start]:02x} at {e.start})"
                ) from None
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecError(field, f"line {line_no}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise SpecError(field, f"line {line_no}: expected a JSON object")
            for key in (prompt_key, answer_key):
                if key not in row:
                    raise SpecError(field, f"line {line_no}: missing key {key!r}")
            prompts.append(Prompt(len(prompts), str(row[prompt_key]), str(row[answer_key])))
            if max_prompts is not None and len(prompts) >= max_prompts:
                break
    if not prompts:
        raise SpecError(field, f"no prompts in {path}")
    return prompts


class DatasetCursor:
    """Walks `n_prompts` rows for `epochs` epochs; a requeue list takes priority.

    Each epoch's order is a shuffle seeded with seed + epoch, so it can be recomputed on resume
    from (epoch, position) alone.
    """

    def __init__(
        self, n_prompts: int, epochs: int, shuffle: bool, seed: int, state: dict | None = None
    ):
        self.n_prompts = n_prompts
        self.epochs = epochs
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.requeued: deque[Ticket] = deque()
        self._order: tuple[int, list[int]] | None = None
        if state:
            self.epoch = int(state["epoch"])
            self.position = int(state["position"])
            self.requeued.extend(Ticket.from_json(t) for t in state.get("requeue", []))

    def order(self, epoch: int) -> list[int]:
        """Row indices in the order epoch `epoch` visits them."""
        if self._order is None or self._order[0] != epoch:
            rows = list(range(self.n_prompts))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(rows)
            self._order = (epoch, rows)
        return self._order[1]

    def next(self) -> Ticket | None:
        """The next prompt to dispatch, re-queued ones first; None when all epochs are done."""
        if self.requeued:
            return self.requeued.popleft()
        if self.epoch >= self.epochs:
            return None
        ticket = Ticket(epoch=self.epoch, index=self.order(self.epoch)[self.position])
        self.position += 1
        if self.position >= self.n_prompts:
            self.epoch += 1
            self.position = 0
        return ticket

    def requeue(self, ticket: Ticket, new_attempt: bool = False, front: bool = False) -> None:
        """Put a prompt back: under the same group id after an infrastructure fault, with
        `new_attempt` when its sample is unusable (too stale) and must be generated again."""
        item = ticket.retry() if new_attempt else ticket
        if front:
            self.requeued.appendleft(item)
        else:
            self.requeued.append(item)

    @property
    def exhausted(self) -> bool:
        return not self.requeued and self.epoch >= self.epochs

    def state(self) -> dict:
        """JSON-serialisable state; DatasetCursor(..., state=state) resumes from it."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "requeue": [t.to_json() for t in self.requeued],
        }
