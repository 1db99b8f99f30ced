"""The system benchmark's model parameters, measured in its own run, and its results
(`system_efficiency`, `fleet_utilisation`) per eta; bench/system.py runs the experiments.

Parameters (all from the same run, `measure`):
- decode t(a) = t0 + c1 a: the engine replaying the workload's lengths at the fleet's
  concurrency, twice (before and after the experiments), on the rollout's core, the cluster idle;
  the fastest of the two at each occupancy (`bench.decode.fit_decode`);
- train seconds against padded tokens: the eta = 0 runs' StepMetrics (the trainer alone);
- the update as asyncrl runs it (`overlap.Workload.pipelined`): the trainer's hand-over (its
  serialise, StepMetrics.serialize_s), then the version served `t_sync` later (end of the
  trainer's train_step log record to the `trained` ledger event, which at eta <= 1 follows the
  fleet's load), generation paused only for the engine's load and resume (the rollout's
  `weights_updated` log), all medians over the runs;
- the engine's saturated rate: `bench.decode.saturation` on the rollout's core, best of two.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from bench import overlap, yardstick
from bench.decode import Decode, fit_line
from bench.report import Result

NAME = "system"
Lengths = Callable[[int, int], Sequence[int]]


@dataclass(frozen=True)
class Measured:
    decode: Decode
    train_a: float
    train_b: float
    t_handover: float
    t_sync: float
    t_pause: float
    saturated: dict[int, float]
    """Engine tokens/s by concurrency (the faster of two probes)."""

    @property
    def best(self) -> tuple[int, float]:
        """(concurrency, tokens/s) at the engine's best."""
        return max(self.saturated.items(), key=lambda kv: kv[1])


def measure_train(syncs, lengths: Lengths, n: int, prompt_len: int) -> tuple[float, float]:
    """(train_a, train_b) over padded tokens, from the synchronous runs' steps."""
    padded, seconds = [], []
    for sync in syncs:
        for v, prompts in sorted(sync.step_prompts.items()):
            longest = max(L for i, a in prompts for L in lengths(i, a))
            padded.append(len(prompts) * n * (longest + prompt_len))
            seconds.append(sync.step_time_s[v])
    return fit_line(padded, seconds)


def measure(records: dict, lengths: Lengths, plan, task, decode, saturated) -> Measured:
    syncs = records[0]
    train_a, train_b = measure_train(syncs, lengths, plan.n, task.prompt_len)
    pauses = [p for rs in records.values() for r in rs for p in r.pause_s]
    return Measured(
        decode=decode,
        train_a=train_a,
        train_b=train_b,
        t_handover=statistics.median(s for r in syncs for s in r.serialize_s),
        t_sync=statistics.median(u for r in syncs for u in r.update_s()),
        t_pause=statistics.median(pauses) if pauses else 0.0,
        saturated=saturated,
    )


def workload(plan, prompt_len: int, m: Measured, abort_lag: int) -> overlap.Workload:
    """The model of the run: the scheduler's rules and asyncrl's pipelined update."""
    return overlap.Workload(
        slots=plan.slots,
        n=plan.n,
        batch=plan.batch,
        max_groups=plan.max_groups,
        len_median=plan.median,
        len_sigma=plan.sigma,
        max_len=plan.max_len,
        prompt_len=prompt_len,
        t0=m.decode.t0,
        alpha=m.decode.c1 * plan.slots / m.decode.t0,
        train_a=m.train_a,
        train_b=m.train_b,
        padded=True,
        t_sync=m.t_sync,
        pipelined=True,
        t_handover=m.t_handover,
        t_pause=m.t_pause,
        steps=plan.steps,
        seed=plan.seed,
        abort_lag=abort_lag,
        requeue=True,
        resample=True,
    )


def tokens(prompts, lengths: Lengths) -> int:
    return sum(L for i, a in prompts for L in lengths(i, a))


def engine_use(r, lengths: Lengths) -> yardstick.EngineUse | None:
    e = r.engine
    if not e.get("steps"):
        return None
    trained = [p for ps in r.step_prompts.values() for p in ps]
    untrained = sorted(set(r.finished_prompts) - set(trained))
    return yardstick.EngineUse(
        wall_s=r.wall_s,
        trained_tokens=tokens(trained, lengths),
        generated_tokens=e["stream_steps"],
        rejected_tokens=tokens(r.rejected_prompts, lengths),
        untrained_tokens=tokens(untrained, lengths),
        steps=e["steps"],
        busy_s=e["step_seconds"],
        prefill_s=e.get("prefill_seconds", 0.0),
        pause_s=sum(r.pause_s),
    )


def _r(d: dict, digits: int = 4) -> dict:
    return {k: _r(v, digits) if isinstance(v, dict) else round(v, digits)
            if isinstance(v, float) else v for k, v in d.items()}  # fmt: skip


def efficiency_result(e: yardstick.Efficiency, r, sim: overlap.SimResult, extra: dict) -> Result:
    met = "met" if e.goal_met else "NOT met"
    bounded = "within" if e.bounded else "ABOVE"
    line = (f"system_efficiency eta={e.eta}: {e.value:.3f} (noise ±{e.noise:.3f}, {bounded} the "
            f"bound; goal >= {yardstick.EFFICIENCY_GOAL} {met}); speedup vs eta=0 measured "
            f"{e.measured_speedup:.2f}x, model {e.model_speedup:.2f}x")  # fmt: skip
    peer = "zero-overhead model at this eta (bench.overlap, this run's parameters)"
    settings = {
        "eta": e.eta, "efficiency": round(e.value, 4), "noise": round(e.noise, 4),
        "bounded": e.bounded, "goal": yardstick.EFFICIENCY_GOAL, "goal_met": e.goal_met,
        "measured_speedup": round(e.measured_speedup, 3),
        "model_speedup": round(e.model_speedup, 3),
        "wall_s": round(r.wall_s, 3), "model_wall_s": round(sim.wall_s, 3),
        "dropped": r.dropped, "model_dropped": sim.dropped,
        "staleness_max": r.staleness_max, "model_staleness_max": sim.max_staleness,
        "train_step_s_mean": round(float(np.mean(list(r.step_time_s.values()))), 4),
        "model_train_step_s_mean": round(sim.train_busy_s / len(sim.step_end), 4),
        "cpu_share": r.cpu_share, "load_avg": round(r.load_avg, 2), "ledger": r.fates,
        "summary": line, **extra,
    }  # fmt: skip
    return Result(NAME, "system_efficiency", e.measured, "samples/s", peer, e.model, settings)


def utilisation_result(eta: int, use: yardstick.EngineUse, m: Measured) -> Result:
    concurrency, rate = m.best
    util, losses = yardstick.losses(use, rate, m.decode.t0, m.decode.c1)
    parts = ", ".join(f"{k} {v:.3f}" for k, v in asdict(losses).items())
    line = f"fleet_utilisation eta={eta}: {util:.3f}; lost to: {parts}"
    peer = f"the engine's saturated rate on the rollout's core (best concurrency {concurrency})"
    settings = {
        "eta": eta, "utilisation": round(util, 4), "losses": _r(asdict(losses)),
        "losses_sum": round(losses.total(), 4), "engine_use": _r(asdict(use)),
        "saturation_by_concurrency": {k: round(v, 1) for k, v in m.saturated.items()},
        "summary": line,
    }  # fmt: skip
    return Result(NAME, "fleet_utilisation", use.trained_tokens / use.wall_s, "tokens/s", peer,
                  rate, settings)  # fmt: skip


def results(
    plan, records: dict, runs: dict, model: overlap.Ideal, variants: dict[str, overlap.Ideal],
    lengths: Lengths, m: Measured, common: dict,
) -> list[Result]:  # fmt: skip
    """Per eta: system_efficiency, then fleet_utilisation."""
    samples = plan.steps * plan.batch * plan.n
    repeats = [[samples / r.wall_s for r in rs] for rs in records.values()]
    effs = yardstick.efficiencies(
        {eta: samples / r.wall_s for eta, r in runs.items()},
        {eta: model.runs[eta].throughput for eta in runs},
        yardstick.noise(repeats),
    )
    out = []
    for e in effs:
        r = runs[e.eta]
        extra = {
            "walls_s": [round(x.wall_s, 3) for x in records[e.eta]],
            "model_variants": {  # samples/s at this eta: what each difference from the tool adds
                name: round(v.runs[e.eta].throughput, 4) for name, v in variants.items()
            },
            **common,
        }
        out.append(efficiency_result(e, r, model.runs[e.eta], extra))
        use = engine_use(r, lengths)
        if use:
            out.append(utilisation_result(e.eta, use, m))
    return out


def plot(effs: list[Result], tool: list[float], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = [r.settings["eta"] for r in effs]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(etas, [r.value for r in effs], "o-", label="measured (asyncrl)")
    ax.plot(etas, [r.peer_value for r in effs], "s--", label="model (the bound)")
    ax.plot(etas, tool, "^:", label="overlap_bound's model")
    ax.set_xlabel("eta (max staleness; 0 = synchronous)")
    ax.set_ylabel("trained samples / s")
    ax.set_xticks(etas)
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("long-tail workload: throughput against eta")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def variants(w: overlap.Workload, etas, table, lengths: Lengths) -> dict[str, overlap.Ideal]:
    """The same parameters in overlap_bound's model (`tool`: no re-queue, so other lengths
    after a drop, abort at once, the whole update on the trainer's and the fleet's path), and
    under the scheduler's rules with the whole update on the path (`rules_update_on_path`)."""
    on_path = replace(w, pipelined=False, t_sync=w.step_to_served)
    tool = replace(on_path, abort_lag=0, requeue=False, resample=False)
    return {
        "tool": overlap.ideal(tool, etas, table),
        "rules_update_on_path": overlap.ideal(on_path, etas, table, lengths),
    }
