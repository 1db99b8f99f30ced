"""`status` and the ledger count the same: trained groups after a power cut, prompts left over
in a cancelled run (issue 23 point 12). Real nats-server, real gRPC, fake workers."""

from __future__ import annotations

from asyncrl.ledger import fetch_report
from services.scheduler.records import ExperimentRecord
from services.scheduler.state import record_key
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import FakeRollout, running_experiment, wait_until

cluster = scheduler_env.cluster
files = scheduler_env.files


async def test_a_commit_is_stored_before_it_is_answered(cluster, files):
    """The trainer writes a step to the ledger once its commit is answered: a power cut right
    after must not find the stored record a step behind (it stayed so for the whole run)."""
    scheduler = await cluster.start_scheduler()
    exp_id = await running_experiment(
        cluster, files, FakeRollout(), dataset={"max_prompts": 8}, trainer={"total_steps": 5}
    )
    runner = scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted >= 2)
    scheduler.store._task.cancel()  # the power cut: no write after this but the commit's own
    await cluster.commit(exp_id, 1, groups=2)
    stored = ExperimentRecord.from_json((await scheduler.store.kv.get(record_key(exp_id))).value)
    assert (stored.progress.trained_groups, [s.version for s in stored.history]) == (2, [1])


async def test_cancelled_run_left_over_in_status_is_the_ledgers(cluster, files):
    """Held groups in flight when the run is cancelled are left over in the ledger; `status`
    said 0 (it counted only accepted groups never trained, and only when finishing)."""
    scheduler = await cluster.start_scheduler()
    rollout = FakeRollout(hold=True)
    exp_id = await running_experiment(
        cluster, files, rollout, dataset={"max_prompts": 8}, trainer={"total_steps": 5}
    )
    runner = scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.running >= 2)
    running = runner.staleness.counts.running
    await cluster.stub.CancelExperiment(
        scheduler_env.scheduler_pb2.CancelExperimentRequest(experiment_id=exp_id), timeout=10
    )
    await wait_until(lambda: runner.terminal)
    exp = await cluster.experiment(exp_id)
    ledger = await fetch_report(exp_id, cluster.nats_url)
    assert ledger.totals["left_over"] == running > 0
    assert exp.progress.left_over == ledger.totals["left_over"]
    assert exp.message == f"cancelled by user; {running} prompts left over, never trained"
    assert exp.progress.trained_groups == ledger.trained_groups == 0


async def test_finished_run_left_over_in_message_status_and_ledger_is_one_figure(cluster, files):
    """A run that reaches total_steps with its groups still held: the final message, `status`
    and the ledger say the same number of prompts left over (the message said none: it
    counted only accepted groups never trained, as the finish began)."""
    scheduler = await cluster.start_scheduler()
    exp_id = await running_experiment(
        cluster,
        files,
        FakeRollout(hold=True),
        dataset={"max_prompts": 8},
        trainer={"total_steps": 1},
    )
    runner = scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.running >= 2)
    await cluster.commit(exp_id, 1)  # total_steps: the held groups are cancelled
    await wait_until(lambda: runner.terminal)
    exp = await cluster.experiment(exp_id)
    ledger = await fetch_report(exp_id, cluster.nats_url)
    assert ledger.totals["left_over"] == 2  # the two held groups (eta 0, batch 2)
    assert exp.progress.left_over == 2
    assert exp.message == "reached total_steps=1; 2 prompts left over, never trained"


async def test_finished_run_counts_prompts_waiting_at_the_finish_once(cluster, files):
    """A run reaching total_steps with its prompts re-queued (its rollout fenced): those were
    counted left over as the finish began and again as the run ended: `status` said twice the
    ledger's figure (4 here, the ledger 2), the message none."""
    scheduler = await cluster.start_scheduler()
    exp_id = await running_experiment(
        cluster,
        files,
        FakeRollout(hold=True),
        dataset={"max_prompts": 8},
        trainer={"total_steps": 1},
    )
    runner = scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.running >= 2)
    [worker] = runner.rollouts()
    runner.release_rollout(worker, "fenced by the test", cooldown_s=60)  # 2 prompts re-queued
    await cluster.commit(exp_id, 1)  # total_steps
    await wait_until(lambda: runner.terminal)
    exp = await cluster.experiment(exp_id)
    ledger = await fetch_report(exp_id, cluster.nats_url)
    assert ledger.totals["left_over"] == 2
    assert exp.progress.left_over == 2
    assert exp.message == "reached total_steps=1; 2 prompts left over, never trained"
