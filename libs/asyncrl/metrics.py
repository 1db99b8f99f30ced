"""Prometheus metrics for the services, read from the live service objects at scrape time.

Each service object gets its own collector on its own CollectorRegistry (never the global one),
so a test process can build many schedulers/trainers/rollouts without duplicate-registration
errors. The collectors only read attributes (duck-typed: no service imports here); the HTTP
server runs in a daemon thread and reads them while the event loop keeps running.

    registry = registry_for(SchedulerCollector(scheduler))
    port = start_metrics_server(0, registry)   # GET http://127.0.0.1:<port>/metrics
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from asyncrl.logging import get_logger

log = get_logger()

WORKER_KINDS = ("rollout", "reward", "trainer")
STEP_FIELDS = ("loss", "reward_mean", "staleness_max", "tokens_per_s", "step_time_s")


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


class SchedulerCollector(Collector):
    """Per experiment (label `experiment`): progress counters, the last step and eval; and the
    registered workers by kind. `scheduler` is a services.scheduler.core.Scheduler."""

    PROGRESS = {
        "version": "Fleet version: the weights the rollouts serve",
        "accepted": "Groups accepted into training",
        "rejected": "Groups rejected by the filters",
        "failed": "Groups that failed",
        "stale_dropped": "Groups dropped as too stale",
        "running": "Groups in flight",
        "trained_groups": "Groups the trainer trained on",
        "rollout_tokens_per_s": "Rollout throughput in generated tokens per second",
    }

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self) -> Iterator[GaugeMetricFamily]:
        runners = list(self.scheduler.runners.values())
        progress = {
            key: _gauge(f"asyncrl_scheduler_{key}", doc, ["experiment"])
            for key, doc in self.PROGRESS.items()
        }
        last_step = {
            key: _gauge(f"asyncrl_scheduler_last_step_{key}", f"Last step's {key}", ["experiment"])
            for key in ("loss", "reward_mean", "staleness_max")
        }
        accuracy = _gauge(
            "asyncrl_scheduler_last_eval_accuracy", "Accuracy of the last eval", ["experiment"]
        )
        for runner in runners:
            record = runner.record
            labels = [record.id]
            for key, family in progress.items():
                family.add_metric(labels, float(getattr(record.progress, key)))
            if record.history:
                step = record.history[-1]
                for key, family in last_step.items():
                    family.add_metric(labels, float(getattr(step, key)))
            if record.evals:
                accuracy.add_metric(labels, float(record.evals[-1].accuracy))
        yield from progress.values()
        yield from last_step.values()
        yield accuracy

        workers = _gauge("asyncrl_scheduler_workers", "Registered workers by kind", ["kind"])
        counts = dict.fromkeys(WORKER_KINDS, 0)
        for worker in _read(self.scheduler.workers):
            counts[str(worker.kind)] = counts.get(str(worker.kind), 0) + 1
        for kind, n in counts.items():
            workers.add_metric([kind], float(n))
        yield workers


class TrainerCollector(Collector):
    """Version, step and the last step's metrics of a services.trainer.service.TrainerService."""

    def __init__(self, service):
        self.service = service

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.service
        labels = [s.experiment_id]
        version = _gauge("asyncrl_trainer_version", "Weights version trained", ["experiment"])
        version.add_metric(labels, float(s.version))
        step = _gauge("asyncrl_trainer_step", "Optimizer steps taken", ["experiment"])
        step.add_metric(labels, float(s.step))
        yield version
        yield step
        m = s.last_metrics
        for key in STEP_FIELDS:
            family = _gauge(
                f"asyncrl_trainer_last_step_{key}", f"Last step's {key}", ["experiment"]
            )
            if m is not None:
                family.add_metric(labels, float(getattr(m, key)))
            yield family


class RolloutCollector(Collector):
    """Running groups/samples, tokens generated and the served version of a
    services.rollout.service.RolloutService."""

    def __init__(self, service):
        self.service = service

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.service
        labels = [s.experiment_id]
        values = {
            "running_groups": ("Groups being generated", s.running_groups),
            "running_samples": ("Samples in the engine", s.engine.running),
            "tokens_generated": ("Tokens generated since start", s.throughput.total),
            "engine_version": ("Weights version the engine serves", s.engine.version),
        }
        try:  # the event loop may append to the window while we read it
            values["tokens_per_s"] = ("Generated tokens per second", s.throughput.rate())
        except RuntimeError:
            pass
        for key, (doc, value) in values.items():
            family = _gauge(f"asyncrl_rollout_{key}", doc, ["experiment"])
            family.add_metric(labels, float(value))
            yield family


def _read(fn, attempts: int = 3):
    """fn() from the HTTP thread: retried if the event loop resized a dict it iterated."""
    for i in range(attempts):
        try:
            return fn()
        except RuntimeError:
            if i == attempts - 1:
                raise


def registry_for(*collectors: Collector) -> CollectorRegistry:
    """A fresh registry holding `collectors` (one per service object)."""
    registry = CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)
    return registry


def start_metrics_server(
    port: int, registry: CollectorRegistry | None = None, host: str | None = None
) -> int:
    """Serve `registry` (default: prometheus' global one) at http://host:port/metrics in a
    daemon thread; host defaults to ASYNCRL_METRICS_HOST or 127.0.0.1, port 0 picks a free
    port. Returns the bound port."""
    return serve_metrics(port, registry, host)[1]


def serve_metrics(port: int, registry: CollectorRegistry | None = None, host: str | None = None):
    """Like start_metrics_server, returning (server, port): `server.shutdown()` stops it."""
    from prometheus_client import REGISTRY

    host = host or os.environ.get("ASYNCRL_METRICS_HOST", "127.0.0.1")
    server, _thread = start_http_server(port, addr=host, registry=registry or REGISTRY)
    bound = server.server_port
    log.info("metrics_serving", host=host, port=bound)
    return server, bound
