"""Prometheus metrics: a real scheduler (nats-server + gRPC on port 0) with its metrics served
over HTTPS on port 0, scraped with an HTTPS GET that trusts the session's CA (as a viewer)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from dataclasses import fields

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.grpcutil import channel
from asyncrl.metrics import MetricsServer
from asyncrl.security import Credentials
from asyncrl.types import EvalResult, StepMetrics
from asyncrl.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.rollout.server import RolloutCollector
from services.rollout.service import RolloutService
from services.rollout.serving import Loaded
from services.rollout.torch_engine import TorchEngine
from services.scheduler.server import create_scheduler
from services.trainer.server import TrainerCollector
from services.trainer.service import TrainerService


@pytest.fixture
def spec_json(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4))
    )
    return json.dumps(
        {
            "name": "metrics",
            "model": {"path": str(model)},
            "dataset": {"path": str(data)},
            "rollout": {"n_samples": 2},
            "reward": {"function": "exact_match"},
            "trainer": {"batch_size": 2, "total_steps": 1, "backend": "torch"},
        }
    )


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics -> {(sample name, sorted labels): value}."""
    tls = Credentials.load("viewer").client_ssl_context()
    url = f"https://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5, context=tls) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_scheduler_metrics_scrape_shows_experiment_and_workers(nats_server, spec_json):
    runtime, scheduler = await create_scheduler(nats_server.url, metrics_port=0)
    metrics_port = runtime.metrics_port
    ch = channel(f"127.0.0.1:{runtime.port}")  # the CLI's admin
    worker_ch = channel(f"127.0.0.1:{runtime.port}", "reward")
    try:
        assert metrics_port > 0
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        await scheduler_pb2_grpc.SchedulerStub(worker_ch).RegisterWorker(
            scheduler_pb2.RegisterWorkerRequest(
                kind=common_pb2.WORKER_KIND_REWARD, address="127.0.0.1:1", capacity=4
            ),
            timeout=5,
        )
        exp = await stub.SubmitExperiment(
            scheduler_pb2.SubmitExperimentRequest(spec_json=spec_json), timeout=10
        )
        # what a trainer commit and an eval would have recorded (no trainer runs here)
        runner = scheduler.get(exp.id)
        record = runner.record
        record.history.append(StepMetrics(step=1, version=1, loss=0.25, reward_mean=0.5))
        record.evals.append(EvalResult(1, 0.75, 0.75, 4, 8, 0))
        runner.staleness.counts.accepted = 3  # the counters' owner (progress is made from it)

        got = await asyncio.to_thread(scrape, metrics_port)
        e = (("experiment", exp.id),)
        assert got[("asyncrl_scheduler_workers", (("kind", "reward"),))] == 1.0
        assert got[("asyncrl_scheduler_workers", (("kind", "rollout"),))] == 0.0
        assert got[("asyncrl_scheduler_version", e)] == 0.0
        assert got[("asyncrl_scheduler_accepted", e)] == 3.0
        assert got[("asyncrl_scheduler_last_step_loss", e)] == 0.25
        assert got[("asyncrl_scheduler_last_step_reward_mean", e)] == 0.5
        assert got[("asyncrl_scheduler_last_eval_accuracy", e)] == 0.75
        assert ("asyncrl_scheduler_rollout_tokens_per_s", e) in got
    finally:
        await ch.close()
        await worker_ch.close()
        await runtime.close()


async def test_worker_collectors_one_registry_each_report_live_state_without_conflict(tmp_path):
    """Real rollout and trainer service objects (not serving); two of a kind in one process
    each get their own registry, so there is no duplicate-registration error."""
    rollout = RolloutService(TorchEngine(seed=0), js=None)
    rollout.loaded["exp-1"] = Loaded(codec=None, lane="")  # serving exp-1's weights
    rollout.throughput.add(120)
    trainer = TrainerService(None, None, tmp_path / "var", tmp_path / "weights")
    trainer.experiment_id, trainer.version, trainer.step = "exp-1", 5, 6
    trainer.last_metrics = StepMetrics(
        **{f.name: 0 for f in fields(StepMetrics)}
        | {"loss": 1.5, "staleness_max": 2, "tokens_per_s": 9.0}
        | {"logprob_diff_max": 0.25, "is_masked_fraction": 0.125, "staleness_1": 3}
    )
    servers = [
        MetricsServer(RolloutCollector(rollout)),
        MetricsServer(TrainerCollector(trainer)),
        MetricsServer(RolloutCollector(RolloutService(TorchEngine(seed=0), js=None))),
    ]
    tls = Credentials.load("rollout").server_ssl_context()
    port, port2, _ = [await server.start(0, ssl_context=tls) for server in servers]
    try:
        e = (("experiment", "exp-1"),)
        got = await asyncio.to_thread(scrape, port)
        assert got[("asyncrl_rollout_running_groups", e)] == 0.0
        assert got[("asyncrl_rollout_orphaned_groups", e)] == 0.0
        assert got[("asyncrl_rollout_running_samples", e)] == 0.0
        assert got[("asyncrl_rollout_tokens_generated", e)] == 120.0
        assert got[("asyncrl_rollout_engine_version", e)] == 0.0
        got = await asyncio.to_thread(scrape, port2)
        assert got[("asyncrl_trainer_step", e)] == 6.0
        assert got[("asyncrl_trainer_version", e)] == 5.0
        assert got[("asyncrl_trainer_last_step_loss", e)] == 1.5
        assert got[("asyncrl_trainer_last_step_staleness_max", e)] == 2.0
        assert got[("asyncrl_trainer_last_step_tokens_per_s", e)] == 9.0
        assert got[("asyncrl_trainer_last_step_logprob_diff_max", e)] == 0.25
        assert got[("asyncrl_trainer_last_step_is_masked_fraction", e)] == 0.125
        assert got[("asyncrl_trainer_last_step_staleness_1", e)] == 3.0
    finally:
        for server in servers:
            await server.stop()
