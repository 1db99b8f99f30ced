"""The rollout/trainer logprob mismatch of a run's trajectories.

For every version v, the tokens the rollout generated under v (`Sample.versions`, policy tokens
only) are compared with the logprobs the trainer computes for the same prefix under v's weights:
|logprob_rollout - logprob_trainer|. In exact arithmetic the two are equal (the engines record
the unscaled log-softmax, `services/rollout/torch_engine.py`); what is left is the numerics of
the two implementations (here: HF fp32 in the rollout, megatron-core bf16 in the trainer), the
gap that decoupled PPO's behaviour weight pi_prox / pi_behav absorbs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from asyncrl.types import TrajectoryGroup

Logprobs = list[list[list[float]]]
"""Per group, per sample, one logprob per output token (`TrainerBackend.logprobs`)."""


def deltas(groups: list[TrajectoryGroup], recomputed: Logprobs, version: int) -> list[float]:
    """logprob_trainer - logprob_rollout for each policy token generated under `version`."""
    out = []
    for group, group_lp in zip(groups, recomputed, strict=True):
        for sample, trainer_lp in zip(group.samples, group_lp, strict=True):
            for behav, mine, v, trained in zip(
                sample.logprobs, trainer_lp, sample.versions, sample.trained_mask(), strict=True
            ):
                if v == version and trained:
                    out.append(mine - behav)
    return out


def summarize(per_version: dict[int, list[float]]) -> dict:
    """Mean |delta| over all tokens (and per version), max |delta|, mean signed delta."""
    every = [d for ds in per_version.values() for d in ds]
    if not every:
        return {"tokens": 0}
    return {
        "tokens": len(every),
        "mean_abs": sum(abs(d) for d in every) / len(every),
        "max_abs": max(abs(d) for d in every),
        "mean_signed": sum(every) / len(every),
        "per_version": {
            v: round(sum(abs(d) for d in ds) / len(ds), 6)
            for v, ds in sorted(per_version.items())
            if ds
        },
    }


def measure(
    groups: list[TrajectoryGroup],
    versions: Iterable[int],
    logprobs_at: Callable[[int, list[TrajectoryGroup]], Logprobs],
) -> dict:
    """`summarize` over `versions`; `logprobs_at(v, groups)` recomputes under v's weights."""
    per_version = {}
    for v in versions:
        mine = [g for g in groups if any(v in s.versions for s in g.samples)]
        if mine:
            per_version[v] = deltas(mine, logprobs_at(v, mine), v)
    return summarize(per_version)
