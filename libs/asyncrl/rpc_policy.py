"""Which role may call which asyncrl RPC (asyncrl.security's AuthInterceptor enforces it), and
what a token with a tenant may call at all."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

WORKER_ROLES = ("trainer", "rollout", "reward")
ROLES = ("admin", "viewer", "scheduler", *WORKER_ROLES)

# ---- the policy: which role may call which method ---------------------------------------------

_VIEW = ("admin", "viewer")
_WORKERS = WORKER_ROLES


def _methods(service: str, table: Mapping[str, Iterable[str]]) -> dict[str, frozenset[str]]:
    return {f"/asyncrl.v1.{service}/{m}": frozenset(roles) for m, roles in table.items()}


POLICY: dict[str, frozenset[str]] = {
    **_methods(
        "Scheduler",
        {
            "SubmitExperiment": ["admin"],
            "CancelExperiment": ["admin"],
            "ResumeExperiment": ["admin"],
            "GetExperiment": _VIEW,
            "ListExperiments": _VIEW,
            "WatchExperiment": _VIEW,
            "ListWorkers": _VIEW,
            "RegisterWorker": _WORKERS,
            "Heartbeat": _WORKERS,
            "CommitWeights": ["trainer"],
            "ReportDropped": ["trainer"],
        },
    ),
    **_methods(
        "Rollout",
        {
            "BindExperiment": ["scheduler"],
            "GenerateGroup": ["scheduler"],
            "GenerateGroups": ["scheduler"],
            "AbortGroups": ["scheduler"],
            "UpdateWeights": ["scheduler"],
            "GetStatus": ["scheduler", *_VIEW],
        },
    ),
    **_methods(
        "Reward",
        {
            "BindExperiment": ["rollout", "scheduler"],
            "Score": ["rollout"],
            "ListRewardFunctions": ["rollout", "scheduler", *_VIEW],
        },
    ),
    **_methods(
        "Trainer",
        {
            "StartExperiment": ["scheduler"],
            "StopExperiment": ["scheduler"],
            "CheckpointNow": ["scheduler", "admin"],
            "GetStatus": ["scheduler", *_VIEW],
        },
    ),
}
"""Every asyncrl RPC and the roles that may call it. Beyond roles, the scheduler checks that a
worker's calls come from the identity that registered it, and that `CommitWeights` /
`ReportDropped` come from the trainer bound to that experiment."""

TENANT_METHODS = frozenset(
    [
        *(
            f"/asyncrl.v1.Scheduler/{m}"
            for m in (
                "SubmitExperiment",
                "CancelExperiment",
                "ResumeExperiment",
                "GetExperiment",
                "ListExperiments",
                "WatchExperiment",
                "ListWorkers",
            )
        ),
        "/asyncrl.v1.Reward/ListRewardFunctions",
    ]
)
"""What a token with a tenant may call (its role permitting): the scheduler's experiment
methods, which show it only its tenant's experiments, ListWorkers, which hides which
experiment another tenant's workers serve, and the reward functions' names. Not the workers'
own methods: a trainer's or a rollout's GetStatus names the experiment it serves, and
CheckpointNow acts on any."""
