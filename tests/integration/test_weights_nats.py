"""Weights through the NATS object store against a real (secure) nats-server: the trainer
uploads a version, a rollout fetches it into its cache, each connected as its own user."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.fingerprint import write_manifest
from asyncrl.natsutil import WEIGHTS_BUCKET, connect, publish_group
from asyncrl.spec import ExperimentSpec, ModelSpec, RolloutSpec, spec_to_json
from asyncrl.v1 import rollout_pb2, trainer_pb2
from asyncrl.weights_nats import (
    CHUNK_SIZE,
    CONTENT_KEY,
    LINEAGE_KEY,
    MANIFEST,
    NatsReceiver,
    WeightsFetchError,
    fetch_version,
    list_objects,
    prune_versions,
    upload_version,
    uploaded,
    version_uri,
)
from services.rollout.server import RolloutServicer
from services.rollout.service import RolloutService
from services.rollout.torch_engine import TorchEngine
from services.trainer.service import keep_versions
from tests.fakes import trainer_env
from tests.fakes.trainer_env import EXP, _group, _spec, _wait_commits

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

scheduler = trainer_env.scheduler  # the recording scheduler and a trainer factory
start_trainer = trainer_env.start_trainer


@pytest.fixture
async def trainer(nats_server):
    nc = await connect(nats_server.url, identity="trainer")
    yield nc.jetstream()
    await nc.close()


@pytest.fixture
async def rollout(nats_server):
    nc = await connect(nats_server.url, identity="rollout")
    yield nc.jetstream()
    await nc.close()


def _version_dir(root: Path, version: int, size: int = 3 * CHUNK_SIZE + 1234) -> Path:
    """A version directory: a multi-chunk safetensors-sized file, a config, an empty file."""
    d = root / f"v{version}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(os.urandom(size))
    (d / "config.json").write_text(f'{{"version": {version}}}')
    (d / "merges.txt").write_bytes(b"")
    return d


def _files(d: Path) -> dict[str, bytes]:
    """The version's files (not the cache's content key next to them)."""
    keys = (CONTENT_KEY, LINEAGE_KEY)
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name not in keys}


async def test_upload_fetch_multi_chunk_version_byte_identical(trainer, rollout, tmp_path):
    src = _version_dir(tmp_path / "store", 7)
    uri = await upload_version(trainer, src, EXP, 7)
    assert uri == version_uri(EXP, 7) == f"nats-obj://{WEIGHTS_BUCKET}/{EXP}/v000007"
    assert await uploaded(trainer, EXP, 7)
    cache = tmp_path / "cache"
    got = await fetch_version(rollout, uri, cache)
    assert got == cache / EXP / "v000007"
    assert _files(got) == _files(src)
    assert [p.name for p in (cache / EXP).iterdir()] == ["v000007"]  # no temporary left
    # a second fetch is the cached directory, even with the version gone from the bucket
    await prune_versions(trainer, EXP, keep=0)
    assert await fetch_version(rollout, uri, cache) == got


async def test_nats_receiver_fetches_nats_uris_reads_paths_in_place(trainer, rollout, tmp_path):
    """The rollout's side of the transport: a nats-obj:// version comes from the cache, a
    file:// one (or the base model's path) is read where it is."""
    src = _version_dir(tmp_path / "store", 4)
    uri = await upload_version(trainer, src, EXP, 4)
    receiver = NatsReceiver(rollout, tmp_path / "cache", retry_s=1.0)
    got = await receiver.receive(4, uri)
    assert got == tmp_path / "cache" / EXP / "v000004"
    assert _files(got) == _files(src)
    assert await receiver.receive(4, src.as_uri()) == src
    assert await receiver.receive(0, str(src)) == src


async def test_two_rollouts_of_one_host_fetch_the_same_version_at_once(trainer, rollout, tmp_path):
    """Two rollouts on one host share its cache: both fetches return the one directory (the
    second rename finds the first's and keeps it)."""
    import asyncio

    src = _version_dir(tmp_path / "store", 5)
    uri = await upload_version(trainer, src, EXP, 5)
    cache = tmp_path / "cache"
    got = await asyncio.gather(*(fetch_version(rollout, uri, cache) for _ in range(3)))
    assert got == [cache / EXP / "v000005"] * 3
    assert _files(got[0]) == _files(src)
    assert [p.name for p in (cache / EXP).iterdir()] == ["v000005"]


async def test_fetch_missing_version_raises_naming_uri(trainer, rollout, tmp_path):
    uri = version_uri(EXP, 3)
    with pytest.raises(WeightsFetchError, match="no bucket") as missing_bucket:
        await fetch_version(rollout, uri, tmp_path)
    assert missing_bucket.value.uri == uri and uri in str(missing_bucket.value)
    await upload_version(trainer, _version_dir(tmp_path / "store", 2), EXP, 2)
    with pytest.raises(WeightsFetchError, match="no such version") as missing:
        await fetch_version(rollout, uri, tmp_path / "cache")
    assert uri in str(missing.value)
    assert not (tmp_path / "cache" / EXP / "v000003").exists()


async def test_fetch_missing_file_raises_and_leaves_nothing(trainer, rollout, js, tmp_path):
    uri = await upload_version(trainer, _version_dir(tmp_path / "store", 1), EXP, 1)
    obs = await js.object_store(WEIGHTS_BUCKET)
    await obs.delete(f"{EXP}/v000001/config.json")
    with pytest.raises(WeightsFetchError, match="config.json is missing") as missing:
        await fetch_version(rollout, uri, tmp_path / "cache")
    assert missing.value.uri == uri
    assert list((tmp_path / "cache" / EXP).iterdir()) == []


async def test_fetch_corrupted_chunk_raises_digest_mismatch(trainer, rollout, js, tmp_path):
    """A chunk stored with other bytes of the same length (bit rot, a bad copy): the object's
    info no longer matches what is read."""
    uri = await upload_version(trainer, _version_dir(tmp_path / "store", 1), EXP, 1)
    obs = await js.object_store(WEIGHTS_BUCKET)
    info = await obs.get_info(f"{EXP}/v000001/model.safetensors")
    subject = f"$O.{WEIGHTS_BUCKET}.C.{info.nuid}"
    first = await js.get_msg(f"OBJ_{WEIGHTS_BUCKET}", subject=subject, next=True, seq=1)
    await js.delete_msg(f"OBJ_{WEIGHTS_BUCKET}", first.seq)
    await js.publish(subject, bytes(len(first.data)))  # same size, now the last chunk
    with pytest.raises(WeightsFetchError, match="model.safetensors: .* digest") as corrupt:
        await fetch_version(rollout, uri, tmp_path / "cache")
    assert corrupt.value.uri == uri
    assert list((tmp_path / "cache" / EXP).iterdir()) == []


async def test_prune_keeps_newest_versions_in_bucket_and_cache(trainer, rollout, tmp_path):
    for v in range(1, 6):
        await upload_version(trainer, _version_dir(tmp_path / "store", v, size=1000), EXP, v)
    await upload_version(trainer, _version_dir(tmp_path / "other", 1, size=10), "exp2", 1)
    await prune_versions(trainer, EXP, keep=2)
    assert [await uploaded(trainer, EXP, v) for v in range(1, 6)] == [False] * 3 + [True] * 2
    assert await uploaded(trainer, "exp2", 1)  # another experiment's versions are its own
    names = {i.name for i in await list_objects(trainer)}
    assert {n.rsplit("/", 1)[0] for n in names} == {
        f"{EXP}/v000004",
        f"{EXP}/v000005",
        "exp2/v000001",
    }
    assert f"{EXP}/v000005/{MANIFEST}" in names
    with pytest.raises(WeightsFetchError, match="no such version"):
        await fetch_version(rollout, version_uri(EXP, 3), tmp_path / "cache")
    cache = tmp_path / "cache"
    for v in (4, 5):
        await fetch_version(rollout, version_uri(EXP, v), cache, keep=1)
    assert [p.name for p in (cache / EXP).iterdir()] == ["v000005"]


async def test_prune_newest_deletes_the_abandoned_lineage_from_the_bucket(trainer, tmp_path):
    """A trainer resumed at v2 after v6 uploads v2, then v3: the bucket keeps those, not the
    abandoned v4..v6 that are newer by name (issue 23 point 9)."""
    for v in (1, 2, 3, 4, 5, 6):
        await upload_version(trainer, _version_dir(tmp_path / "old", v, size=100), EXP, v)
    await prune_versions(trainer, EXP, keep=3, newest=2)
    assert [await uploaded(trainer, EXP, v) for v in range(1, 7)] == [True] * 2 + [False] * 4
    await upload_version(trainer, _version_dir(tmp_path / "new", 3, size=100), EXP, 3)
    await prune_versions(trainer, EXP, keep=2, newest=3)
    assert [await uploaded(trainer, EXP, v) for v in range(1, 7)] == [False, True, True] + [
        False
    ] * 3


async def test_fetch_after_a_rewind_keeps_the_older_version_it_fetched(trainer, rollout, tmp_path):
    """A trainer resumed from a checkpoint sends the fleet back to an older version than the
    cache's newest: pruning must not delete the version it just fetched (it did: every rollout
    failed its UpdateWeights with 'no config.json' in make multihost's nats fault)."""
    cache = tmp_path / "cache"
    for v in (3, 4, 5, 2):
        await upload_version(trainer, _version_dir(tmp_path / "store", v, size=100), EXP, v)
    for v in (3, 4, 5):
        await fetch_version(rollout, version_uri(EXP, v), cache, keep=3)
    got = await fetch_version(rollout, version_uri(EXP, 2), cache, keep=3)
    assert (got / "config.json").is_file()
    assert sorted(p.name for p in (cache / EXP).iterdir())[0] == "v000002"


async def test_trainer_publishes_nats_versions_rollout_loads_one(
    tiny, js, scheduler, start_trainer, rollout, tmp_path
):
    """`trainer.weight_sync: nats` end to end: each committed URI is a `nats-obj://` one,
    the bucket keeps what the weight store keeps, and a rollout that never sees the trainer's
    filesystem loads a version from its own cache, byte for byte what the trainer wrote."""
    service, stub = await start_trainer()
    spec = _spec(tiny[0], weight_sync="nats")
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=spec), timeout=60
    )
    for version in range(4):  # eta 0: each step's groups start at the version before it
        for i in range(2):
            await publish_group(js, _group(tiny, f"g{version}-{i}", version))
        await _wait_commits(scheduler, version + 1)
    assert [c.uri for c in scheduler.commits] == [version_uri(EXP, v) for v in range(1, 5)]
    kept = keep_versions(0)
    stored = sorted(p.name for p in (tmp_path / "weights" / EXP).iterdir())
    in_bucket = sorted({i.name.split("/")[1] for i in await list_objects(js)})
    assert in_bucket == stored == [f"v{v:06d}" for v in range(5 - kept, 5)]

    engine = TorchEngine(seed=0)
    await engine.start()
    cache = tmp_path / "rollout-host" / "weights-cache"
    servicer = RolloutServicer(RolloutService(engine, rollout, weights_cache=cache))
    spec = ExperimentSpec(
        model=ModelSpec(path=str(tiny[0])),
        dataset={"path": "unused.jsonl"},
        rollout=RolloutSpec(n_samples=2, engine="torch"),
    )
    try:
        await servicer.service.bind(EXP, spec_to_json(spec))
        req = rollout_pb2.UpdateWeightsRequest(experiment_id=EXP, version=0, uri=str(tiny[0]))
        await servicer.UpdateWeights(req, None)  # the base model: every host has it
        req.version, req.uri = 4, scheduler.commits[-1].uri
        updated = await servicer.UpdateWeights(req, None)
        with pytest.raises(WeightsFetchError, match="no such version"):
            await servicer.service.update_weights(EXP, 1, scheduler.commits[0].uri)  # pruned
    finally:
        await engine.stop()
    assert updated.version == 4 == engine.version
    assert updated.read_s > 0 and updated.load_s > 0  # read_s: the fetch and the read
    assert _files(cache / EXP / "v000004") == _files(tmp_path / "weights" / EXP / "v000004")


async def test_resumed_trainer_uploads_its_version_again_when_bucket_lost_it(
    tiny, js, scheduler, start_trainer, rollout, tmp_path, monkeypatch
):
    """The bucket is not the trainer's state: a trainer resuming at a version the bucket no
    longer holds (a NATS store lost, a bucket purged) uploads it again from its weight store,
    and StartExperiment answers with its `nats-obj://` URI. (Chosen by the deprecated
    ASYNCRL_WEIGHTS_TRANSPORT=nats: the alias still works.)"""
    monkeypatch.setenv("ASYNCRL_WEIGHTS_TRANSPORT", "nats")
    service, stub = await start_trainer()
    start = trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=_spec(tiny[0]))
    await stub.StartExperiment(start, timeout=60)
    for i in range(2):
        await publish_group(js, _group(tiny, f"g{i}", 0))
    await _wait_commits(scheduler, 1)
    await service.stop_experiment(EXP)  # a final checkpoint at version 1
    await js.purge_stream(f"OBJ_{WEIGHTS_BUCKET}")
    assert not await uploaded(js, EXP, 1)

    _, stub2 = await start_trainer()
    resp = await stub2.StartExperiment(start, timeout=60)
    assert (resp.version, resp.resumed, resp.uri) == (1, True, version_uri(EXP, 1))
    got = await fetch_version(rollout, resp.uri, tmp_path / "cache")
    assert _files(got) == _files(tmp_path / "weights" / EXP / "v000001")


async def test_fetch_after_a_rewind_republished_the_version_gets_its_new_bytes(
    trainer, rollout, tmp_path
):
    """A trainer resumed from an older checkpoint publishes version 3 again with other weights
    of the same sizes: a rollout that cached the old lineage's v3 must load the new bytes (it
    kept serving the cached old ones), and fetching the same content again is a cache hit."""
    cache = tmp_path / "cache"
    old = _version_dir(tmp_path / "old", 3)
    uri = await upload_version(trainer, old, EXP, 3)
    assert _files(await fetch_version(rollout, uri, cache)) == _files(old)
    new = _version_dir(tmp_path / "new", 3)  # same names and sizes, other bytes
    assert uri == await upload_version(trainer, new, EXP, 3)
    got = await fetch_version(rollout, uri, cache)
    assert got == cache / EXP / "v000003"
    assert _files(got) == _files(new) != _files(old)
    assert [p.name for p in (cache / EXP).iterdir()] == ["v000003"]  # nothing stale left
    inode = (got / "model.safetensors").stat().st_ino
    assert (await fetch_version(rollout, uri, cache) / "model.safetensors").stat().st_ino == inode


async def test_cached_copy_of_an_abandoned_lineage_is_not_served_after_a_rewind(
    trainer, rollout, tmp_path
):
    """A rollout cached lineage A's v6; the trainer rewound, and the bucket no longer has v6
    (pruned before lineage B's v6 is up). Asked for v6 with B's fingerprint, the fetch fails
    and drops A's copy, where it served A's bytes as B's v6; asked with A's own fingerprint (or
    none: unknown), the copy is served as before."""
    src = _version_dir(tmp_path / "store", 6)
    write_manifest(src, 6, "sha256:" + "a" * 64)
    uri = await upload_version(trainer, src, EXP, 6)
    cache = tmp_path / "cache"
    got = await fetch_version(rollout, uri, cache, fingerprint="sha256:" + "a" * 64)
    await prune_versions(trainer, EXP, keep=1, newest=5)  # resumed at v5: v6 is abandoned
    assert not await uploaded(trainer, EXP, 6)
    assert await fetch_version(rollout, uri, cache, fingerprint="sha256:" + "a" * 64) == got
    assert await fetch_version(rollout, uri, cache) == got  # unknown: unverified, served
    with pytest.raises(WeightsFetchError, match="another lineage") as e:
        await fetch_version(rollout, uri, cache, fingerprint="sha256:" + "b" * 64)
    assert e.value.uri == uri and "sha256:" + "a" * 64 in e.value.reason
    assert not got.exists()  # dropped: a reload reads the bucket, never this copy again
    receiver = NatsReceiver(rollout, cache, retry_s=1.0)
    with pytest.raises(WeightsFetchError, match="no such version"):
        await receiver.receive(6, uri, "sha256:" + "b" * 64)
