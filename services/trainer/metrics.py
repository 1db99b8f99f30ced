"""Pure step accounting for the trainer: which pulled groups are too stale to train, the
metrics of one optimizer step, and where the trainer's time goes around it. No grpc, no nats:
unit-tested with exact values."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from prometheus_client import Histogram

from asyncrl.types import RewardStatus, StepMetrics, TrajectoryGroup

PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class StepTimes:
    """Seconds around one step, the StepMetrics fields of the same names (common.proto): this
    step's wait and its version's serialise and write; the previous version's commit and
    checkpoint (they end after this step's metrics are sent), and the bytes its broadcast
    moved; and the stall before this step."""

    wait_s: float = 0.0
    serialize_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    checkpoint_s: float = 0.0
    stall_s: float = 0.0
    weight_bytes_sent: int = 0
    weight_bytes_full: int = 0


def stall_seconds(prev_train_end: float | None, train_start: float, wait_s: float) -> float:
    """The critical path from the previous train_step's end to this one's start that was not
    spent collecting the batch (0 for a run's first step)."""
    if prev_train_end is None:
        return 0.0
    return max(0.0, train_start - prev_train_end - wait_s)


def phase_histogram() -> Histogram:
    """Seconds per phase of the trainer's side of a weight update (serialize, write, commit;
    upload: the object store part of write, with trainer.weight_sync nats), its checkpoints, its train steps, and the stall each step waited on them; rendered by the
    trainer's collector (never prometheus' global registry)."""
    return Histogram(
        "asyncrl_trainer_phase_seconds",
        "Trainer time by phase: train_step, wait, serialize, write, upload, commit, checkpoint, stall",
        ["experiment", "phase"],
        buckets=PHASE_BUCKETS,
        registry=None,
    )


STALENESS_BUCKETS = (
    ("staleness_0", 0, 0),
    ("staleness_1", 1, 1),
    ("staleness_2_3", 2, 3),
    ("staleness_4_7", 4, 7),
    ("staleness_8_plus", 8, None),
)
"""The staleness histogram's StepMetrics fields: (name, lowest, highest or None)."""

BACKEND_DIAGNOSTICS = (
    "behav_weight_mean",
    "behav_weight_max",
    "is_masked_fraction",
    "is_truncated_fraction",
    "logprob_diff_mean",
    "logprob_diff_max",
)
"""StepMetrics fields copied from `TrainerBackend.train_step`'s answer
(`services.trainer.losses.diagnostics`)."""

DIAGNOSTIC_FIELDS = (
    *BACKEND_DIAGNOSTICS,
    "logprob_diff_tokens",
    "entropy",
    "kl",
    "clip_fraction",
    *(name for name, _, _ in STALENESS_BUCKETS),
    "version_span_max",
    "version_span_mean",
)
"""The per-step diagnostics a user steers by (each a Prometheus gauge of the last step)."""


def staleness_histogram(staleness: list[int]) -> dict[str, int]:
    """Groups per STALENESS_BUCKETS bucket."""
    return {
        name: sum(lo <= s and (hi is None or s <= hi) for s in staleness)
        for name, lo, hi in STALENESS_BUCKETS
    }


def version_spans(groups: list[TrajectoryGroup]) -> list[int]:
    """Per sample with trained tokens: newest - oldest version among them (0: one version)."""
    spans = []
    for g in groups:
        for s in g.samples:
            vs = (
                [v for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
                if s.loss_mask
                else s.versions
            )
            if vs:
                spans.append(max(vs) - min(vs))
    return spans


def is_too_stale(group: TrajectoryGroup, trainer_version: int, eta: int) -> bool:
    """A group may lag the trainer by at most eta versions (`rollout.max_head_offpolicyness`,
    AReaL's bounded staleness, arXiv:2505.24298)."""
    return group.staleness(trainer_version) > eta


def drop_reason(group: TrajectoryGroup, trainer_version: int, eta: int) -> str:
    return f"staleness {group.staleness(trainer_version)} > eta {eta}"


def step_metrics(
    *,
    step: int,
    version: int,
    groups: list[TrajectoryGroup],
    trainer_version: int,
    backend_stats: dict[str, float],
    step_time_s: float,
    stale_dropped: int,
    quarantined: int = 0,
    replayed: int = 0,
    times: StepTimes = StepTimes(),
) -> StepMetrics:
    """Metrics of the step that trained `groups` at `trainer_version` and produced `version`.

    `backend_stats` is what `TrainerBackend.train_step` returned (loss, clip_fraction, entropy,
    kl, grad_norm, tokens, the BACKEND_DIAGNOSTICS); a key a backend does not report counts
    as 0. The staleness histogram and the version spans come from `groups`. `stale_dropped`,
    `quarantined` and `replayed` count the messages consumed for the step and not trained;
    `times` says where the trainer's time went around it.
    """
    ok = [s for g in groups for s in g.samples if s.reward_status == RewardStatus.OK]
    staleness = [g.staleness(trainer_version) for g in groups]
    spans = version_spans(groups)
    tokens = backend_stats.get("tokens", 0.0)
    return StepMetrics(
        step=step,
        version=version,
        loss=float(backend_stats.get("loss", 0.0)),
        reward_mean=sum(s.reward for s in ok) / len(ok) if ok else 0.0,
        accuracy=sum(s.reward >= 1.0 for s in ok) / len(ok) if ok else 0.0,
        staleness_max=max(staleness, default=0),
        staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
        clip_fraction=float(backend_stats.get("clip_fraction", 0.0)),
        entropy=float(backend_stats.get("entropy", 0.0)),
        tokens_per_s=tokens / step_time_s if step_time_s > 0 else 0.0,
        step_time_s=step_time_s,
        groups=len(groups),
        stale_dropped=stale_dropped,
        grad_norm=float(backend_stats.get("grad_norm", 0.0)),
        kl=float(backend_stats.get("kl", 0.0)),
        stale_groups=sum(s >= 1 for s in staleness),
        quarantined=quarantined,
        replayed=replayed,
        **asdict(times),
        **{k: float(backend_stats.get(k, 0.0)) for k in BACKEND_DIAGNOSTICS},
        logprob_diff_tokens=int(backend_stats.get("logprob_diff_tokens", 0)),
        **staleness_histogram(staleness),
        version_span_max=max(spans, default=0),
        version_span_mean=sum(spans) / len(spans) if spans else 0.0,
    )
