"""Eval rounds: which versions are evaluated, and how a round's groups become an EvalResult.

Pure bookkeeping; the experiment runner dispatches the groups. accuracy = fraction of samples
with reward >= 1.0; FAILED samples count as wrong and are reported in `failed`. A round also
records the span of policy versions that generated its tokens: it runs beside training, so
the fleet can take new weights while it generates (`eval.before_training` keeps the first
round to its version alone).
"""

from __future__ import annotations

from collections import deque

from asyncrl.types import EvalResult

MAX_EVAL_ATTEMPTS = 3
"""An eval prompt whose RPC fails this many times counts as all-failed samples."""


def eval_due(
    version: int,
    every_versions: int,
    *,
    start: bool = False,
    final: bool = False,
    since: int | None = None,
) -> bool:
    """Eval runs at the start version, every K versions (K = every_versions > 0), and at the end.
    With `since`, the fleet went from `since` straight to `version` (skipping the versions in
    between): due if any version after `since` up to `version` was."""
    if start or final:
        return True
    if every_versions <= 0:
        return False
    if since is None:
        return version % every_versions == 0
    return version // every_versions > since // every_versions


class EvalRound:
    """One eval of `n_prompts` prompts at `version`, `n_samples` samples each."""

    def __init__(self, version: int, n_prompts: int, n_samples: int):
        self.version = version
        self.n_prompts = n_prompts
        self.n_samples = n_samples
        self.pending: deque[tuple[int, int]] = deque((i, 0) for i in range(n_prompts))
        self.outstanding = 0
        self.correct = 0
        self.samples = 0
        self.failed = 0
        self.reward_sum = 0.0
        self.reward_count = 0
        self.min_version: int | None = None
        self.max_version: int | None = None

    def next(self) -> tuple[int, int] | None:
        """(prompt index, attempt) to dispatch next, or None."""
        if not self.pending:
            return None
        self.outstanding += 1
        return self.pending.popleft()

    def retry(self, index: int, attempt: int) -> None:
        """The prompt's RPC failed: try again, or count it all-failed after MAX_EVAL_ATTEMPTS."""
        self.outstanding -= 1
        if attempt + 1 >= MAX_EVAL_ATTEMPTS:
            self.samples += self.n_samples
            self.failed += self.n_samples
        else:
            self.pending.append((index, attempt + 1))

    def add(
        self,
        rewards: list[float],
        failed_samples: int,
        group_failed: bool,
        versions: tuple[int, int] | None = None,
    ) -> None:
        """A scored group. `rewards` are the samples' rewards (failed ones, if listed, are < 1);
        `versions`: the lowest and highest policy version of its tokens, if it generated any."""
        self.outstanding -= 1
        if versions is not None:
            low, high = versions
            self.min_version = low if self.min_version is None else min(self.min_version, low)
            self.max_version = high if self.max_version is None else max(self.max_version, high)
        if group_failed and not rewards:
            failed_samples = max(failed_samples, self.n_samples)
        self.samples += max(self.n_samples, len(rewards))
        self.failed += failed_samples
        self.correct += sum(1 for r in rewards if r >= 1.0)
        self.reward_sum += sum(rewards)
        self.reward_count += len(rewards)

    @property
    def done(self) -> bool:
        return not self.pending and self.outstanding == 0

    def result(self) -> EvalResult:
        return EvalResult(
            version=self.version,
            accuracy=self.correct / self.samples if self.samples else 0.0,
            reward_mean=self.reward_sum / self.reward_count if self.reward_count else 0.0,
            n_prompts=self.n_prompts,
            n_samples=self.samples,
            failed=self.failed,
            min_version=self.version if self.min_version is None else self.min_version,
            max_version=self.version if self.max_version is None else self.max_version,
        )


class Evaluator:
    """An experiment's eval rounds: which are due, which prompt goes next, what finished."""

    def __init__(
        self, n_prompts: int, every_versions: int, n_samples: int, done_versions: set[int]
    ):
        self.n_prompts = n_prompts
        self.every_versions = every_versions
        self.n_samples = n_samples
        self.versions = set(done_versions)
        """Versions evaluated or being evaluated (each at most once)."""
        self.rounds: list[EvalRound] = []
        self.running = 0
        self.first: EvalRound | None = None
        """The run's first round (its baseline, at v0 or where a run with no eval yet
        resumed), while it is open; never a round of a run that has evaluated before."""

    def schedule(
        self, version: int, *, start: bool = False, final: bool = False, since: int | None = None
    ) -> bool:
        """Open a round for `version` if eval is configured, due (see `eval_due`), and not done
        yet."""
        if not self.n_prompts or version in self.versions:
            return False
        if not eval_due(version, self.every_versions, start=start, final=final, since=since):
            return False
        baseline = start and not self.versions
        self.versions.add(version)
        self.rounds.append(EvalRound(version, self.n_prompts, self.n_samples))
        if baseline:
            self.first = self.rounds[-1]
        return True

    def next(self) -> tuple[EvalRound, int, int] | None:
        """(round, prompt index, attempt) to dispatch next, oldest round first."""
        for eval_round in self.rounds:
            nxt = eval_round.next()
            if nxt is not None:
                return eval_round, *nxt
        return None

    def pop_finished(self, eval_round: EvalRound) -> EvalResult | None:
        """The round's result once all its groups are in (then it is closed), else None."""
        if not eval_round.done or eval_round not in self.rounds:
            return None
        self.rounds.remove(eval_round)
        if eval_round is self.first:
            self.first = None
        return eval_round.result()

    @property
    def idle(self) -> bool:
        return not self.rounds

    @property
    def samples(self) -> int:
        """Samples scored so far in the open rounds."""
        return sum(r.samples for r in self.rounds)
