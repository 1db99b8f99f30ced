"""The scheduler's run logs (`trainer.loggers`): each committed step and each eval in
TensorBoard and W&B (offline) under <ASYNCRL_VAR>/runs/<id>/, complete by the time the
experiment is seen COMPLETED. Real scheduler on port 0 against a real nats-server; fake workers
(tests/fakes/scheduler_env.py); the files are read back with the libraries' own readers."""

from __future__ import annotations

from asyncrl.natsutil import wait_until
from asyncrl.v1 import common_pb2, scheduler_pb2
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import Cluster, FakeRollout, running_experiment
from tests.runlogs import tensorboard_scalars, wandb_history

cluster = scheduler_env.cluster
files = scheduler_env.files


async def _commit(cluster: Cluster, exp_id: str, version: int, loss: float):
    return await cluster.trainer_stub.CommitWeights(
        scheduler_pb2.CommitWeightsRequest(
            experiment_id=exp_id,
            version=version,
            uri=f"file:///w/v{version}",
            metrics=common_pb2.StepMetrics(
                step=version, version=version, groups=2, loss=loss, serialize_s=0.125
            ),
        ),
        timeout=10,
    )


async def test_steps_and_evals_in_tensorboard_and_wandb(
    cluster: Cluster, files, tmp_path, monkeypatch
):
    monkeypatch.setenv("ASYNCRL_VAR", str(tmp_path / "var"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    await cluster.start_scheduler()
    exp_id = await running_experiment(
        cluster,
        files,
        FakeRollout(rewards=(1.0, 0.0)),
        trainer={"total_steps": 2, "loggers": ["tensorboard", "wandb"]},
        eval={"dataset_path": files["eval"], "every_versions": 0, "n_samples": 2},
    )
    await _commit(cluster, exp_id, 1, loss=0.5)
    await _commit(cluster, exp_id, 2, loss=0.25)
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.state.value == "COMPLETED", 20)

    run = tmp_path / "var" / "runs" / exp_id
    tb = tensorboard_scalars(run / "tensorboard")
    assert tb["train/loss"] == [(1, 0.5), (2, 0.25)]
    assert tb["train/groups"] == [(1, 2.0), (2, 2.0)]
    assert tb["weight_update/serialize_s"] == [(1, 0.125), (2, 0.125)]
    assert [v for v, _ in tb["weight_update/scheduler_s"]] == [1, 2]  # filled in by the scheduler
    assert tb["eval/accuracy"] == [(0, 0.5), (2, 0.5)]  # rewards 1, 0: half right
    assert tb["eval/n_samples"] == [(0, 6.0), (2, 6.0)]

    rows = wandb_history(run / "wandb")
    assert [(r["version"], r["train/loss"]) for r in rows if "train/loss" in r] == [
        (1, 0.5),
        (2, 0.25),
    ]
    evals = [(r["version"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    assert evals == [(0, 0.5), (2, 0.5)]
