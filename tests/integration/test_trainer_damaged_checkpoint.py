"""A damaged newest checkpoint (issue 23 point 6) is set aside and the trainer resumes from
the newest good one, as after a deeper crash: 4 KiB of garbage in its model.pt (torch.load
raised nothing: every later step was NaN), the file zeroed (what a power cut before an fsync
leaves), its trained-ids log truncated. Real trainer gRPC server, real nats-server, the tiny
real model on the torch backend; the damage is done to the files it wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from asyncrl.natsutil import publish_group, wait_until
from asyncrl.v1 import trainer_pb2
from asyncrl.weights import uri_to_path
from services.trainer.checkpoint import DAMAGED_DIR, IDS_DIR, checkpoint_root, latest_checkpoint
from tests.fakes import trainer_env
from tests.fakes.trainer_env import EXP, _group, _spec, _wait_commits

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

scheduler = trainer_env.scheduler
start_trainer = trainer_env.start_trainer


def _garbage(step_dir: Path) -> Path:
    model = step_dir / "backend" / "model.pt"
    with open(model, "r+b") as f:
        f.seek(os.path.getsize(model) // 2)
        f.write(os.urandom(4096))
    return model


def _zeroed(step_dir: Path) -> Path:
    model = step_dir / "backend" / "model.pt"
    model.write_bytes(bytes(os.path.getsize(model)))
    return model


def _truncated_ids(step_dir: Path) -> Path:
    state = json.loads((step_dir / "state.json").read_text())
    log = step_dir.parent / IDS_DIR / state["trained_ids_log"]["file"]
    os.truncate(log, os.path.getsize(log) // 2)
    return log


@pytest.mark.parametrize("damage", [_garbage, _zeroed, _truncated_ids])
async def test_trainer_damaged_newest_checkpoint_set_aside_resumes_from_older_one(
    tiny, scheduler, start_trainer, js, tmp_path, damage
):
    spec = _spec(tiny[0], eta=8, checkpoint_every=2)
    service, stub = await start_trainer()
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=spec), timeout=60
    )
    for i in range(8):
        await publish_group(js, _group(tiny, f"g{i}", 0))
    await _wait_commits(scheduler, 4)
    await wait_until(lambda: service.state == "waiting")
    await service.close(checkpoint=False)  # a crash after step 4's checkpoint
    root = checkpoint_root(tmp_path / "var", EXP)
    assert latest_checkpoint(root)[0].name == "step_000004"
    damaged = damage(root / "step_000004")

    with capture_logs() as logs:
        service2, stub2 = await start_trainer()
        resp = await stub2.StartExperiment(
            trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=spec), timeout=60
        )
        assert (resp.version, resp.resumed) == (2, True)  # step 2's checkpoint
        assert (uri_to_path(resp.uri) / "config.json").is_file()
        await _wait_commits(scheduler, 6)  # g4..g7 come again: steps 3 and 4 trained again
    [aside] = [e for e in logs if e["event"] == "checkpoint_set_aside"]
    assert (aside["file"], aside["checkpoint"]) == (str(damaged), str(root / "step_000004"))
    assert aside["reason"]
    assert Path(aside["moved_to"]).parent == root / DAMAGED_DIR
    assert [c.version for c in scheduler.commits] == [1, 2, 3, 4, 3, 4]
    assert [c.metrics.loss == c.metrics.loss for c in scheduler.commits] == [True] * 6  # no NaN
    await wait_until(lambda: service2.state == "waiting")
    path, state = latest_checkpoint(root)  # the resumed run's step 4, written again
    assert (path.name, state.trained_ids) == ("step_000004", tuple(f"g{i}" for i in range(8)))
