"""The trainer records each version's weights fingerprint (its manifest, CommitWeights, the
ledger's `trained` event) and quarantines a group whose samples carry another fingerprint for a
version: dead-lettered with the reason, while groups with the right fingerprint, or none (an
older rollout: unverified), are trained and the run goes on. The real trainer service (torch
backend, tiny model) against a real nats-server; the scheduler side records the commits."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl import fingerprint
from asyncrl.ledger import read_events
from asyncrl.natsutil import publish_group
from asyncrl.v1 import trainer_pb2
from asyncrl.weights import uri_to_path
from services.trainer.server import TrainerCollector
from tests.fakes import trainer_env
from tests.fakes.trainer_env import EXP, _group, _spec, _wait_commits
from tests.integration.test_trainer_service import _dead_letters

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

scheduler = trainer_env.scheduler  # the recording scheduler and a trainer factory (fixtures)
start_trainer = trainer_env.start_trainer


async def _ledger_until(js, done, timeout: float = 30.0) -> list[dict]:
    """The experiment's ledger events once `done(events)` holds."""
    for _ in range(int(timeout / 0.2)):
        events = await read_events(js, EXP)
        if done(events):
            return events
        await asyncio.sleep(0.2)
    raise TimeoutError(f"ledger never settled: {events}")


def _stamped(tiny, gid: str, fp: str | None):
    """A group generated at version 1; it claims weights `fp` (None: no field)."""
    group = _group(tiny, gid, 1)
    group.fingerprints = {} if fp is None else {1: fp}
    return group


async def test_wrong_weights_quarantined_right_and_unverified_trained(
    tiny, scheduler, start_trainer, js
):
    service, stub = await start_trainer()
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=_spec(tiny[0], eta=1)),
        timeout=60,
    )
    await publish_group(js, _group(tiny, "g0", 0))
    await publish_group(js, _group(tiny, "g1", 0))
    await _wait_commits(scheduler, 1)
    v1 = scheduler.commits[0]
    written = uri_to_path(v1.uri)
    assert v1.fingerprint == fingerprint.read_manifest(written) == fingerprint.of_dir(written)
    assert v1.fingerprint.startswith("sha256:")

    await publish_group(js, _stamped(tiny, "wrong", "sha256:" + "0" * 64))
    await publish_group(js, _stamped(tiny, "right", v1.fingerprint))
    await publish_group(js, _stamped(tiny, "unverified", None))
    await _wait_commits(scheduler, 2)
    m = scheduler.commits[1].metrics
    assert (m.groups, m.quarantined) == (2, 1)
    [letter] = await _dead_letters(js, 1)
    assert letter.headers["Asyncrl-Reason"] == (
        f"weights fingerprint sha256:{'0' * 64} for version 1 is not the trainer's {v1.fingerprint}"
    )

    events = await _ledger_until(js, lambda es: sum(e["event"] == "trained" for e in es) >= 2)
    trained = [e for e in events if e["event"] == "trained"]
    assert [(e["version"], e["groups"]) for e in trained] == [
        (1, ["g0", "g1"]),
        (2, ["right", "unverified"]),
    ]
    assert trained[0]["fingerprint"] == v1.fingerprint
    # each trained sample's weights: "right" carries v1's fingerprint, "unverified" none
    assert trained[1]["fingerprints"] == [v1.fingerprint, ""]
    assert trained[1]["samples"] == {"right": [{"1": 0}] * 2, "unverified": [{"1": 1}] * 2}
    assert trained[1]["fingerprint"] == scheduler.commits[1].fingerprint != v1.fingerprint
    [quarantined] = [e for e in events if e["event"] == "quarantined"]
    assert quarantined["group"] == "wrong" and "weights fingerprint" in quarantined["reason"]
    assert service.state in ("waiting", "training")
    # g0, g1 (no fingerprints, and none recorded for the base) and "unverified": 6 samples
    assert service.samples_checked == {"verified": 2, "unverified": 6}
    [family] = [
        f
        for f in TrainerCollector(service).collect()
        if f.name == "asyncrl_trainer_samples_weights_checked"
    ]
    assert {s.labels["result"]: s.value for s in family.samples if s.name.endswith("_total")} == {
        "unverified": 6.0,
        "verified": 2.0,
    }
