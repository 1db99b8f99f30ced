"""Where a weight update's time goes: the trainer's phases in StepMetrics and its histogram, the
rollout's phases in UpdateWeightsResponse and its histogram, and the backends' serialised
weights (what the trainer writes) equal to what `save_hf` writes.

Real trainer gRPC server on port 0 against a real nats-server, with the recording scheduler of
test_trainer_service (its CommitWeights made slow on purpose); a real RolloutService over the
torch engine; tiny real models."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry
from safetensors.torch import load, load_file

from asyncrl.ledger import ensure_ledger
from asyncrl.natsutil import publish_group, wait_until
from asyncrl.spec import ExperimentSpec, ModelSpec, RolloutSpec, spec_to_json
from asyncrl.v1 import rollout_pb2, trainer_pb2
from services.rollout.server import RolloutCollector, RolloutServicer
from services.rollout.service import RolloutService
from services.rollout.torch_engine import TorchEngine
from services.trainer.backends.torch_backend import TorchBackend
from services.trainer.server import TrainerCollector
from tests.fakes import trainer_env
from tests.fakes.trainer_env import (
    EXP,
    RecordingScheduler,
    _group,
    _spec,
    _wait_commits,
    serving,
)

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

COMMIT_DELAY_S = 0.3
start_trainer = trainer_env.start_trainer  # its trainers commit to `scheduler` below


def _samples(collector, name: str) -> dict[tuple, float]:
    """{(sample name, labels...): value} of one collector's families named `name*`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    out = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name.startswith(name):
                out[(s.name, *sorted(s.labels.items()))] = s.value
    assert generate_latest(registry)  # renders
    return out


class SlowScheduler(RecordingScheduler):
    """CommitWeights answers after `delay_s`: a fleet that takes its time to load weights."""

    delay_s = COMMIT_DELAY_S

    async def CommitWeights(self, request, context):
        await asyncio.sleep(self.delay_s)
        return await super().CommitWeights(request, context)


@pytest.fixture
async def scheduler(js):
    """The recording scheduler with a slow CommitWeights (start_trainer's trainers commit to it)."""
    await ensure_ledger(js)  # as the real scheduler does (the trainer may not create it)
    async with serving(SlowScheduler()) as servicer:
        yield servicer


@pytest.fixture
async def trainer(start_trainer, scheduler):
    """(trainer service, its stub, the slow scheduler it commits to), all serving."""
    service, stub = await start_trainer()
    return service, stub, scheduler


async def _start(stub, tiny, **trainer) -> None:
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(
            experiment_id=EXP, spec_json=_spec(tiny[0], eta=4, **trainer)
        ),
        timeout=60,
    )


async def test_trainer_next_step_starts_while_previous_version_is_committed(tiny, trainer, js):
    service, stub, scheduler = trainer
    await _start(stub, tiny, checkpoint_every=100)
    for i in range(4):
        await publish_group(js, _group(tiny, f"g{i}", 0))
    await _wait_commits(scheduler, 2)

    first, second = (c.metrics for c in scheduler.commits[:2])
    assert first.serialize_s > 0 and first.write_s > 0 and first.step_time_s > 0
    assert (first.commit_s, first.checkpoint_s, first.stall_s) == (0, 0, 0)  # nothing before
    assert second.commit_s >= COMMIT_DELAY_S  # version 1's round trip, reported with step 2
    # step 2 trained while version 1 was committed: its stall is version 1's serialisation (the
    # first is cold: ~0.4 s on this machine when the test runs first in its process), no commit
    assert second.stall_s - first.serialize_s < COMMIT_DELAY_S
    assert second.write_s > 0 and second.wait_s >= 0

    got = _samples(TrainerCollector(service), "asyncrl_trainer_phase_seconds_count")
    count = {dict(k[1:])["phase"]: v for k, v in got.items()}
    assert count["train_step"] == count["serialize"] == count["write"] == count["stall"] == 2
    assert count["commit"] >= 1


async def test_trainer_checkpoint_waits_for_the_commit_and_is_timed(tiny, trainer, js):
    service, stub, scheduler = trainer
    await _start(stub, tiny, checkpoint_every=1)
    for i in range(4):
        await publish_group(js, _group(tiny, f"g{i}", 0))
    await _wait_commits(scheduler, 2)
    second = scheduler.commits[1].metrics
    assert second.checkpoint_s > 0  # after step 1, reported with step 2
    # the checkpoint of step 1 waited for version 1's commit: the stall shows it
    assert second.stall_s >= COMMIT_DELAY_S


async def test_trainer_stop_answered_while_next_step_trains_commits_it_then_stops(
    tiny, trainer, js
):
    service, stub, scheduler = trainer
    scheduler.stop_at_version = 1
    await _start(stub, tiny, checkpoint_every=5)
    for i in range(6):
        await publish_group(js, _group(tiny, f"g{i}", 0))
    await wait_until(lambda: service.state == "stopped", timeout=30)
    # step 2 was trained before version 1's answer came: committed (refused by a real
    # scheduler), never a third step
    assert [c.version for c in scheduler.commits] == [1, 2]
    root = service.var_dir / "checkpoints" / EXP
    ckpts = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_000002"]


async def test_rollout_update_weights_reports_read_pause_load_resume(tiny):
    spec = ExperimentSpec(
        model=ModelSpec(path=str(tiny[0])),
        dataset={"path": "unused.jsonl"},
        rollout=RolloutSpec(n_samples=2, engine="torch"),
    )
    engine = TorchEngine(seed=0)
    await engine.start()
    service = RolloutService(engine, js=None)
    servicer = RolloutServicer(service)
    try:
        await service.bind(EXP, spec_to_json(spec))
        req = rollout_pb2.UpdateWeightsRequest(experiment_id=EXP, version=0, uri=str(tiny[0]))
        loaded = await servicer.UpdateWeights(req, None)  # the first load: no phases
        assert (loaded.version, loaded.read_s, loaded.load_s) == (0, 0, 0)
        req.version = 1
        updated = await servicer.UpdateWeights(req, None)
    finally:
        await engine.stop()
    assert updated.version == 1
    assert updated.read_s > 0 and updated.load_s > 0
    assert updated.pause_s >= 0 and updated.resume_s >= 0
    phases = updated.read_s + updated.pause_s + updated.load_s + updated.resume_s
    assert phases <= updated.seconds

    got = _samples(RolloutCollector(service), "asyncrl_rollout_weight_update_seconds_count")
    count = {dict(k[1:])["phase"]: v for k, v in got.items()}
    assert count == {"total": 2, "read": 1, "pause": 1, "load": 1, "resume": 1}


def test_torch_backend_hf_files_equal_what_save_hf_writes(tiny, tmp_path):
    spec = ExperimentSpec(model=ModelSpec(path=str(tiny[0])), dataset={"path": "unused.jsonl"})
    backend = TorchBackend(spec, device="cpu")
    backend.load(str(tiny[0]))
    files = backend.hf_files()
    backend.save_hf(tmp_path)
    mine, saved = load(files["model.safetensors"]), load_file(tmp_path / "model.safetensors")
    assert sorted(mine) == sorted(saved)
    assert all(torch.equal(mine[k], saved[k]) for k in saved)
    assert json.loads(files["config.json"]) == json.loads((tmp_path / "config.json").read_text())
    with torch.no_grad():  # a snapshot: changing the model afterwards leaves the bytes alone
        next(backend.model.parameters()).add_(1.0)
    assert all(torch.equal(load(files["model.safetensors"])[k], saved[k]) for k in saved)


@pytest.mark.parametrize("family", ["qwen2"])
def test_megatron_backend_hf_files_equal_what_save_hf_writes(tmp_path, family):
    pytest.importorskip("megatron.core")
    from asyncrl.tiny import build_tiny_model
    from services.trainer.backends.megatron_backend import MegatronBackend
    from tests.integration.megatron_tp_worker import MICRO_BATCH, make_spec

    src = tmp_path / family
    build_tiny_model(src, family=family, tie_word_embeddings=True, seed=1)
    backend = MegatronBackend(make_spec(src), micro_batch_size=MICRO_BATCH)
    backend.load(str(src))
    files = backend.hf_files()
    backend.save_hf(tmp_path / "out")
    mine, saved = load(files["model.safetensors"]), load_file(tmp_path / "out/model.safetensors")
    assert sorted(mine) == sorted(saved)
    assert all(torch.equal(mine[k], saved[k]) for k in saved)
    assert files["config.json"] == (tmp_path / "out/config.json").read_bytes()
