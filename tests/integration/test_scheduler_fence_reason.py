"""A rollout fenced for a failed UpdateWeights is fenced with its own reason: the scheduler's
`rollout_fenced` line carries the gRPC code and the rollout's words (issue 23 point 9: a
rewound run's rollouts were fenced with a bare `INVALID_ARGUMENT` while the cause, a version
directory without config.json, was dropped). Real scheduler on port 0 against a real
nats-server; the rollout checks a version as the real one does."""

from __future__ import annotations

from structlog.testing import capture_logs

from asyncrl.errors import BadRequest
from asyncrl.natsutil import wait_until
from asyncrl.weights import uri_to_path
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import ROLLOUT, FakeRollout, running_experiment

cluster = scheduler_env.cluster
files = scheduler_env.files


class CheckingRollout(FakeRollout):
    """UpdateWeights refuses a version directory without config.json with the real rollout's
    error (`RolloutService.update_weights`), which the service runtime answers as
    INVALID_ARGUMENT with its message."""

    async def UpdateWeights(self, request, context):
        path = uri_to_path(request.uri)
        if not (path / "config.json").is_file():
            raise BadRequest("uri", f"no HuggingFace config.json in {path}")
        return await super().UpdateWeights(request, context)


def _fenced(logs) -> list[str]:
    return [e["reason"] for e in logs if e["event"] == "rollout_fenced"]


async def test_update_weights_failure_fences_with_the_rollouts_reason(cluster, files):
    with capture_logs() as logs:
        await cluster.start_scheduler()
        first = CheckingRollout()
        exp_id = await running_experiment(cluster, files, first)
        runner = cluster.scheduler.get(exp_id)
        await wait_until(lambda: len(runner.fleet.ready) == 1, timeout=10)
        await cluster.commit(exp_id, 1)  # file:///w/v1: no such directory
        await wait_until(lambda: _fenced(logs), timeout=10)
        assert _fenced(logs) == [
            "UpdateWeights v1 failed: INVALID_ARGUMENT: uri: no HuggingFace config.json in /w/v1"
        ]
        await cluster.worker(ROLLOUT, CheckingRollout())  # joins at v1: the same cause
        await wait_until(lambda: len(_fenced(logs)) == 2, timeout=10)
    assert _fenced(logs)[1] == (
        "UpdateWeights failed: INVALID_ARGUMENT: uri: no HuggingFace config.json in /w/v1"
    )
