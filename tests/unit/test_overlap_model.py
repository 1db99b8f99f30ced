"""bench.overlap (the zero-overhead model of async vs sync RL) on hand-computable cases, its
agreement with ../shared/tools/overlap_bound on the same inputs, and the long-tail workflow
whose lengths feed it (bench.longtail)."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path
from statistics import NormalDist

import pytest

from asyncrl.spec import SamplingParams
from asyncrl.types import Completion
from asyncrl.workflow import WorkflowContext
from bench import overlap
from bench.longtail import LongTail, attempt_of, target_length, target_lengths
from bench.overlap import GroupLengths, Workload, simulate_async, simulate_sync

TOOL = (
    Path(__file__).resolve().parents[3] / "shared" / "tools" / "overlap_bound" / "overlap_bound.py"
)


def _table(w: Workload, rows: list[list[int]]) -> GroupLengths:
    return GroupLengths(w, rows)


# ---------------------------------------------------------------------------- analytic


def test_point_mass_lengths_expected_length_and_max_are_the_point():
    cdf = overlap.lognormal_cdf(median=3, sigma=0, max_len=10)
    assert overlap.expected_length(cdf) == 3.0
    assert overlap.expected_max(cdf, m=16) == 3.0


def test_two_point_lengths_expected_max_of_two_and_three():
    cdf = overlap.empirical_cdf([1, 3], max_len=3)
    assert list(cdf) == [0.0, 0.5, 0.5, 1.0]
    assert overlap.expected_length(cdf) == 2.0
    assert overlap.expected_max(cdf, m=2) == 2.5  # P(max = 1) = 1/4
    assert overlap.expected_max(cdf, m=3) == 2.75  # P(max = 1) = 1/8


def test_lognormal_cdf_is_the_rounded_clipped_normal():
    median, sigma = 2.0, 1.0
    cdf = overlap.lognormal_cdf(median, sigma, max_len=3)
    phi = NormalDist().cdf
    want = [0.0, phi(math.log(1.5 / median)), phi(math.log(2.5 / median)), 1.0]
    assert cdf == pytest.approx(want, abs=1e-12)
    assert overlap.expected_length(cdf) == pytest.approx(1 + (1 - want[1]) + (1 - want[2]))


def test_t_gen_sync_and_throughput_by_hand():
    w = Workload(slots=4, n=2, batch=1, t0=1.0, alpha=1.0)  # m = 2 <= C: exact
    assert overlap.t_gen_sync(w, e_len=2.0, e_max=3.0) == 3.0 + 1.0 * 2 * 2.0 / 4  # 4.0
    assert overlap.t_gen_throughput(w, e_len=2.0) == 2 * 2.0 * 2.0 / 4  # t_tok(C) = 2
    small = replace(w, slots=1)  # C < m: the longer of the straggler and the fleet's work
    assert overlap.t_gen_sync(small, e_len=2.0, e_max=3.0) == max(3.0, 2 * 2.0 * 2.0 / 1)


def test_speedup_bound_formula():
    assert overlap.speedup_bound(gen_sync=3.0, gen_tp=1.0, train=0.5, t_sync=0.5) == 4.0 / 1.5


def test_analytic_padded_training_uses_expected_max():
    w = Workload(slots=8, n=2, batch=1, len_median=3, len_sigma=0, max_len=10, prompt_len=1,
                 train_a=0.5, train_b=0.1, padded=True)  # fmt: skip
    b = overlap.analytic(w, lengths=[1, 3])
    assert (b.e_len, b.e_max) == (2.0, 2.5)
    assert b.t_train == pytest.approx(0.5 + 0.1 * 2 * (2.5 + 1))
    assert replace(w, padded=False).train_time([1, 3]) == pytest.approx(0.5 + 0.1 * (4 + 2))
    assert w.train_time([1, 3]) == pytest.approx(0.5 + 0.1 * 2 * (3 + 1))


# ---------------------------------------------------------------------------- simulation


def test_sync_two_samples_with_alpha_take_the_occupancy_weighted_time():
    """Lengths 1 and 3 on 2 slots, t0 = 1, alpha = 1: the first token costs 2 s (both
    active), the next two 1.5 s each (one active): 5 s, as T_gen_sync says."""
    w = Workload(slots=2, n=2, batch=1, t0=1.0, alpha=1.0, steps=1)
    r = simulate_sync(w, _table(w, [[1, 3]]))
    assert r.wall_s == 5.0
    assert r.gen_tokens == 4.0
    assert r.token_steps == 3.0  # an engine's decode steps: the longest sample's length
    assert r.mean_active == pytest.approx(4 / 3)
    assert r.slot_util == pytest.approx((2 * 2.0 + 1 * 3.0) / (2 * 5.0))


def test_sync_wall_is_the_closed_form_without_alpha():
    w = Workload(slots=4, n=1, batch=1, t0=0.5, train_a=1.0, train_b=0.1, t_sync=0.25, steps=3)
    r = simulate_sync(w, _table(w, [[2], [5], [1]]))
    # per step: L t0 + train_a + train_b L + t_sync
    assert r.step_end == pytest.approx([2.45, 6.70, 8.55])
    assert r.train_busy_s == pytest.approx(3 * 1.0 + 0.1 * 8)


def test_async_one_slot_overlaps_generation_with_training():
    """C = 1, L = 2, train 1 s, update 0.5 s, eta = 1. g0 runs 0-2 and trains 2-3 while g1
    (admitted at v0) generates one token; the update pauses it (3-3.5); g1 ends at 4.5, trains
    4.5-5.5 (staleness 1), update till 6.0. Sync: 2 x (2 + 1 + 0.5) = 7.0."""
    w = Workload(slots=1, n=1, batch=1, eta=1, t0=1.0, train_a=1.0, t_sync=0.5, steps=2)
    a = simulate_async(w, _table(w, [[2]]))
    assert a.step_end == [3.5, 6.0]
    assert dict(a.staleness) == {0: 1, 1: 1}
    assert simulate_sync(w, _table(w, [[2]])).wall_s == 7.0


def test_async_straggler_is_aborted_when_too_stale_and_frees_capacity():
    """C = 2 (2 groups of one sample), eta = 1, lengths 5, 1, 1, ...: the 5-token g0 is still
    running when v = 2 is published (admitted at v0 < 2 - 1), so it is aborted, counts as
    rejected, and two new groups take the freed places. Steps end at 2, 4, 6."""
    w = Workload(slots=2, n=1, batch=1, eta=1, t0=1.0, train_a=1.0, steps=3)
    a = simulate_async(w, _table(w, [[5]] + [[1]] * 20))
    assert a.step_end == [2.0, 4.0, 6.0]
    assert a.dropped == 1
    assert dict(a.staleness) == {0: 3}


def test_async_token_steps_count_only_time_with_a_sample_active():
    """The straggler case above, token by token (t0 = 1 s): 0-1 g0 g1, 1-2 g0, 2-3 g0 g2, 3-4
    g0 (aborted at 4 with 4 of its 5 tokens), 4-5 g3 g4, 5-6 nothing active while the last
    step trains: 8 tokens in 5 decode steps."""
    w = Workload(slots=2, n=1, batch=1, eta=1, t0=1.0, train_a=1.0, steps=3)
    a = simulate_async(w, _table(w, [[5]] + [[1]] * 20))
    assert a.gen_tokens == 8.0
    assert a.token_steps == 5.0
    assert a.mean_active == 1.6


def test_async_abort_lag_lets_the_straggler_run_a_version_longer_then_drops_it():
    """The same straggler with abort_lag = 1 (asyncrl's scheduler): at v2 (t = 4) g0 is not
    aborted; it holds one admission place, so only g3 starts, and both end at t = 5, g0 too
    stale (admitted at v0 < 2 - 1): dropped, not trained. g4 runs 5-6 beside the last step."""
    w = Workload(slots=2, n=1, batch=1, eta=1, t0=1.0, train_a=1.0, steps=3, abort_lag=1)
    a = simulate_async(w, _table(w, [[5]] + [[1]] * 20))
    assert a.step_end == [2.0, 4.0, 6.0]
    assert a.dropped == 1
    assert dict(a.staleness) == {0: 3}
    assert a.gen_tokens == 9.0
    assert a.token_steps == 6.0


def test_async_requeue_admits_a_dropped_prompt_again_before_new_ones():
    """The straggler again, its prompt re-queued (requeue, as the scheduler does): aborted at
    v2 (t = 4) with 4 tokens, it is admitted again at once beside prompt 3 and starts from
    scratch: 4-5 both, 5-6 it alone, still running when the run ends. 9 tokens in 6 steps
    (8 in 5 without requeue, where prompts 3 and 4 run 4-5)."""
    w = Workload(slots=2, n=1, batch=1, eta=1, t0=1.0, train_a=1.0, steps=3, requeue=True)
    a = simulate_async(w, _table(w, [[5]] + [[1]] * 20))
    assert a.step_end == [2.0, 4.0, 6.0]
    assert a.dropped == 1
    assert a.gen_tokens == 9.0
    assert a.token_steps == 6.0


def test_async_eta_zero_equals_sync_step_by_step():
    w = Workload(slots=16, n=4, batch=4, max_groups=4, len_median=20, len_sigma=1.2, max_len=300,
                 t0=0.01, alpha=0.6, train_a=0.2, train_b=1e-3, prompt_len=5, t_sync=0.1,
                 steps=25, seed=4)  # fmt: skip
    for padded in (False, True):
        wp = replace(w, padded=padded)
        s, a = simulate_sync(wp), simulate_async(wp)
        assert a.step_end == pytest.approx(s.step_end, rel=1e-12)
        assert a.max_staleness == 0 and a.dropped == 0


@pytest.mark.parametrize(("abort_lag", "requeue"), [(0, False), (1, False), (1, True)])
@pytest.mark.parametrize("eta", [1, 2, 4])
def test_async_staleness_bounded_and_every_step_trains_b_groups(eta, abort_lag, requeue):
    w = Workload(slots=32, n=4, batch=4, eta=eta, max_groups=-1, len_median=20, len_sigma=1.5,
                 max_len=2000, t0=0.01, train_a=0.5, t_sync=0.1, steps=60, seed=1,
                 abort_lag=abort_lag, requeue=requeue)  # fmt: skip
    a = simulate_async(w)
    assert a.max_staleness <= eta
    assert sum(a.staleness.values()) == w.steps * w.batch
    assert a.wall_s >= a.train_busy_s + w.steps * w.t_sync
    assert a.slot_util <= 1.0


def test_ideal_steady_async_never_beats_the_analytic_ceiling():
    w = Workload(slots=32, n=4, batch=8, max_groups=-1, len_median=40, len_sigma=1.0, max_len=800,
                 t0=0.01, alpha=0.5, train_a=0.5, t_sync=0.1, steps=200)  # fmt: skip
    ideal = overlap.ideal(w, [1, 4, 16])
    b = ideal.bound
    ceiling = w.m / (b.t_sync + max(b.t_gen_throughput, b.t_train))
    for eta, r in ideal.runs.items():
        assert r.steady_throughput(w.m) <= ceiling * 1.03, eta
    assert ideal.speedup(16) >= ideal.speedup(1) > 1.0


def test_length_table_rows_must_have_n_lengths():
    with pytest.raises(ValueError, match="n=2"):
        GroupLengths(Workload(slots=4, n=2, batch=1), [[1, 2, 3]])


# ---------------------------------------------------------------------------- against the tool


@pytest.fixture(scope="module")
def tool():
    if not TOOL.is_file():
        pytest.skip(f"the reference tool is not here: {TOOL}")
    spec = importlib.util.spec_from_file_location("overlap_bound_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


CASES = {
    "alpha": dict(C=64, n=4, B=8, len_median=40, len_sigma=1.0, max_len=400, t0=0.01, alpha=0.7,
                  train_a=1.5, sync=0.3, steps=30, seed=3),
    "queueing": dict(C=12, n=4, B=8, max_groups=8, len_median=40, len_sigma=1.0, max_len=400,
                     t0=0.01, alpha=0.4, train_a=0.5, train_b=2e-3, prompt_len=17, sync=0.1,
                     steps=30, seed=5),
    "long_tail": dict(C=16, n=4, B=8, len_median=32, len_sigma=1.5, max_len=1024, t0=0.004,
                      train_a=1.5, sync=0.3, steps=120),
}  # fmt: skip


def _ours(c: dict) -> Workload:
    return Workload(slots=c["C"], n=c["n"], batch=c["B"], max_groups=c.get("max_groups", 0),
                    len_median=c["len_median"], len_sigma=c["len_sigma"], max_len=c["max_len"],
                    prompt_len=c.get("prompt_len", 0), t0=c["t0"], alpha=c.get("alpha", 0.0),
                    train_a=c["train_a"], train_b=c.get("train_b", 0.0), t_sync=c["sync"],
                    steps=c["steps"], seed=c.get("seed", 0))  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_speedups_and_bound_agree_with_overlap_bound_tool(tool, case):
    c = CASES[case]
    theirs = tool.run(tool.Workload(**c), [0, 1, 2, 4])
    ours = overlap.ideal(_ours(c), [0, 1, 2, 4])
    for eta, row in zip([0, 1, 2, 4], theirs["async_"], strict=True):
        assert ours.speedup(eta) == pytest.approx(row["speedup"], rel=1e-3), eta
        assert ours.runs[eta].dropped == row["dropped_groups"]
        assert ours.runs[eta].max_staleness == row["max_staleness"]
    assert ours.sync.wall_s == pytest.approx(theirs["sync"]["wall_s"], rel=1e-9)
    a = theirs["analytic"]
    assert ours.bound.speedup == pytest.approx(a["speedup_bound"], rel=1e-9)
    assert ours.bound.e_max == pytest.approx(a["E_max_len"], rel=1e-9)
    assert ours.bound.t_gen_sync == pytest.approx(a["T_gen_sync"], rel=1e-9)


def test_given_the_tools_lengths_the_simulations_agree(tool):
    """The same groups (the tool's length stream as our table): async at every eta agrees."""
    c = CASES["long_tail"]
    stream = tool.LengthStream(tool.Workload(**c))
    table = [list(stream[g]) for g in range(3000)]
    for eta in (1, 2, 4):
        theirs = tool.simulate_async(tool.Workload(**{**c, "eta": eta}))
        w = replace(_ours(c), eta=eta)
        assert simulate_async(w, GroupLengths(w, table)).wall_s == pytest.approx(
            theirs["wall_s"], rel=1e-9
        )


# ---------------------------------------------------------------------------- the workload


def test_longtail_target_lengths_are_deterministic_capped_and_lognormal():
    a = target_lengths(0, "p00001:", 4, median=32, sigma=1.5, cap=1024)
    assert a == target_lengths(0, "p00001:", 4, median=32, sigma=1.5, cap=1024)
    assert a != target_lengths(1, "p00001:", 4, median=32, sigma=1.5, cap=1024)
    many = [target_length(0, f"p{i}", 0, 32, 1.5, 1024) for i in range(4000)]
    assert min(many) >= 1 and max(many) == 1024  # P(L > 1024) ~ 1 %: the cap is hit
    assert sorted(many)[2000] in range(28, 37)  # the median


def test_longtail_workflow_continues_after_an_early_stop_to_its_target():
    """The engine stops after 3 tokens (an EOS); the workflow asks for the rest, keeping the
    stop token as a policy token, until it holds exactly its target."""
    target = target_length(0, "q", 0, 8, 0.0, 100)  # sigma 0: the median, 8
    calls = []

    async def generate(rid, input_ids, params):
        calls.append((rid, len(input_ids), params.max_new_tokens))
        n = min(3, params.max_new_tokens)
        return Completion([5] * n, [-1.0] * n, [0] * n, "stop" if n == 3 else "length")

    ctx = WorkflowContext(
        prompt="q", answer="", prompt_ids=[1, 2], index=0, is_eval=False,
        params=SamplingParams(max_new_tokens=100), tokenizer=None, generate=generate,
        score=None, version=lambda: 0, request_id="g:0",
    )  # fmt: skip
    traj = asyncio.run(LongTail(median=8, sigma=0, max_len=100).run(ctx))
    assert len(traj.output_ids) == target == 8
    assert calls == [("g:0", 2, 8), ("g:0:t1", 5, 5), ("g:0:t2", 8, 2)]
    assert traj.reward is None  # scored by the experiment's reward function


def test_longtail_a_new_attempt_of_a_prompt_draws_new_lengths():
    """A prompt dropped as too stale comes back as attempt k (its group id ends -a<k>): the
    workflow samples it afresh, as a policy would; attempt 0 keeps the first draw."""
    first = target_lengths(0, "p00001:", 4, 32, 1.5, 1024)
    assert target_lengths(0, "p00001:", 4, 32, 1.5, 1024, attempt=0) == first
    again = target_lengths(0, "p00001:", 4, 32, 1.5, 1024, attempt=1)
    assert again != first
    assert again == target_lengths(0, "p00001:", 4, 32, 1.5, 1024, attempt=1)
    assert attempt_of("exp-1-e0-p17-a3:2") == 3
    assert attempt_of("exp-1-eval-v4-p2-a0:1") == 0  # eval groups: always their first draw
    assert attempt_of("g:0") == 0

    async def generate(rid, input_ids, params):
        n = params.max_new_tokens
        return Completion([5] * n, [-1.0] * n, [0] * n, "length")

    for group, attempt in (("exp-1-e0-p1-a0", 0), ("exp-1-e0-p1-a2", 2)):
        ctx = WorkflowContext(
            prompt="p", answer="", prompt_ids=[1], index=3, is_eval=False,
            params=SamplingParams(max_new_tokens=100), tokenizer=None, generate=generate,
            score=None, version=lambda: 0, request_id=f"{group}:3",
        )  # fmt: skip
        traj = asyncio.run(LongTail(median=32, sigma=1.5, max_len=100).run(ctx))
        assert len(traj.output_ids) == target_length(0, "p", 3, 32, 1.5, 100, attempt)


def test_async_requeue_with_resample_gives_the_prompt_its_next_attempts_lengths():
    """The straggler of test_async_requeue_admits_a_dropped_prompt_again_before_new_ones, but
    the re-queued prompt's attempt 1 is 1 token long (`retry`): admitted at t = 4 beside prompt
    3, both end at 5, and the third step (5-6) trains it. 8 tokens (the straggler's 4 before
    its abort, then four groups of 1) in 5 decode steps (9 in 6 with its first lengths)."""
    w = Workload(slots=2, n=1, batch=1, eta=1, t0=1.0, train_a=1.0, steps=3, requeue=True,
                 resample=True)  # fmt: skip
    seen = []

    def retry(row, attempt):
        seen.append((row, attempt))
        return [1]

    a = simulate_async(w, GroupLengths(w, [[5]] + [[1]] * 20, retry))
    assert a.step_end == [2.0, 4.0, 6.0]
    assert a.dropped == 1
    assert seen[0] == (0, 1)
    assert a.gen_tokens == 8.0
    assert a.token_steps == 5.0


# ---------------------------------------------------------------------------- pipelined update


def test_pipelined_update_by_hand():
    # C = 2, n = 1, B = 1, eta = 1, every sample 2 tokens at 1 s each, train 1 s; the version is
    # served 0.5 + 1.0 s after its step (hand-over 0.5: the trainer is free then), generation
    # paused for the last 0.5 s. g0, g1 end at 2; g0 trains 2-3; hand-over to 3.5; g1 trains
    # 3.5-4.5 (staleness 0); v1 served at 4.5 (pause 4.0-4.5, nothing generating), which admits
    # g2 (accepted 2 + running 0 < (1 + 1 + 1) B); v2 served at max(4.5 + 1.5, 4.5) = 6.0,
    # pause 5.5-6.0: g2 generated 1 token in 4.5-5.5.
    w = Workload(slots=2, n=1, batch=1, eta=1, t0=1.0, train_a=1.0, steps=2, pipelined=True,
                 t_handover=0.5, t_sync=1.0, t_pause=0.5)  # fmt: skip
    a = simulate_async(w, _table(w, [[2]]))
    assert a.step_end == [4.5, 6.0]
    assert a.gen_tokens == 5.0
    assert a.staleness == {0: 2}
    assert a.train_busy_s == 2.0
    # sync: generate 2 + train 1 + hand-over 0.5 + served 1.0 per step
    assert simulate_sync(w, _table(w, [[2]])).step_end == [4.5, 9.0]
    # the tool's model with the same 1.5 s update: trainer and fleet wait all of it. g1 trains
    # 4.5-5.5 after v1; g2 (admitted at 4.5) generates 4.5-5.5; v2 at 5.5 + 1.5 = 7.0
    tool = replace(w, pipelined=False, t_sync=1.5)
    assert simulate_async(tool, _table(tool, [[2]])).step_end == [4.5, 7.0]


def test_pipelined_with_the_whole_update_on_the_path_is_the_tools_model():
    w = Workload(slots=16, n=4, batch=4, max_groups=4, len_median=20, len_sigma=1.2, max_len=300,
                 t0=0.01, alpha=0.6, train_a=0.2, train_b=1e-3, prompt_len=5, t_sync=0.1,
                 steps=25, seed=4, eta=2)  # fmt: skip
    same = replace(w, pipelined=True, t_handover=0.1, t_sync=0.0, t_pause=0.1)
    assert simulate_async(same).step_end == pytest.approx(simulate_async(w).step_end, abs=1e-9)
    assert simulate_sync(same).wall_s == pytest.approx(simulate_sync(w).wall_s, abs=1e-9)
