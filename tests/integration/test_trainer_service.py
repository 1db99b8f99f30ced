"""The trainer service against a real nats-server, a real trainer gRPC server on port 0 and a
tiny real model (torch backend). The scheduler side is a small recording servicer: these tests
check the trainer's own logic (batching, staleness drops, weight commits, checkpoint/resume)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.convert import group_to_bytes
from asyncrl.grpcutil import channel
from asyncrl.natsutil import (
    STREAM,
    dead_subject,
    ensure_stream,
    publish_group,
    train_subject,
    wait_until,
)
from asyncrl.net import free_port
from asyncrl.types import TrajectoryGroup
from asyncrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from asyncrl.weights import uri_to_path
from services.trainer.checkpoint import checkpoint_root, latest_checkpoint
from services.trainer.consumer import durable_name
from tests.fakes import trainer_env
from tests.fakes.trainer_env import (
    EXP,
    _group,
    _spec,
    _status,
    _wait_acked,
    _wait_commits,
)

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

scheduler = trainer_env.scheduler  # the recording scheduler and a trainer factory (fixtures)
start_trainer = trainer_env.start_trainer


async def test_trainer_b_groups_one_step_commits_version_1_loadable_weights(
    tiny, scheduler, start_trainer, js
):
    service, stub = await start_trainer()
    resp = await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=_spec(tiny[0])), timeout=60
    )
    assert (resp.version, resp.resumed) == (0, False)
    again = await stub.StartExperiment(  # idempotent for the running experiment
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=_spec(tiny[0])), timeout=60
    )
    assert (again.version, again.resumed) == (0, False)
    assert scheduler.workers[0].kind == common_pb2.WORKER_KIND_TRAINER

    await publish_group(js, _group(tiny, "g0", 0))
    await _wait_acked(js, 1)  # the trainer holds g0: one group < B, so it waits for more
    assert (await _status(stub)).state == "waiting"
    assert scheduler.commits == []
    await publish_group(js, _group(tiny, "g1", 0))
    await _wait_commits(scheduler, 1)

    commit = scheduler.commits[0]
    assert (commit.experiment_id, commit.version, commit.trainer_id) == (EXP, 1, "trainer-1")
    assert (commit.metrics.step, commit.metrics.groups, commit.metrics.stale_dropped) == (1, 2, 0)
    assert commit.metrics.reward_mean == pytest.approx(0.5)
    assert commit.metrics.accuracy == pytest.approx(0.5)
    weights = uri_to_path(commit.uri)
    assert weights.name == "v000001"
    trained = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    AutoTokenizer.from_pretrained(weights)
    base = tiny[1].state_dict()
    assert any(not torch.equal(v, base[k]) for k, v in trained.state_dict().items())

    st = await _status(stub)
    assert (st.version, st.step, st.backend, st.experiment_id) == (1, 1, "torch", EXP)
    assert st.last_step.version == 1
    await wait_until(lambda: service.state == "waiting")


async def test_trainer_group_staler_than_eta_is_dropped_acked_not_trained(
    tiny, scheduler, start_trainer, js
):
    service, stub = await start_trainer()
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=_spec(tiny[0], eta=0)),
        timeout=60,
    )
    # step 1 trains g0, g1 at v0; then at v1 "old" (started at v0) has staleness 1 > eta 0
    for gid, v in [("g0", 0), ("g1", 0), ("old", 0), ("g2", 1), ("g3", 1)]:
        await publish_group(js, _group(tiny, gid, v))
    await _wait_commits(scheduler, 2)

    assert [
        (d.group_id, d.prompt_id, d.start_version, d.trainer_version) for d in scheduler.dropped
    ] == [("old", "p-old", 0, 1)]
    assert scheduler.dropped[0].reason == "staleness 1 > eta 0"
    m = scheduler.commits[1].metrics
    assert (m.version, m.groups, m.stale_dropped, m.staleness_max) == (2, 2, 1, 0)
    assert [c.metrics.groups for c in scheduler.commits] == [2, 2]  # all but "old" trained
    info = await js.consumer_info(STREAM, durable_name(EXP))
    assert (info.num_pending, info.num_ack_pending) == (0, 0)  # the stale one was acked too


async def test_trainer_crash_restart_resumes_checkpoint_and_retrains_only_later_groups(
    tiny, scheduler, start_trainer, js, tmp_path
):
    service, stub = await start_trainer()
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(
            experiment_id=EXP, spec_json=_spec(tiny[0], eta=2, checkpoint_every=2)
        ),
        timeout=60,
    )
    for i in range(6):
        await publish_group(js, _group(tiny, f"g{i}", 0))
    await _wait_commits(scheduler, 3)
    await wait_until(lambda: service.state == "waiting")
    await service.close(checkpoint=False)  # a crash: step 3 (g4, g5) is not checkpointed

    service2, stub2 = await start_trainer()
    resp = await stub2.StartExperiment(
        trainer_pb2.StartExperimentRequest(
            experiment_id=EXP, spec_json=_spec(tiny[0], eta=2, checkpoint_every=2)
        ),
        timeout=60,
    )
    assert (resp.version, resp.resumed) == (2, True)
    assert uri_to_path(resp.uri) == tmp_path / "weights" / EXP / "v000002"
    assert (uri_to_path(resp.uri) / "model.safetensors").is_file()
    await _wait_commits(scheduler, 4)
    assert [c.version for c in scheduler.commits] == [1, 2, 3, 3]
    assert scheduler.commits[3].metrics.groups == 2
    # the resumed consumer delivered g4 and g5 only (stream seqs 5, 6), once each, and holds
    # nothing more: g0..g3 are not trained twice
    info = await _wait_acked(js, 6)
    assert (info.delivered.consumer_seq, info.delivered.stream_seq) == (2, 6)
    assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)

    ck = await stub2.CheckpointNow(trainer_pb2.CheckpointNowRequest(experiment_id=EXP), timeout=30)
    assert (Path(ck.path).name, ck.step) == ("step_000003", 3)
    await stub2.StopExperiment(trainer_pb2.StopExperimentRequest(experiment_id=EXP), timeout=30)
    st = await _status(stub2)
    assert (st.state, st.version) == ("stopped", 3)


async def test_trainer_commit_says_stop_final_checkpoint_and_stopped(
    tiny, scheduler, start_trainer, js
):
    scheduler.stop_at_version = 1
    service, stub = await start_trainer()
    await stub.StartExperiment(  # version 1 is the last: its commit is answered before more
        trainer_pb2.StartExperimentRequest(
            experiment_id=EXP, spec_json=_spec(tiny[0], checkpoint_every=5, total_steps=1)
        ),
        timeout=60,
    )
    for i in range(4):
        await publish_group(js, _group(tiny, f"g{i}", 0))
    await wait_until(lambda: service.state == "stopped", timeout=30)
    assert [c.version for c in scheduler.commits] == [1]
    root = service.var_dir / "checkpoints" / EXP
    ckpts = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_000001"]


async def test_trainer_backend_error_marks_failed_with_message(tiny, scheduler, start_trainer, js):
    service, stub = await start_trainer()
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=_spec(tiny[0])), timeout=60
    )

    def broken_step(groups):
        raise RuntimeError("loss is nan")

    service.backend.train_step = broken_step
    await publish_group(js, _group(tiny, "g0", 0))
    await publish_group(js, _group(tiny, "g1", 0))
    await wait_until(lambda: service.state == "failed", timeout=30)
    st = await _status(stub)
    assert st.state == "failed"
    assert st.message == "training: RuntimeError: loss is nan"
    assert scheduler.commits == []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CheckpointNow(trainer_pb2.CheckpointNowRequest(experiment_id=EXP), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_trainer_commit_rejected_failed_names_commit_and_keeps_heartbeating(
    tiny, scheduler, start_trainer, js
):
    scheduler.commit_error = (grpc.StatusCode.FAILED_PRECONDITION, "trainer-1 is not bound")
    service, stub = await start_trainer()
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=_spec(tiny[0])), timeout=60
    )
    await publish_group(js, _group(tiny, "g0", 0))
    await publish_group(js, _group(tiny, "g1", 0))
    await wait_until(lambda: service.state == "failed", timeout=30)
    st = await _status(stub)
    assert (st.state, st.version) == ("failed", 1)
    assert st.message == "commit: AioRpcError: FAILED_PRECONDITION: trainer-1 is not bound"
    beats = scheduler.heartbeats
    await wait_until(lambda: scheduler.heartbeats > beats, timeout=10)  # still answers for itself


async def test_trainer_model_fails_to_load_failed_names_load(tiny, start_trainer, tmp_path):
    _, stub = await start_trainer()
    no_weights = tmp_path / "config-only"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny[0] / "config.json").read_text())
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.StartExperiment(
            trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=_spec(no_weights)),
            timeout=60,
        )
    st = await _status(stub)
    assert st.state == "failed"
    assert st.message.startswith("load: OSError: ")


async def _orphan_pull_request(nc, service, batch: int) -> None:
    """A pull request for more than the trainer's steps ask for, delivering to the trainer's
    inbox (as one the consumer made for an earlier, larger pull): the consumer takes all it
    brings, however few messages the pull asked for."""
    consumer = service._consumer
    request = {"batch": batch, "expires": 20_000_000_000}
    await nc.publish(consumer._next_subject, json.dumps(request).encode(), reply=consumer._inbox)
    await nc.flush()


async def test_trainer_fetch_returns_more_than_asked_each_step_trains_exactly_b(
    tiny, scheduler, start_trainer, js, nc
):
    service, stub = await start_trainer()
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=_spec(tiny[0], eta=3)),
        timeout=60,
    )
    await _orphan_pull_request(nc, service, batch=10)
    ids = [f"g{i}" for i in range(6)]
    for gid in ids:
        await publish_group(js, _group(tiny, gid, 0))
    await wait_until(lambda: sum(c.metrics.groups for c in scheduler.commits) >= 6, timeout=60)
    assert [c.metrics.groups for c in scheduler.commits] == [2, 2, 2]
    await wait_until(lambda: service.state == "waiting")
    _, state = latest_checkpoint(checkpoint_root(service.var_dir, EXP))
    assert (state.step, state.last_seq, state.trained_ids) == (3, 6, tuple(ids))


async def _dead_letters(js, n: int) -> list:
    sub = await js.subscribe(dead_subject(EXP), stream=STREAM, ordered_consumer=True)
    try:
        return [await sub.next_msg(timeout=10) for _ in range(n)]
    finally:
        await sub.unsubscribe()


def _bad_groups(tiny) -> list[tuple[str, bytes]]:
    """(reason prefix, payload) of messages the trainer must not train."""
    vocab = json.loads((tiny[0] / "config.json").read_text())["vocab_size"]
    foreign = _group(tiny, "foreign", 0)
    foreign.experiment_id = "another-experiment"
    short = _group(tiny, "short", 0)
    short.samples[1].logprobs = short.samples[1].logprobs[:-1]
    past_vocab = _group(tiny, "past-vocab", 0)
    past_vocab.samples[0].output_ids[-1] = vocab
    future = _group(tiny, "future", 0)
    future.samples[0].versions[-1] = 5
    empty = _group(tiny, "empty", 0)
    empty.samples = []
    return [
        ("undecodable: DecodeError", b"\xff\xff garbage, not a TrajectoryGroup"),
        ("experiment 'another-experiment' is not 'exp-trainer'", group_to_bytes(foreign)),
        ("sample 1: ", group_to_bytes(short)),
        (f"sample 0 output_ids: token id {vocab} outside", group_to_bytes(past_vocab)),
        ("sample 0: version 5 outside [0, trainer version 0]", group_to_bytes(future)),
        ("no samples", group_to_bytes(empty)),
    ]


async def test_trainer_bad_messages_quarantined_to_dead_letters_training_goes_on(
    tiny, scheduler, start_trainer, js
):
    service, stub = await start_trainer()
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=_spec(tiny[0])), timeout=60
    )
    bad = _bad_groups(tiny)
    seqs = [
        (await js.publish(train_subject(EXP), payload, headers={"Nats-Msg-Id": f"bad-{i}"})).seq
        for i, (_, payload) in enumerate(bad)
    ]
    await publish_group(js, _group(tiny, "g0", 0))
    await publish_group(js, _group(tiny, "g1", 0))
    await _wait_commits(scheduler, 1)

    m = scheduler.commits[0].metrics
    assert (m.groups, m.quarantined, m.stale_dropped, m.replayed) == (2, len(bad), 0, 0)
    assert (await _status(stub)).state in ("waiting", "training")
    assert scheduler.dropped == []
    letters = await _dead_letters(js, len(bad))
    for (reason, payload), msg, seq in zip(bad, letters, seqs, strict=True):
        assert msg.headers["Asyncrl-Reason"].startswith(reason)
        assert (msg.headers["Asyncrl-Stream-Seq"], msg.data) == (str(seq), payload)


async def test_ensure_stream_made_before_dead_letters_gains_their_subject(js):
    await js.delete_stream(STREAM)
    await js.add_stream(name=STREAM, subjects=["asyncrl.traj.>"], duplicate_window=3600)
    await ensure_stream(js)
    info = await js.stream_info(STREAM)
    assert info.config.subjects == ["asyncrl.traj.>", "asyncrl.dead.>"]
    ack = await js.publish(dead_subject(EXP), b"x")
    assert ack.stream == STREAM


async def _replay(js, group: TrajectoryGroup, copy: int) -> None:
    """The same group again under another message id (past the dedup window, re-published)."""
    headers = {"Nats-Msg-Id": f"{group.group_id}-copy-{copy}"}
    await js.publish(train_subject(EXP), group_to_bytes(group), headers=headers)


async def test_trainer_replayed_group_across_restart_never_trained_twice_nor_reported(
    tiny, scheduler, start_trainer, js
):
    spec = _spec(tiny[0], eta=1)
    groups = {gid: _group(tiny, gid, v) for gid, v in [("g0", 0), ("g1", 0), ("g2", 1)]}
    service, stub = await start_trainer()
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=spec), timeout=60
    )
    for gid in ("g0", "g1"):
        await publish_group(js, groups[gid])
    await _wait_commits(scheduler, 1)
    await _replay(js, groups["g0"], 1)  # staleness 1 <= eta at v1: trainable, but trained
    await publish_group(js, groups["g2"])
    await publish_group(js, _group(tiny, "g3", 1))
    await _wait_commits(scheduler, 2)
    await wait_until(lambda: service.state == "waiting")
    await service.close(checkpoint=False)  # a crash after step 2's checkpoint

    service2, stub2 = await start_trainer()
    resp = await stub2.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=spec), timeout=60
    )
    assert (resp.version, resp.resumed) == (2, True)
    await _replay(js, groups["g1"], 1)  # staleness 2 > eta: too stale, but trained: silent
    await _replay(js, groups["g2"], 1)
    for gid in ("g4", "g5"):
        await publish_group(js, _group(tiny, gid, 2))
    await _wait_commits(scheduler, 3)

    assert [(c.metrics.groups, c.metrics.replayed) for c in scheduler.commits] == [
        (2, 0),
        (2, 1),
        (2, 2),
    ]
    assert scheduler.dropped == []  # a replay's prompt was trained: nothing to re-queue
    await wait_until(lambda: service2.state == "waiting")
    _, state = latest_checkpoint(checkpoint_root(service2.var_dir, EXP))
    assert state.trained_ids == ("g0", "g1", "g2", "g3", "g4", "g5")


async def test_trainer_start_invalid_spec_invalid_argument_names_field(tiny, start_trainer):
    _, stub = await start_trainer()
    spec = _spec(tiny[0]).replace('"batch_size":2', '"batch_size":0')
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.StartExperiment(
            trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=spec), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "trainer.batch_size" in err.value.details()
    assert (await _status(stub)).state == "idle"


def _launch_torchrun_trainer(scheduler, nats_server, tmp_path: Path):
    """`torchrun --nproc_per_node 2 -m services.trainer` in its own session, log to a file."""
    root = Path(__file__).resolve().parents[2]
    port, log_path = free_port(), tmp_path / "trainer.log"
    env = dict(
        os.environ,
        PYTHONPATH=f"{root / 'libs'}:{root}",
        OMP_NUM_THREADS="1",
        ASYNCRL_VAR=str(tmp_path / "var"),
        ASYNCRL_WEIGHTS=str(tmp_path / "weights"),
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", "services.trainer", "--port", str(port),
        "--scheduler", scheduler.address, "--nats-url", nats_server.url,
    ]  # fmt: skip
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return proc, port, log_path


async def test_trainer_service_under_torchrun_tp2_trains_commits_and_stops_cleanly(
    tiny, scheduler, js, nats_server, tmp_path
):
    """`torchrun --nproc_per_node 2 -m services.trainer` with trainer.tp_size=2: rank 0 serves
    and registers, rank 1 follows its backend calls; one step commits loadable HF weights, and
    SIGTERM to the process group ends both ranks after a final checkpoint (nothing aborts)."""
    proc, port, log_path = _launch_torchrun_trainer(scheduler, nats_server, tmp_path)
    try:
        await wait_until(lambda: scheduler.workers or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        spec = _spec(tiny[0], backend="megatron", tp_size=2)
        async with channel(f"127.0.0.1:{port}", "scheduler") as ch:
            stub = trainer_pb2_grpc.TrainerStub(ch)
            await stub.StartExperiment(
                trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=spec), timeout=120
            )
            await publish_group(js, _group(tiny, "g0", 0))
            await publish_group(js, _group(tiny, "g1", 0))
            await _wait_commits(scheduler, 1, timeout=120)
            st = await _status(stub)
        assert (st.version, st.step, st.backend) == (1, 1, "megatron")
        trained = AutoModelForCausalLM.from_pretrained(
            uri_to_path(scheduler.commits[0].uri), dtype=torch.float32
        )
        base = tiny[1].state_dict()
        assert any(not torch.equal(v, base[k]) for k, v in trained.state_dict().items())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    log = log_path.read_text()
    # torchrun itself exits 1 on a signal; what matters is how the ranks ended
    assert "trainer_shutting_down" in log, log[-3000:]
    assert "terminate called" not in log and "SIGKILL" not in log, log[-3000:]
    assert latest_checkpoint(checkpoint_root(tmp_path / "var", EXP)) is not None


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
async def test_torchrun_launcher_killed_outright_its_ranks_die_too(
    scheduler, nats_server, tmp_path
):
    """SIGKILL to torchrun alone (no signal it could forward): the kernel ends both ranks, so no
    orphaned rank 0 stays registered beside the trainer a supervisor would start next."""
    proc, _, log_path = _launch_torchrun_trainer(scheduler, nats_server, tmp_path)
    ranks: list[int] = []
    try:
        await wait_until(lambda: scheduler.workers or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        proc.kill()  # torchrun only: its ranks run in sessions of their own
        proc.wait(10)
        await wait_until(lambda: not any(_alive(r) for r in ranks), timeout=20)
    finally:
        for pid in [proc.pid, *ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_trainer_diverging_step_failed_fatal_names_version_and_commits_nothing(
    tiny, scheduler, start_trainer, js
):
    # lr 1e30 is finite (the spec takes it): Adam's first update moves each weight by about
    # lr, so v1 would hold ~1e30 weights, finite in fp32 but overflowing the next forward
    # (every generation on it fails): the step is refused before v1 exists
    service, stub = await start_trainer()
    spec_json = _spec(tiny[0], lr=1e30)
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=spec_json), timeout=60
    )
    for gid in ("g0", "g1"):
        await publish_group(js, _group(tiny, gid, 0))
    await wait_until(lambda: service.state == "failed", timeout=60)
    st = await _status(stub)
    assert st.message.startswith("diverged: non-finite weights at v1 ("), st.message
    assert st.fatal  # the scheduler ends the run: a restart would diverge again
    assert scheduler.commits == []  # no version was published
    assert (st.version, st.step) == (0, 0)
