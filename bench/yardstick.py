"""The system benchmark's yardsticks (pure functions, exact arithmetic; tests/unit).

- `system_efficiency` at one eta: trained samples/s measured ÷ the zero-overhead model's at that
  eta, the model fed with the parameters measured in the same run. The model leaves out every
  cost of a real system (control plane, prefill, contention), so it is an upper bound and the
  efficiency is at most 1.0 up to the measurement's noise (`spread`).
- `fleet_utilisation` at one eta: tokens trained per second ÷ the engine's saturated rate on
  this machine (tokens/s at its best concurrency, `bench.decode.saturation`), with the gap split
  into what the capacity was lost to (`Losses`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

EFFICIENCY_GOAL = 0.85
"""Issue 24: measured ÷ model at every eta on the long-tail workload."""


def spread(values: Sequence[float]) -> float:
    """Relative spread of repeated measurements of one quantity: (max - min) / max."""
    if not values or max(values) <= 0:
        return 0.0
    return (max(values) - min(values)) / max(values)


def noise(repeats: Sequence[Sequence[float]]) -> float:
    """The run's stated noise on a throughput: the largest `spread` among its repeated
    measurements (the throughputs of each eta's repeats)."""
    return max((spread(r) for r in repeats), default=0.0)


@dataclass(frozen=True)
class Efficiency:
    eta: int
    measured: float
    """Trained samples/s (the fastest repeat)."""
    model: float
    """The model's trained samples/s at this eta."""
    measured_speedup: float
    """Against the measured eta = 0."""
    model_speedup: float
    """Against the model's eta = 0."""
    noise: float

    @property
    def value(self) -> float:
        return self.measured / self.model

    @property
    def bounded(self) -> bool:
        """The model bounds the measurement: efficiency <= 1 + noise."""
        return self.value <= 1.0 + self.noise

    @property
    def goal_met(self) -> bool:
        return self.value >= EFFICIENCY_GOAL


def efficiencies(
    measured: dict[int, float], model: dict[int, float], noise_: float
) -> list[Efficiency]:
    """Per eta: measured and model throughput, each speedup against its own eta = 0."""
    return [
        Efficiency(
            eta=eta,
            measured=measured[eta],
            model=model[eta],
            measured_speedup=measured[eta] / measured[0],
            model_speedup=model[eta] / model[0],
            noise=noise_,
        )
        for eta in sorted(measured)
    ]


@dataclass(frozen=True)
class EngineUse:
    """What the rollout engine did over one run's wall time (first dispatch to the N-th commit)."""

    wall_s: float
    trained_tokens: int
    """Output tokens of the groups the N steps trained."""
    generated_tokens: float
    """Tokens the engine sampled (its stream_steps counter)."""
    rejected_tokens: int
    """Output tokens of groups the filter rejected."""
    untrained_tokens: int
    """Output tokens of groups finished but not trained by the N-th step."""
    steps: float
    """Decode steps (each samples one token per active stream)."""
    busy_s: float
    """Seconds in steps, prefills included."""
    prefill_s: float
    pause_s: float
    """Seconds generation stood still for weight updates (load + resume of each)."""


@dataclass(frozen=True)
class Losses:
    """Shares of the engine's capacity over the wall (saturated tokens/s x wall) that did not
    end up trained; with `utilisation` they sum to 1."""

    stale: float
    """Tokens of groups dropped or aborted as too stale (and of groups still generating at the
    end): generated - trained - rejected - untrained."""
    filter_rejects: float
    untrained_at_end: float
    tail: float
    """Steps with fewer streams than the best concurrency: the fitted cost of the steps taken
    (steps t0 + c1 tokens) at the saturated rate, less the tokens they sampled."""
    slow_steps: float
    """Decode steps slower than the fit (the core shared, the service's own work)."""
    prefill: float
    update_pauses: float
    waiting: float
    """The engine idle: no stream to step (waiting for admission, i.e. for the trainer)."""

    def total(self) -> float:
        return sum(asdict(self).values())


def losses(use: EngineUse, saturated: float, t0: float, c1: float) -> tuple[float, Losses]:
    """(fleet_utilisation, its Losses) for `use` against the engine's saturated tokens/s and
    its fitted decode cost t(a) = t0 + c1 a."""
    cap = saturated * use.wall_s
    decode_s = use.busy_s - use.prefill_s
    fitted = use.steps * t0 + c1 * use.generated_tokens
    wasted = use.generated_tokens - use.trained_tokens
    return use.trained_tokens / cap, Losses(
        stale=(wasted - use.rejected_tokens - use.untrained_tokens) / cap,
        filter_rejects=use.rejected_tokens / cap,
        untrained_at_end=use.untrained_tokens / cap,
        tail=(saturated * fitted - use.generated_tokens) / cap,
        slow_steps=saturated * (decode_s - fitted) / cap,
        prefill=saturated * use.prefill_s / cap,
        update_pauses=saturated * use.pause_s / cap,
        waiting=saturated * (use.wall_s - use.busy_s - use.pause_s) / cap,
    )
