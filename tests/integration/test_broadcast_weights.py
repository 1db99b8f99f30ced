"""`trainer.weight_sync: broadcast` on one host: a real torch trainer backend trains a step of
the tiny model, `BroadcastSender` streams the version in buckets to two real torch engines
(each with its `BroadcastReceiver`, as a rollout's Serving drives it) while they generate, and
writes the weight store's copy from the same snapshot; over gloo on loopback (`via` gloo:
ASYNCRL_BROADCAST_SHM=0, as between hosts) or through the trainer's files in /dev/shm (`via`
shm, the same-host default: `asyncrl.shm`). Every rank lives in this process (groups of
their own, `asyncrl.collective.own_group`); each rank's blocking calls run in threads, as in
the services."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl import fingerprint
from asyncrl.net import free_port
from asyncrl.settings import settings
from asyncrl.spec import ExperimentSpec, SamplingParams
from services.rollout.broadcast_receiver import BroadcastReceiver, Mismatch
from services.rollout.engine import GenRequest
from services.rollout.torch_engine import TorchEngine
from services.trainer.backends.torch_backend import TorchBackend
from services.trainer.broadcast import BroadcastSender
from services.trainer.transport import DiskSender, Store
from tests.fakes.trainer_env import EXP, _group

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=200)


@pytest.fixture(params=["gloo", "shm"])
def via(request, monkeypatch) -> str:
    """How the versions go: over the socket (gloo) or through shared memory (shm)."""
    monkeypatch.setenv("ASYNCRL_BROADCAST_SHM", "1" if request.param == "shm" else "0")
    return request.param


@pytest.fixture
def gloo(monkeypatch) -> None:
    """Over the socket: a delta is for links slower than memory (what goes by shm is whole)."""
    monkeypatch.setenv("ASYNCRL_BROADCAST_SHM", "0")


def _spec(tiny_dir, port: int) -> ExperimentSpec:
    return ExperimentSpec(
        model={"path": str(tiny_dir)},
        dataset={"path": "unused.jsonl"},
        trainer={
            "backend": "torch",
            "lr": 1e-2,
            "weight_sync": "broadcast",
            "nccl_master": f"127.0.0.1:{port}",
            "broadcast_bucket_mb": 1,
        },
    )


class Log:
    """The sender's structured log, kept: (event, fields) per line."""

    def __init__(self):
        self.lines: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.lines.append((event, fields))

    warning = info

    def sent(self) -> list[dict]:
        return [f for e, f in self.lines if e == "broadcast_sent"]


async def _setup(tiny, tmp_path, **trainer):
    spec = _spec(tiny[0], free_port())
    spec.trainer = spec.trainer.model_copy(update=trainer)
    backend = TorchBackend(spec, device="cpu")
    backend.load(str(tiny[0]))
    store = Store(root=tmp_path / "w", experiment_id=EXP, tokenizer_dir=tiny[0], keep=4)
    sender = BroadcastSender(DiskSender(store), spec.trainer, Log(), 10.0)
    engines = [TorchEngine(device="cpu", seed=i) for i in range(2)]
    for e in engines:
        await e.start()
        await e.load(str(tiny[0]), 0)
    return spec, backend, sender, engines


async def _version(
    tiny, spec, backend, sender, receivers, engines, version: int, started=(), step=None
):
    """Train a step (or `step(backend)`), publish, and (beside the commit) have each engine
    receive and apply it: what the engines answered (the number of requests moved, or the
    exception). `started`: called once the step is trained (requests to run during the
    update)."""
    if step is None:
        await asyncio.to_thread(backend.train_step, [_group(tiny, f"g{version}", version - 1)])
    else:
        step(backend)
    snap = await asyncio.to_thread(sender.snapshot, backend)
    for start in started:
        start()
    uri = await sender.publish(version, snap)
    master = spec.trainer.nccl_master or sender.store_address  # what CommitWeights carries

    async def one(rank, receiver, engine):
        got = await asyncio.to_thread(
            receiver.receive, EXP, master, version, rank, len(engines), 10.0
        )
        return await engine.apply_state(uri, version, got.state, got.fingerprint, got.seconds)

    async def commit():
        return await asyncio.gather(
            *(one(r, rc, e) for r, (rc, e) in enumerate(zip(receivers, engines, strict=False), 1)),
            return_exceptions=True,
        )

    return await sender.send(version, commit())


def _trained(backend) -> dict[str, torch.Tensor]:
    state, _ = backend.hf_state()
    return {k: v.clone() for k, v in state.items()}


def _held(engine) -> dict[str, torch.Tensor]:
    return engine.model.state_dict()


async def test_two_engines_take_streamed_versions_mid_decode_and_the_store_gets_the_same(
    tiny, tmp_path, via
):
    spec, backend, sender, engines = await _setup(tiny, tmp_path)
    receivers = [BroadcastReceiver() for _ in engines]
    prompt = tiny[2]("1+2=")["input_ids"]
    running = []

    def start():
        for i, e in enumerate(engines):
            running.append(asyncio.ensure_future(e.generate(GenRequest(f"r{i}", prompt, PARAMS))))

    try:
        for version in (1, 2):
            starts = [start] if version == 1 else []
            moved = await _version(tiny, spec, backend, sender, receivers, engines, version, starts)
            want, fp = _trained(backend), sender.fingerprint(version)
            assert fp.startswith("xxh3/b1048576:")
            for engine in engines:
                assert engine.version == version and engine.fingerprint == fp
                held = _held(engine)
                for name, tensor in want.items():
                    assert torch.equal(held[name], tensor), name
            stored = sender.files.store.dir(version)
            assert fingerprint.read_manifest(stored) == fp
            assert fingerprint.of_dir(stored) == fp  # recomputed from the files
            assert sender.last["bytes"] == sum(t.numel() * 4 for t in want.values())
            assert moved is not None
            assert sender.log.sent()[-1]["via"] == via
        assert receivers[0].group_name == receivers[1].group_name == sender.group_name
        assert bool(sender.group_name) == (via == "gloo")  # shm: no group needed
        for engine, receiver in zip(engines, receivers, strict=True):  # served in place
            ptr = engine.model.get_input_embeddings().weight.data_ptr()
            newest = receiver.staging.newest
            assert any(buf.data_ptr() <= ptr < buf.data_ptr() + buf.numel() for buf in newest)
        outs = await asyncio.gather(*running)
        for out in outs:  # started under v0, went on under the streamed version(s)
            assert out.versions[0] == 0 and out.interruptions >= 1 and out.versions[-1] >= 1
    finally:
        await sender.close()
        for e in engines:
            await e.stop()


async def test_sender_without_nccl_master_hosts_its_store_on_an_os_given_port(tiny, tmp_path):
    """No `trainer.nccl_master`: the store is hosted on the advertised host at a port the OS
    gives (a second sender on the host gets another), its address reported for CommitWeights,
    and the engines receive the version meeting there."""
    spec, backend, sender, engines = await _setup(tiny, tmp_path, nccl_master=None)
    receivers = [BroadcastReceiver() for _ in engines]
    other_store = Store(root=tmp_path / "w2", experiment_id=EXP, tokenizer_dir=tiny[0], keep=4)
    other = BroadcastSender(DiskSender(other_store), spec.trainer, Log(), 10.0)
    try:
        assert sender.store_address == ""  # hosted at the first snapshot, not before
        moved = await _version(tiny, spec, backend, sender, receivers, engines, 1)
        host, port = sender.store_address.rsplit(":", 1)
        assert host == settings().advertise_host and 0 < int(port) < 65536
        assert ("broadcast_store_hosted", {"address": sender.store_address}) in sender.log.lines
        assert not any(isinstance(m, BaseException) for m in moved)
        for engine in engines:
            assert engine.version == 1 and engine.fingerprint == sender.fingerprint(1)
        assert [f["rollouts"] for f in sender.log.sent()] == [2]
        await asyncio.to_thread(other.snapshot, backend)
        assert other.store_address.rsplit(":", 1)[0] == host
        assert other.store_address != sender.store_address
    finally:
        await other.close()
        await sender.close()
        for e in engines:
            await e.stop()


async def test_a_flipped_bit_in_one_bucket_is_refused_and_nothing_is_applied(tiny, tmp_path, via):
    spec, backend, sender, engines = await _setup(tiny, tmp_path)
    receivers = [BroadcastReceiver() for _ in engines]
    before = {k: v.clone() for k, v in _held(engines[1]).items()}

    def flip(i: int, buf: torch.Tensor) -> None:
        if i == 0:
            buf[17] ^= 1 << 3

    receivers[1].corrupt = flip
    try:
        moved = await _version(tiny, spec, backend, sender, receivers, engines, 1)
        assert isinstance(moved[1], Mismatch) and "bucket(s) [0]" in str(moved[1])
        assert engines[1].version == 0 and engines[1].fingerprint != sender.fingerprint(1)
        for name, tensor in _held(engines[1]).items():
            assert torch.equal(tensor, before[name]), name  # the live weights untouched
        assert not isinstance(moved[0], BaseException)
        assert engines[0].version == 1 and engines[0].fingerprint == sender.fingerprint(1)
    finally:
        await sender.close()
        for e in engines:
            await e.stop()


def _nudge(name: str):
    """A sparse step: every 50th element of parameter `name` changes (the rest stays)."""

    def step(backend) -> None:
        with torch.no_grad():
            backend.model.state_dict()[name].view(-1)[::50] += 0.25

    return step


def _assert_holds(engine, backend, fp: str) -> None:
    assert engine.fingerprint == fp
    held = _held(engine)
    for name, tensor in _trained(backend).items():
        assert torch.equal(held[name], tensor), name


async def test_versions_travel_as_deltas_with_a_full_one_every_k(tiny, tmp_path, gloo):
    spec, backend, sender, engines = await _setup(tiny, tmp_path, broadcast_full_every=3)
    receivers = [BroadcastReceiver() for _ in engines]
    last = sorted(_trained(backend))[-1]
    try:
        for version in range(1, 6):
            step = _nudge(last) if version > 1 else None  # v1: a real step, no base yet
            moved = await _version(
                tiny, spec, backend, sender, receivers, engines, version, (), step
            )
            assert not any(isinstance(m, BaseException) for m in moved), moved
            for engine in engines:
                assert engine.version == version
                _assert_holds(engine, backend, sender.fingerprint(version))
        sent = sender.log.sent()
        assert [s["mode"] for s in sent] == ["full", "delta", "delta", "full", "delta"]
        for s in sent:
            if s["mode"] == "delta":
                assert s["sent_bytes"] < s["full_bytes"] / 10 and 0 < s["changed"] < 0.02
            else:
                assert s["sent_bytes"] == s["full_bytes"] >= sender.last["bytes"]
        assert receivers[0].held == receivers[1].held == sender.fingerprint(5)
        assert sender.moved(5) == (sent[-1]["sent_bytes"], sent[-1]["full_bytes"])
    finally:
        await sender.close()
        for e in engines:
            await e.stop()


async def test_a_delta_onto_a_base_that_differs_is_refused_and_the_next_goes_whole(
    tiny, tmp_path, gloo
):
    spec, backend, sender, engines = await _setup(tiny, tmp_path, broadcast_full_every=8)
    receivers = [BroadcastReceiver() for _ in engines]
    last = sorted(_trained(backend))[-1]
    try:
        await _version(tiny, spec, backend, sender, receivers, engines, 1)
        newest = receivers[1].staging.newest[0]  # bucket 0 starts with the first tensor
        newest[1] ^= 1 << 2  # the base differs where v2 changes nothing; it still says v1
        v1 = {k: v.clone() for k, v in _held(engines[1]).items()}  # served from that set
        assert receivers[1].held == sender.fingerprint(1)
        moved = await _version(tiny, spec, backend, sender, receivers, engines, 2, (), _nudge(last))
        assert sender.log.sent()[-1]["mode"] == "delta"
        assert isinstance(moved[1], Mismatch) and "bucket(s) [0]" in str(moved[1])
        assert engines[1].version == 1 and receivers[1].held == ""
        for name, tensor in _held(engines[1]).items():
            assert torch.equal(tensor, v1[name]), name  # nothing applied
        assert engines[0].version == 2
        _assert_holds(engines[0], backend, sender.fingerprint(2))
        moved = await _version(tiny, spec, backend, sender, receivers, engines, 3, (), _nudge(last))
        assert sender.log.sent()[-1]["mode"] == "full"  # one rollout holds no base
        for engine in engines:
            assert engine.version == 3
            _assert_holds(engine, backend, sender.fingerprint(3))
    finally:
        await sender.close()
        for e in engines:
            await e.stop()
