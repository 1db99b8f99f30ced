"""The scheduler against a real nats-server and real gRPC on port 0.

Dispatch and commit paths use the small rollout and trainer servicers of
tests/fakes/scheduler_env.py (they implement the real proto services, return GroupSummaries
and versions) and drive CommitWeights / ReportDropped
directly: these tests check the scheduler's own logic (admission under eta, stale aborts,
re-queue on worker death, completion), not the real rollout/trainer (the e2e test does that).
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from asyncrl.natsutil import wait_until
from asyncrl.spec import spec_from_json
from asyncrl.v1 import (
    scheduler_pb2,
)
from services.scheduler.lifecycle import Phase
from services.scheduler.state import record_key
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import (
    REWARD,
    ROLLOUT,
    RUNNING,
    TRAINER,
    FakeRollout,
    FakeTrainer,
    attempt,
    running_experiment,
    spec,
    started_experiment,
    submit,
)

cluster = scheduler_env.cluster  # the scheduler, its fake workers and files (fixtures)
files = scheduler_env.files


# ---- submit validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"trainer": {"lr": -1.0}}, "trainer.lr"),
        ({"rollout": {"n_samples": 0}}, "rollout.n_samples"),
        ({"reward": {"function": "no_such_reward"}}, "reward.function"),
        ({"dataset": {"path": "/nonexistent/train.jsonl"}}, "dataset.path"),
        ({"rollout": {"workflow": {"name": "no_such_flow"}}}, "rollout.workflow.name"),
        # one plugin-name rule (asyncrl.registry.PLUGIN_NAME): refused by the spec itself
        ({"rollout": {"workflow": {"name": "pkg..missing:Flow"}}}, "rollout.workflow.name"),
        ({"reward": {"function": "plugin:pkg..missing:fn"}}, "reward.function"),
        (
            {"rollout": {"workflow": {"name": "multi_turn", "args": {"turns": 2}}}},
            "rollout.workflow",
        ),
        (  # the tiny model's tokenizer has no chat template
            {"rollout": {"workflow": {"chat_template": True}}},
            "rollout.workflow.chat_template",
        ),
    ],
)
async def test_submit_bad_field_invalid_argument_names_field(cluster, files, override, field):
    await cluster.start_scheduler()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await submit(cluster, spec(files, **override))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"{field}:")
    listed = await cluster.stub.ListExperiments(scheduler_pb2.ListExperimentsRequest())
    assert list(listed.experiments) == []


async def test_submit_dataset_row_missing_key_invalid_argument(cluster, files, tmp_path):
    await cluster.start_scheduler()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "x"}\n')
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await submit(cluster, spec(files, dataset={"path": str(bad)}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "dataset.path: line 2: missing key 'prompt'"


async def test_submit_valid_spec_pending_with_slug_id(cluster, files):
    await cluster.start_scheduler()
    exp = await cluster.stub.SubmitExperiment(
        scheduler_pb2.SubmitExperimentRequest(spec_json=spec(files)), timeout=10
    )
    assert exp.id.startswith("math-rl-1-") and len(exp.id) == len("math-rl-1-") + 6
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_PENDING
    assert spec_from_json(exp.spec_json).trainer.batch_size == 2
    await wait_until(lambda: "waiting for" in cluster.scheduler.get(exp.id).record.message)
    got = await cluster.experiment(exp.id)
    assert "a trainer" in got.message and "a reward worker" in got.message


async def test_get_unknown_experiment_not_found(cluster):
    await cluster.start_scheduler()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await cluster.experiment("nope-000000")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


# ---- registry -----------------------------------------------------------------------------


async def test_register_heartbeat_list_and_lease_expiry(cluster):
    await cluster.start_scheduler(lease_ttl_s=0.6, heartbeat_interval_s=0.1)
    stub = cluster.stub_as("reward")
    resp = await stub.RegisterWorker(
        scheduler_pb2.RegisterWorkerRequest(
            kind=REWARD, address="127.0.0.1:7001", name="r1", capacity=4
        ),
        timeout=5,
    )
    assert resp.worker_id.startswith("reward-")
    assert (resp.lease_ttl_s, resp.heartbeat_interval_s) == (0.6, 0.1)
    assert (await stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id=resp.worker_id))).known
    listed = (await cluster.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())).workers
    assert [(w.worker_id, w.kind, w.address, w.name, w.capacity) for w in listed] == [
        (resp.worker_id, REWARD, "127.0.0.1:7001", "r1", 4)
    ]
    await wait_until(lambda: not cluster.scheduler.registry.workers(), timeout=5)  # no beats
    assert not (await cluster.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())).workers
    beat = await stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id=resp.worker_id))
    assert beat.known is False


async def test_register_unspecified_kind_invalid_argument(cluster):
    await cluster.start_scheduler()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await cluster.stub_as("rollout").RegisterWorker(
            scheduler_pb2.RegisterWorkerRequest(address="h:1"), timeout=5
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- persistence --------------------------------------------------------------------------


async def test_experiment_survives_scheduler_restart_in_kv(cluster, files):
    await cluster.start_scheduler()
    exp_id = await submit(cluster, spec(files))
    await cluster.stop_scheduler()
    await cluster.start_scheduler()
    got = await cluster.experiment(exp_id)
    assert got.id == exp_id and spec_from_json(got.spec_json).trainer.total_steps == 3
    assert got.state == scheduler_pb2.EXPERIMENT_STATE_PENDING


async def test_restart_resumes_running_experiment_and_redispatches_inflight(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True)
    exp_id = await running_experiment(cluster, files, rollout)
    await wait_until(lambda: len(rollout.group_ids()) == 2)
    first = sorted(rollout.group_ids())
    await cluster.scheduler.store.flush()  # the coalesced KV write has landed
    saved = await cluster.scheduler.store.kv.get(record_key(exp_id))
    assert len(json.loads(saved.value)["inflight"]) == 2
    await cluster.stop_scheduler()
    await cluster.start_scheduler(port=cluster.port)
    # the workers re-register (heartbeat says unknown) and the experiment resumes; the groups
    # that were in flight are dispatched again under the same ids (JetStream dedup)
    await wait_until(lambda: len(rollout.group_ids()) >= 4, timeout=15)
    assert sorted(rollout.group_ids()[2:4]) == first
    assert (await cluster.experiment(exp_id)).state == RUNNING


# ---- dispatch, commit, aborts -------------------------------------------------------------


async def test_admission_bounded_by_eta_and_grows_with_commits(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True)
    exp_id = await running_experiment(
        cluster, files, rollout, rollout={"max_head_offpolicyness": 1}, trainer={"total_steps": 10}
    )
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: len(rollout.group_ids()) == 4)  # (eta + 0 + 1) * B
    await asyncio.wait_for(runner.settled(), 5)
    assert (await cluster.experiment(exp_id)).progress.dispatched == 4
    assert rollout.updates[0] == (0, files["model"])  # v0 = the spec's model.path first
    rollout.release.set()
    await wait_until(lambda: runner.staleness.counts.accepted == 4)
    await asyncio.wait_for(runner.settled(), 5)
    exp = await cluster.experiment(exp_id)
    assert exp.progress.dispatched == 4  # accepted + running hit the budget
    resp = await cluster.commit(exp_id, 1)
    assert resp.stop is False  # answered once recorded
    assert runner.committed_version == 1
    await wait_until(lambda: runner.version == 1)  # the fleet loads it in the background
    assert rollout.updates[-1] == (1, "file:///w/v1")
    await wait_until(lambda: len(rollout.group_ids()) == 6)  # (1 + 1 + 1) * 2 - 4
    assert rollout.served[4:] == [1, 1]
    exp = await cluster.experiment(exp_id)
    assert (exp.progress.version, exp.progress.dispatched) == (1, 6)


async def test_groups_dispatched_in_one_pass_share_one_generate_groups_call(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True)
    exp_id = await running_experiment(
        cluster, files, rollout, rollout={"max_head_offpolicyness": 1}, trainer={"total_steps": 10}
    )
    await wait_until(lambda: len(rollout.group_ids()) == 4)  # (eta + 0 + 1) * B
    assert rollout.calls == [rollout.group_ids()]
    rollout.release.set()
    await wait_until(lambda: cluster.scheduler.get(exp_id).staleness.counts.accepted == 4)
    await cluster.commit(exp_id, 1)
    await wait_until(lambda: len(rollout.group_ids()) == 6)
    assert rollout.calls[1:] == [rollout.group_ids()[4:]]  # the two the commit admitted


async def test_finish_withdraws_training_groups_sharing_a_call_with_evals(cluster, files):
    """The last commit ends training while the final eval's groups run: the training groups
    dispatched in the same call as eval groups are withdrawn with AbortGroups (the call goes
    on for the evals), and the run completes once the evals answer."""
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True, hold_eval=True)
    exp_id = await running_experiment(
        cluster,
        files,
        rollout,
        rollout={"max_head_offpolicyness": 1},  # v1 leaves them fresh enough: no stale abort
        trainer={"total_steps": 1},
        # training beside the v0 round, so that both kinds of group share a call; the commit
        # lands while the round is held open, so the fleet must not wait for it (one_version)
        eval={
            "dataset_path": files["eval"],
            "every_versions": 1,
            "before_training": False,
            "one_version": False,
        },
    )
    await wait_until(lambda: len(rollout.requests) == 7)  # 3 eval prompts, then 2 * B groups
    [call] = rollout.calls
    training = rollout.group_ids()
    assert call == [r.group_id for r in rollout.requests]
    await cluster.commit(exp_id, 1)  # total_steps: the training groups are cancelled
    await wait_until(lambda: rollout.abort_requests)
    assert [sorted(r) for r in rollout.abort_requests] == [sorted(training)]
    assert rollout.abort_reasons == ["aborted: withdrawn by the scheduler"]
    assert rollout.cancelled == []  # the call goes on for the eval groups
    rollout.release.set()
    await wait_until(lambda: cluster.scheduler.get(exp_id).terminal, timeout=10)
    exp = await cluster.experiment(exp_id)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_COMPLETED


async def test_commit_aborts_unpublished_stale_groups_at_once(cluster, files):
    """eta = 0, v1 committed: the groups started at v0 can no longer be trained unless the step
    that produced v1 has them; the rollout says it has not published them (AbortGroups), so
    they are re-queued as new attempts at once, without waiting for v2."""
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True)
    exp_id = await running_experiment(cluster, files, rollout)  # eta = 0
    await wait_until(lambda: len(rollout.group_ids()) == 2)
    first = rollout.group_ids()
    await cluster.commit(exp_id, 1)
    await wait_until(lambda: sum(g.endswith("-a1") for g in rollout.group_ids()) == 2)
    assert [sorted(r) for r in rollout.abort_requests] == [sorted(first)]
    assert rollout.cancelled == []  # answered ABORTED, not cancelled
    retried = [g for g in rollout.group_ids() if g.endswith("-a1")]
    assert sorted(attempt(g, 0) for g in retried) == sorted(first)
    exp = await cluster.experiment(exp_id)
    assert exp.progress.stale_dropped == 2
    assert set(rollout.served[2:]) == {1}  # at v1, beside new prompts up to (0 + 1 + 1) * 2


async def test_commit_aborts_stale_inflight_groups_and_requeues(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True, published=True)
    exp_id = await running_experiment(cluster, files, rollout)  # eta = 0
    await wait_until(lambda: len(rollout.group_ids()) == 2)
    first = rollout.group_ids()
    await cluster.commit(exp_id, 1)
    # the step that produced v1 (trainer at v0) may have trained them already, and the
    # rollout says they are being published (AbortGroups aborts none): kept
    await wait_until(lambda: len(rollout.group_ids()) == 4)  # (0 + 1 + 1) * 2
    assert [sorted(r) for r in rollout.abort_requests] == [sorted(first)]
    assert rollout.cancelled == []
    await cluster.commit(exp_id, 2)
    # started at v0, v2 committed: too stale even for the step that produced v2 -> aborted
    await wait_until(lambda: sorted(rollout.cancelled) == sorted(first))
    # the call cancelled, and its groups aborted: the rollout keeps no orphan of them
    await wait_until(lambda: "aborted: withdrawn by the scheduler" in rollout.abort_reasons)
    await wait_until(lambda: any(g.endswith("-a1") for g in rollout.group_ids()))
    retried = [g for g in rollout.group_ids() if g.endswith("-a1")]
    assert sorted(attempt(g, 0) for g in retried) == sorted(first)
    exp = await cluster.experiment(exp_id)
    assert exp.progress.stale_dropped == 2


async def test_report_dropped_frees_capacity_and_requeues(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout()
    exp_id = await running_experiment(cluster, files, rollout, trainer={"total_steps": 10})
    await wait_until(lambda: cluster.scheduler.get(exp_id).staleness.counts.accepted == 2)
    dropped = rollout.group_ids()[0]
    req = scheduler_pb2.ReportDroppedRequest(
        experiment_id=exp_id, groups=[scheduler_pb2.DroppedGroup(group_id=dropped)]
    )
    await cluster.trainer_stub.ReportDropped(req, timeout=5)
    await cluster.trainer_stub.ReportDropped(req, timeout=5)  # a retry is not counted twice
    await wait_until(lambda: len(rollout.group_ids()) == 3)
    assert rollout.group_ids()[2] == attempt(dropped, 1)
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.running == 0)  # the re-queued group is back
    await asyncio.wait_for(runner.settled(), 5)
    exp = await cluster.experiment(exp_id)
    assert (exp.progress.accepted, exp.progress.stale_dropped, exp.progress.dispatched) == (
        2,
        1,
        3,
    )


async def test_rollout_death_requeues_its_groups_to_another_worker(cluster, files):
    await cluster.start_scheduler(lease_ttl_s=1.0)
    doomed = FakeRollout(hold=True)
    exp_id = await running_experiment(cluster, files, doomed, trainer={"total_steps": 10})
    await wait_until(lambda: len(doomed.group_ids()) == 2)
    lost = doomed.group_ids()
    kill = cluster._closers[-1]
    await kill()  # the worker process dies: its calls fail, its lease lapses
    survivor = FakeRollout()
    await cluster.worker(ROLLOUT, survivor)
    await wait_until(lambda: len(survivor.group_ids()) >= 2, timeout=10)
    assert survivor.updates[0] == (0, files["model"])
    assert sorted(survivor.group_ids()[:2]) == sorted(lost)  # the same group ids: dedup holds
    exp = await cluster.experiment(exp_id)
    assert exp.progress.requeued == 2


async def test_failing_rollout_is_fenced_and_prompt_requeued(cluster, files):
    await cluster.start_scheduler(lease_ttl_s=0.5, heartbeat_interval_s=0.1)
    rollout = FakeRollout()
    rollout.fail_next = 1
    exp_id = await running_experiment(cluster, files, rollout, trainer={"total_steps": 10})
    await wait_until(
        lambda: cluster.scheduler.get(exp_id).staleness.counts.accepted == 2, timeout=10
    )
    first = rollout.group_ids()[0]
    assert rollout.group_ids().count(first) == 2  # re-dispatched after cooldown, same id
    assert len(rollout.updates) >= 2  # re-bound: weights loaded again before new groups


async def test_completion_at_total_steps_runs_evals_and_stops_trainer(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout(rewards=(1.0, 0.0))
    trainer = FakeTrainer()
    exp_id = await running_experiment(
        cluster,
        files,
        rollout,
        fake_trainer=trainer,
        trainer={"total_steps": 2},
        eval={"dataset_path": files["eval"], "every_versions": 0, "n_samples": 2},
    )
    stream = cluster.stub.WatchExperiment(
        scheduler_pb2.WatchExperimentRequest(experiment_id=exp_id), timeout=20
    )
    # the snapshot first: the watch is registered, so no step can fall before it (on a loaded
    # machine the commits below once did, and step 1 was in the snapshot, not in the events)
    events = [await stream.read()]
    assert events[0].kind == "snapshot"
    r1 = await cluster.commit(exp_id, 1)
    r2 = await cluster.commit(exp_id, 2)
    assert (r1.stop, r2.stop) == (False, True)
    while (event := await stream.read()) is not grpc.aio.EOF:  # it ends with the experiment
        events.append(event)
    assert [e.step.version for e in events if e.kind == "step"] == [1, 2]
    evals = [e.eval for e in events if e.kind == "eval"]
    assert [e.version for e in evals] == [2] or [e.version for e in evals] == [0, 2]
    assert events[-1].kind == "state"
    exp = await cluster.experiment(exp_id)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_COMPLETED
    assert [(e.version, e.accuracy, e.n_prompts, e.n_samples) for e in exp.progress.evals] == [
        (0, 0.5, 3, 6),
        (2, 0.5, 3, 6),
    ]
    assert exp.progress.trained_groups == 4 and exp.progress.running == 0
    eval_reqs = [r for r in rollout.requests if r.eval]
    assert len(eval_reqs) == 6
    assert [spec_from_json(s).eval.n_samples for s in rollout.bound] == [2]  # bound once
    assert trainer.stopped == [exp_id]
    workers = (await cluster.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())).workers
    assert all(w.experiment_id == "" for w in workers)  # freed for the next experiment


@pytest.mark.parametrize("before_training", [True, False])
async def test_first_eval_round_holds_training_until_it_is_done(cluster, files, before_training):
    """eval.before_training: the v0 round runs alone, so its tokens are v0's; without it,
    training groups go out beside the eval's."""
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True, hold_eval=True)
    exp_id = await running_experiment(
        cluster,
        files,
        rollout,
        trainer={"total_steps": 2},
        eval={
            "dataset_path": files["eval"],
            "every_versions": 0,
            "before_training": before_training,
        },
    )
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: sum(r.eval for r in rollout.requests) == 3)
    await asyncio.wait_for(runner.settled(), 5)
    assert (len(rollout.group_ids()) == 0) is before_training, rollout.group_ids()
    rollout.release.set()
    await wait_until(lambda: len(runner.book.record.evals) == 1)
    first = runner.book.record.evals[0]
    assert (first.version, first.min_version, first.max_version) == (0, 0, 0)
    await wait_until(lambda: len(rollout.group_ids()) >= 2)  # training goes on after it


async def test_cancel_stops_trainer_and_frees_workers(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True)
    trainer = FakeTrainer()
    exp_id = await running_experiment(cluster, files, rollout, fake_trainer=trainer)
    await wait_until(lambda: len(rollout.group_ids()) == 2)
    exp = await cluster.stub.CancelExperiment(
        scheduler_pb2.CancelExperimentRequest(experiment_id=exp_id), timeout=10
    )
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_CANCELLED
    assert trainer.stopped == [exp_id]
    await wait_until(lambda: sorted(rollout.cancelled) == sorted(rollout.group_ids()))
    resp = await cluster.commit(exp_id, 1)
    assert resp.stop is True


async def test_a_step_committed_while_the_cancel_stops_the_trainer_is_recorded(cluster, files):
    """A trainer that finished a step as the cancel came commits it before it stops (its
    ledger and final checkpoint hold that step): the record counts it too, the answer says
    stop, and a commit once the run is terminal changes nothing."""
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True)
    answers = []

    class FinishingTrainer(FakeTrainer):
        async def StopExperiment(self, request, context):
            answers.append(await cluster.commit(request.experiment_id, 2, groups=2))
            return await super().StopExperiment(request, context)

    exp_id = await running_experiment(cluster, files, rollout, fake_trainer=FinishingTrainer())
    await cluster.commit(exp_id, 1)
    exp = await cluster.stub.CancelExperiment(
        scheduler_pb2.CancelExperimentRequest(experiment_id=exp_id), timeout=10
    )
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_CANCELLED
    assert [a.stop for a in answers] == [True]
    # recorded, not served: no rollout is updated once the run ends
    assert (exp.progress.last_step.version, exp.progress.trained_groups) == (2, 4), exp.progress
    assert exp.weights_version == 2 and exp.progress.version == 1, exp
    assert (await cluster.commit(exp_id, 3)).stop is True  # terminal: not recorded
    assert (await cluster.experiment(exp_id)).progress.last_step.version == 2


async def test_trainer_resume_recovers_version_from_start_experiment(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True)
    exp_id = await running_experiment(
        cluster, files, rollout, fake_trainer=FakeTrainer(version=2), trainer={"total_steps": 10}
    )
    runner = cluster.scheduler.get(exp_id)
    # the fleet takes the trainer's version; `accepted` stays the record's count (it counts
    # published groups, which a restored record's in-flight re-dispatches complete)
    assert (runner.version, runner.staleness.counts.accepted) == (2, 0)
    await wait_until(lambda: len(rollout.group_ids()) == 6)  # (eta + 2 + 1) * B - 0
    assert rollout.updates[0] == (2, "file:///w/v2")  # where the trainer says v2 lives


async def test_trainer_lease_lapse_waits_then_new_trainer_resumes(cluster, files):
    await cluster.start_scheduler(lease_ttl_s=0.6, heartbeat_interval_s=0.1)
    rollout = FakeRollout()
    exp_id = await running_experiment(cluster, files, rollout, trainer={"total_steps": 10})
    await cluster.commit(exp_id, 1)
    kill_trainer = cluster._closers[-2]  # reward, trainer, rollout were started in that order
    await kill_trainer()
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.state.value == "PENDING", timeout=5)
    assert "a trainer" in (await cluster.experiment(exp_id)).message
    successor = FakeTrainer(version=1)
    await cluster.worker(TRAINER, successor)
    await wait_until(lambda: runner.state.value == "RUNNING", timeout=5)
    assert successor.started == [exp_id]
    assert runner.version == 1


async def test_rollout_joining_running_experiment_loads_current_weights_first(cluster, files):
    await cluster.start_scheduler()
    first = FakeRollout(hold=True)  # capacity 8, filled by (eta + 0 + 1) * B = 8 groups
    exp_id = await running_experiment(
        cluster, files, first, trainer={"total_steps": 10}, rollout={"max_head_offpolicyness": 3}
    )
    await wait_until(lambda: len(first.requests) == 8)
    await cluster.commit(exp_id, 1)  # two more may start, but the first worker is full
    joined = FakeRollout(hold=True)
    await cluster.worker(ROLLOUT, joined)
    await wait_until(lambda: len(joined.requests) == 2)
    assert joined.updates[0] == (1, "file:///w/v1")
    assert joined.served[0] == 1
    workers = (await cluster.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())).workers
    assert sorted(w.experiment_id for w in workers if w.kind == ROLLOUT) == [exp_id, exp_id]


async def test_dataset_exhausted_completes_after_last_full_batch(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout()
    trainer = FakeTrainer()
    exp_id = await running_experiment(
        cluster,
        files,
        rollout,
        fake_trainer=trainer,
        dataset={"max_prompts": 4},
        trainer={"total_steps": 10},
    )
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted == 2)
    assert (await cluster.commit(exp_id, 1)).stop is False
    await wait_until(lambda: runner.staleness.counts.accepted == 4)
    assert (await cluster.commit(exp_id, 2)).stop is True  # 4 prompts, B=2: nothing left
    await wait_until(lambda: runner.terminal)
    exp = await cluster.experiment(exp_id)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_COMPLETED
    assert "dataset exhausted" in exp.message
    assert len(rollout.group_ids()) == 4 and trainer.stopped == [exp_id]


async def test_second_experiment_takes_a_rollout_from_the_first(cluster, files):
    await cluster.start_scheduler()
    r1, r2 = FakeRollout(hold=True), FakeRollout(hold=True)
    await cluster.worker(ROLLOUT, r1)
    await cluster.worker(ROLLOUT, r2)
    first = await running_experiment(cluster, files, FakeRollout(hold=True))
    runner = cluster.scheduler.get(first)
    await wait_until(lambda: len(runner.rollouts()) == 3)
    second = await submit(cluster, spec(files))
    await cluster.worker(TRAINER, FakeTrainer())
    other = cluster.scheduler.get(second)
    await wait_until(lambda: other.state.value == "RUNNING", timeout=5)
    assert (len(runner.rollouts()), len(other.rollouts())) == (2, 1)


# ---- trainer replacement, trainer failure, no progress ---------------------------------------

FAILED = scheduler_pb2.EXPERIMENT_STATE_FAILED
COMPLETED = scheduler_pb2.EXPERIMENT_STATE_COMPLETED


async def _trainer_committed_v1(cluster, files):
    """Workers and an experiment whose first trainer started and committed v1; returns
    (experiment id, runner, the trainer's agent, a kill of the trainer)."""
    first = FakeTrainer()
    await cluster.worker(REWARD)
    agent, kill = await cluster.worker(TRAINER, first)
    await cluster.worker(ROLLOUT, FakeRollout())
    exp_id = await submit(cluster, spec(files, trainer={"total_steps": 10}))
    await wait_until(lambda: first.started == [exp_id])
    await cluster.commit(exp_id, 1)
    return exp_id, cluster.scheduler.get(exp_id), agent, kill


async def test_trainer_freed_by_an_ending_experiment_stays_free_for_the_next(cluster, files):
    """`_end` frees the trainer, then awaits the ledger's flush before the state is terminal:
    a reconcile then must not bind the trainer back to the ending experiment (the next
    experiment waited for a trainer for ever: bench system between its eta runs)."""
    await cluster.start_scheduler()
    exp_id = await running_experiment(
        cluster, files, FakeRollout(hold=True), trainer={"total_steps": 10}
    )
    core = cluster.scheduler
    runner = core.get(exp_id)
    trainer = runner.trainer()
    runner.lifecycle.to(Phase.ENDING)  # as `_end` between freeing its trainer and the end
    core.registry.unbind(trainer)
    core._reconcile()
    assert runner.trainer() is None and trainer.experiment_id is None


async def test_trainer_restarted_at_same_address_is_started_again(cluster, files):
    await cluster.start_scheduler(trainer_poll_interval_s=60)  # re-registering triggers it
    exp_id, runner, agent, kill = await _trainer_committed_v1(cluster, files)
    worker_id = runner.trainer().worker_id
    await kill()  # kill -9 and a supervisor restart, within the lease
    restarted = FakeTrainer(version=1)  # resumes from its checkpoint at v1
    await cluster.worker(TRAINER, restarted, port=int(agent.address.rsplit(":", 1)[1]))
    await wait_until(lambda: restarted.started == [exp_id], timeout=10)
    assert runner.trainer().worker_id == worker_id  # same address: the same registration
    await wait_until(lambda: runner.state.value == "RUNNING")
    assert runner.version == 1


async def test_trainer_replaced_before_lease_lapse_is_started(cluster, files):
    await cluster.start_scheduler(lease_ttl_s=0.6, heartbeat_interval_s=0.1)
    exp_id, runner, _, kill = await _trainer_committed_v1(cluster, files)
    await kill()
    successor = FakeTrainer(version=1)
    await cluster.worker(TRAINER, successor)  # registers before the dead one's lease lapses
    await wait_until(lambda: successor.started == [exp_id], timeout=10)
    await wait_until(lambda: runner.state.value == "RUNNING")
    assert runner.version == 1


async def test_trainer_failed_status_redriven_then_experiment_failed_with_message(cluster, files):
    await cluster.start_scheduler(trainer_poll_interval_s=0.05, max_start_failures=2)
    trainer = FakeTrainer()
    exp_id = await running_experiment(
        cluster, files, FakeRollout(), fake_trainer=trainer, trainer={"total_steps": 10}
    )
    trainer.fail("ValueError: token id 99999 past the vocabulary")
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.terminal, timeout=10)
    exp = await cluster.experiment(exp_id)
    assert exp.state == FAILED
    assert "token id 99999 past the vocabulary" in exp.message
    assert trainer.started == [exp_id, exp_id]  # re-driven once, failed again


async def test_trainer_failed_once_is_redriven_and_runs_on(cluster, files):
    await cluster.start_scheduler(trainer_poll_interval_s=0.05)
    trainer = FakeTrainer()
    exp_id = await running_experiment(
        cluster, files, FakeRollout(), fake_trainer=trainer, trainer={"total_steps": 10}
    )
    trainer.state = "failed"  # one failure: StartExperiment brings it back
    await wait_until(lambda: len(trainer.started) == 2, timeout=10)
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.state.value == "RUNNING")
    assert (await cluster.commit(exp_id, 1)).stop is False
    assert runner.committed_version == 1
    await wait_until(lambda: runner.version == 1)


async def test_no_progress_redrives_trainer_once_then_fails_with_reason(cluster, files):
    await cluster.start_scheduler(trainer_poll_interval_s=0.05, progress_timeout_s=0.5)
    trainer = FakeTrainer()
    rollout = FakeRollout(hold=True)  # groups never finish
    exp_id = await running_experiment(
        cluster, files, rollout, fake_trainer=trainer, trainer={"total_steps": 10}
    )
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.terminal, timeout=10)
    exp = await cluster.experiment(exp_id)
    assert exp.state == FAILED
    assert "no progress" in exp.message and "no step committed" in exp.message
    assert "no group settled" in exp.message
    assert trainer.started == [exp_id, exp_id]


# ---- outcomes: trained nothing, left over, failure reasons -----------------------------------


async def test_batch_larger_than_dataset_failed_trained_nothing(cluster, files):
    await cluster.start_scheduler()
    exp_id = await started_experiment(
        cluster, files, FakeRollout(), dataset={"max_prompts": 1}, trainer={"total_steps": 10}
    )
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.terminal)
    exp = await cluster.experiment(exp_id)
    assert exp.state == FAILED
    assert exp.message.startswith("trained nothing: dataset exhausted")
    assert "batch_size=2" in exp.message and exp.progress.left_over == 1


async def test_every_group_failed_run_failed_with_reasons_on_the_wire(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout(fail_reason="reward raised: ZeroDivisionError")
    exp_id = await started_experiment(
        cluster, files, rollout, dataset={"max_prompts": 4}, trainer={"total_steps": 10}
    )
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.terminal)
    exp = await cluster.experiment(exp_id)
    assert exp.state == FAILED
    assert "4x reward raised: ZeroDivisionError" in exp.message
    assert dict(exp.progress.failure_reasons) == {"reward raised: ZeroDivisionError": 4}


async def test_left_over_groups_reported_at_dataset_end(cluster, files):
    await cluster.start_scheduler()
    exp_id = await running_experiment(
        cluster, files, FakeRollout(), dataset={"max_prompts": 5}, trainer={"total_steps": 10}
    )
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted == 2)
    await cluster.commit(exp_id, 1)
    await wait_until(lambda: runner.staleness.counts.accepted == 4)
    await cluster.commit(exp_id, 2)
    await wait_until(lambda: runner.terminal)
    exp = await cluster.experiment(exp_id)
    assert exp.state == COMPLETED
    assert exp.progress.left_over == 1
    assert exp.message == "dataset exhausted; 1 prompts left over, never trained"


async def test_submit_oversized_name_invalid_argument(cluster, files):
    await cluster.start_scheduler()
    data = json.loads(spec(files))
    data["name"] = "x" * 2_000_000
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await submit(cluster, json.dumps(data))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("name:")


# ---- bounded records ------------------------------------------------------------------------


async def test_history_outside_record_served_after_restart(cluster, files):
    await cluster.start_scheduler()
    exp_id = await running_experiment(cluster, files, FakeRollout(), trainer={"total_steps": 10})
    for version in (1, 2, 3):
        await cluster.commit(exp_id, version)
    await cluster.scheduler.store.flush()
    saved = json.loads((await cluster.scheduler.store.kv.get(record_key(exp_id))).value)
    assert "history" not in saved and saved["last_step"]["version"] == 3
    await cluster.stop_scheduler()
    await cluster.start_scheduler(port=cluster.port)
    exp = await cluster.stub.GetExperiment(
        scheduler_pb2.GetExperimentRequest(experiment_id=exp_id, with_history=True),
        timeout=5,
        wait_for_ready=True,  # the channel reconnects to the restarted scheduler
    )
    assert [h.version for h in exp.history] == [1, 2, 3]
    assert exp.progress.last_step.version == 3


async def test_trainer_resumed_from_older_checkpoint_step_not_counted_twice(cluster, files):
    await cluster.start_scheduler(lease_ttl_s=0.6, heartbeat_interval_s=0.1)
    first = FakeTrainer()
    await cluster.worker(REWARD)
    _, kill = await cluster.worker(TRAINER, first)
    await cluster.worker(ROLLOUT, FakeRollout())
    exp_id = await submit(cluster, spec(files, trainer={"total_steps": 10}))
    await wait_until(lambda: first.started == [exp_id])
    for version in (1, 2, 3):
        await cluster.commit(exp_id, version)
    await kill()
    successor = FakeTrainer(version=2)  # its newest checkpoint is v2: step 3 is trained again
    await cluster.worker(TRAINER, successor)
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: successor.started == [exp_id] and runner.state.value == "RUNNING")
    assert runner.version == 2
    await cluster.commit(exp_id, 3)
    await cluster.stop_scheduler()
    await cluster.start_scheduler(port=cluster.port)
    exp = await cluster.stub.GetExperiment(
        scheduler_pb2.GetExperimentRequest(experiment_id=exp_id, with_history=True),
        timeout=5,
        wait_for_ready=True,  # the channel reconnects to the restarted scheduler
    )
    assert [h.version for h in exp.history] == [1, 2, 3]
    assert exp.progress.trained_groups == 6


@pytest.mark.parametrize("one_version", [True, False])
async def test_an_eval_round_is_generated_by_the_version_it_is_labelled_with(
    cluster, files, one_version
):
    """eval.one_version: a version committed while a round generates reaches the fleet only
    once the round is done, so every token of the v0 round is v0's; without it the fleet
    takes v1 mid-round and the round's groups are generated by v1."""
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True, hold_eval=True)
    exp_id = await running_experiment(
        cluster,
        files,
        rollout,
        trainer={"total_steps": 3},
        eval={
            "dataset_path": files["eval"],
            "every_versions": 0,
            "before_training": False,
            "one_version": one_version,
        },
    )
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: sum(r.eval for r in rollout.requests) == 3)
    commit = asyncio.ensure_future(cluster.commit(exp_id, 1))

    def updated() -> list[int]:
        return [v for v, _ in rollout.updates if v > 0]

    if one_version:
        await asyncio.sleep(0.5)
        assert updated() == [] and not runner.book.record.evals
    else:
        await wait_until(lambda: updated() == [1])
    rollout.release.set()
    await wait_until(lambda: len(runner.book.record.evals) == 1)
    await asyncio.wait_for(commit, 10)
    first = runner.book.record.evals[0]
    want = (0, 0, 0) if one_version else (0, 1, 1)
    assert (first.version, first.min_version, first.max_version) == want
    await wait_until(lambda: updated() == [1])  # the fleet moves on
