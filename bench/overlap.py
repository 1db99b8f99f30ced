"""The ideal speedup of asynchronous over synchronous RL for one workload: a zero-overhead
model, as an analytic bound and a discrete-event simulation (pure functions, numpy only).

The model is the one `../shared/tools/overlap_bound/README.md` states; this is the
benchmark's own implementation of it, checked against that tool in
tests/unit/test_overlap_model.py.

- Fleet: `slots` (C) continuous-batching slots, one sample each. While `a` slots are active,
  every active sample gains one token per `t_tok(a) = t0 * (1 + alpha * a / C)` seconds.
  Samples waiting for a slot queue FIFO. One shared token clock (tokens per active stream)
  makes this exact for any alpha: a sample admitted to a slot at clock s ends at s + L.
- Lengths: group g has n output lengths (a table, cycled, or a seeded lognormal:
  clip(round(median * exp(sigma * Z)), 1, max_len)). Sync and async see the same groups in
  the same order.
- Training: a step takes B groups and lasts `train_a + train_b * tokens`, tokens = the sum of
  (L + prompt_len) over its B*n samples, or with `padded` (a trainer that pads every sample
  to the batch's longest) B*n * (max L + prompt_len).
- Weight update: after each step, `t_sync` seconds in which the trainer is busy and no token
  is generated and no group admitted; in-flight samples keep their progress. The version v
  rises by one at its end; a run of N steps ends with the N-th update.
- `pipelined` (not in the tool's model): the update as asyncrl's trainer runs it
  (services/trainer/publish.py). After a step the trainer is busy only `t_handover` seconds
  (serialising the version), then may train the next step while the version is written,
  committed and loaded by the fleet in the background; the version is served (v rises, admission
  opens) `t_handover + t_sync` seconds after the step's end, and generation pauses only for the
  last `t_pause` of them (the engine copying the weights in). Without it the trainer and the
  fleet both wait the whole `t_sync` (the tool's model), i.e. `t_handover = t_pause = t_sync`.
- Sync: generate B groups, wait for all, train, update; repeat.
- Async (AReaL's admission): a group is admitted at version v while
  `running < max_groups and accepted + running < (eta + v + 1) * B`; the trainer starts a
  step once it is idle and B finished groups are buffered, taking the oldest. After each
  update every group admitted before version v - eta is dropped (buffered ones) or aborted
  (running ones, freeing their slots) and counts as rejected: it leaves `accepted`, which gives
  back admission capacity. So no trained group is staler than eta.
- `abort_lag` (not in the tool's model; 0 there): running groups are aborted that many versions
  later, as asyncrl's scheduler does (`services.scheduler.policy.must_abort`: the step that
  produced v may have trained a group whose reply is still on its way, so it aborts only what
  even that step could not have trained). Meanwhile the group holds its slots and its place in
  the admission count; if it finishes too stale, the trainer drops it when it reads it.
- `requeue` (not in the tool's model): a dropped group's prompt is admitted again before any
  new one, as the scheduler re-queues it (no prompt is lost), as its next attempt: with the
  same lengths, or with `resample` new ones (a policy samples a prompt afresh; `GroupLengths`
  says which). Without it a dropped group is gone and the next admission is a new group.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

INF = math.inf


@dataclass(frozen=True)
class Workload:
    """One workload and the system's measured costs (seconds)."""

    slots: int
    """C: concurrent generation slots (samples)."""
    n: int
    """Samples per group."""
    batch: int
    """B: groups per training step."""
    eta: int = 0
    """Max staleness (async only)."""
    max_groups: int = 0
    """Cap on running groups; 0 means max(1, C // n), -1 no cap."""
    len_median: float = 32.0
    len_sigma: float = 1.5
    max_len: int = 1024
    prompt_len: int = 0
    """Tokens per sample the trainer processes besides the output."""
    t0: float = 0.001
    """Seconds per token of a stream when it is alone (a -> 0)."""
    alpha: float = 0.0
    """Slow-down of a full fleet: t_tok(C) = t0 * (1 + alpha)."""
    train_a: float = 0.0
    train_b: float = 0.0
    padded: bool = False
    """Training cost counts every sample at the batch's longest length."""
    t_sync: float = 0.0
    pipelined: bool = False
    """The update runs beside the next step (see the module docstring); not in the tool's model."""
    t_handover: float = 0.0
    """With `pipelined`: the trainer's seconds after a step before it may train the next."""
    t_pause: float = 0.0
    """With `pipelined`: the seconds of each update during which generation stops."""
    steps: int = 20
    seed: int = 0
    abort_lag: int = 0
    """Versions a too-stale running group goes on before it is aborted (see the module
    docstring): 0 in the tool's model, 1 in asyncrl's scheduler."""
    requeue: bool = False
    """Dropped groups' prompts are admitted again first (asyncrl's scheduler); not in the
    tool's model."""
    resample: bool = False
    """A re-queued prompt's next attempt draws new lengths (else it repeats its first ones)."""

    @property
    def m(self) -> int:
        """Samples per training step, B * n."""
        return self.batch * self.n

    @property
    def group_cap(self) -> float:
        if self.max_groups < 0:
            return INF
        return self.max_groups or max(1, self.slots // self.n)

    def t_tok(self, active: int) -> float:
        return self.t0 * (1.0 + self.alpha * active / self.slots)

    @property
    def trainer_after_step(self) -> float:
        """Seconds the trainer is busy after each step before it may start the next."""
        return self.t_handover if self.pipelined else self.t_sync

    @property
    def step_to_served(self) -> float:
        """Seconds from a step's end until the fleet serves its version."""
        return self.t_handover + self.t_sync if self.pipelined else self.t_sync

    @property
    def pause(self) -> float:
        """Seconds of each update in which no token is generated and no group admitted."""
        return min(self.t_pause, self.step_to_served) if self.pipelined else self.t_sync

    def train_time(self, lengths: Sequence[int]) -> float:
        """Duration of a step that trains samples of these output lengths."""
        if self.padded:
            tokens = len(lengths) * (max(lengths) + self.prompt_len)
        else:
            tokens = sum(lengths) + len(lengths) * self.prompt_len
        return self.train_a + self.train_b * tokens


class GroupLengths:
    """Group g -> its n output lengths: `table[g % len(table)]`, or row g of one seeded
    lognormal stream (drawn in fixed chunks, so a row never depends on who asks first).
    Attempt k >= 1 of a re-queued row, with `w.resample`: `retry(g, k)`, or by default a
    lognormal draw seeded by (seed, g, k)."""

    CHUNK = 512

    def __init__(
        self,
        w: Workload,
        table: Sequence[Sequence[int]] | None = None,
        retry: Callable[[int, int], Sequence[int]] | None = None,
    ):
        self.w = w
        self.retry = retry
        self.table = [tuple(int(x) for x in row) for row in table] if table else None
        if self.table and any(len(row) != w.n for row in self.table):
            raise ValueError(f"every row of the length table needs n={w.n} lengths")
        self._rng = np.random.default_rng(w.seed)
        self._rows: list[tuple[int, ...]] = []

    def __call__(self, g: int, attempt: int = 0) -> tuple[int, ...]:
        if attempt and self.w.resample:
            return (
                tuple(int(x) for x in self.retry(g, attempt))
                if self.retry
                else self._draw(g, attempt)
            )
        if self.table:
            return self.table[g % len(self.table)]
        while g >= len(self._rows):
            w = self.w
            draw = w.len_median * np.exp(w.len_sigma * self._rng.standard_normal((self.CHUNK, w.n)))
            rows = np.clip(np.rint(draw), 1, w.max_len).astype(int)
            self._rows.extend(tuple(int(x) for x in row) for row in rows)
        return self._rows[g]

    def _draw(self, g: int, attempt: int) -> tuple[int, ...]:
        w = self.w
        rng = np.random.default_rng([w.seed, g, attempt])
        draw = w.len_median * np.exp(w.len_sigma * rng.standard_normal(w.n))
        return tuple(int(x) for x in np.clip(np.rint(draw), 1, w.max_len))


# ---------------------------------------------------------------------------- analytic


def lognormal_cdf(median: float, sigma: float, max_len: int) -> np.ndarray:
    """F[x] = P(L <= x), x = 0..max_len, for L = clip(round(median * e^(sigma Z)), 1, max_len)."""
    xs = np.arange(max_len + 1, dtype=float)
    if sigma == 0:
        return (xs >= min(max(round(median), 1), max_len)).astype(float)
    z = (np.log(np.maximum(xs, 1.0) + 0.5) - math.log(median)) / sigma
    cdf = 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in z]))
    cdf[0], cdf[max_len] = 0.0, 1.0
    return cdf


def empirical_cdf(lengths: Sequence[int], max_len: int) -> np.ndarray:
    """F[x] = share of `lengths` (clipped to [1, max_len]) that are <= x, x = 0..max_len."""
    values = np.sort(np.clip(np.asarray(lengths, dtype=int), 1, max_len))
    return np.searchsorted(values, np.arange(max_len + 1), side="right") / len(values)


def expected_length(cdf: np.ndarray) -> float:
    """E[L] = sum over x >= 0 of P(L > x)."""
    return float(np.sum(1.0 - cdf[:-1]))


def expected_max(cdf: np.ndarray, m: int) -> float:
    """E[max of m independent lengths] = sum over x >= 0 of (1 - F(x)^m)."""
    return float(np.sum(1.0 - cdf[:-1] ** m))


def t_gen_sync(w: Workload, e_len: float, e_max: float) -> float:
    """Expected generation time of one synchronous step. With C >= m, exact: over token
    interval x the A(x) samples longer than x are active, E[A(x)] = m P(L > x). With C < m, a
    lower bound: the longest sample, or the fleet's time for all the tokens."""
    if w.slots >= w.m:
        return w.t0 * (e_max + w.alpha * w.m * e_len / w.slots)
    return max(w.t0 * e_max, t_gen_throughput(w, e_len))


def t_gen_throughput(w: Workload, e_len: float) -> float:
    """A full fleet's time to generate one step's tokens: m E[L] t_tok(C) / C."""
    return w.m * e_len * w.t_tok(w.slots) / w.slots


def expected_train_time(w: Workload, e_len: float, e_max: float) -> float:
    per_sample = (e_max if w.padded else e_len) + w.prompt_len
    return w.train_a + w.train_b * w.m * per_sample


def speedup_bound(gen_sync: float, gen_tp: float, train: float, t_sync: float) -> float:
    """Sync step over the shortest async step. Generation also pauses during every update, so
    an async step lasts at least t_sync + max(generation at full throughput, training)."""
    return (gen_sync + train + t_sync) / (t_sync + max(gen_tp, train))


@dataclass(frozen=True)
class Bound:
    e_len: float
    e_max: float
    t_gen_sync: float
    t_gen_throughput: float
    t_train: float
    t_sync: float
    speedup: float
    """`speedup_bound`: the ceiling for any eta."""
    exact: bool
    """T_gen_sync is exact in expectation (C >= m), else a lower bound."""


def analytic(w: Workload, lengths: Sequence[int] | None = None) -> Bound:
    """The bound for the lognormal of `w`, or for the empirical distribution of `lengths`."""
    cdf = (
        empirical_cdf(lengths, w.max_len)
        if lengths
        else lognormal_cdf(w.len_median, w.len_sigma, w.max_len)
    )
    e_len, e_max = expected_length(cdf), expected_max(cdf, w.m)
    gen_sync, gen_tp = t_gen_sync(w, e_len, e_max), t_gen_throughput(w, e_len)
    train = expected_train_time(w, e_len, e_max)
    return Bound(
        e_len=e_len,
        e_max=e_max,
        t_gen_sync=gen_sync,
        t_gen_throughput=gen_tp,
        t_train=train,
        t_sync=w.t_sync,
        speedup=speedup_bound(gen_sync, gen_tp, train, w.t_sync),
        exact=w.slots >= w.m,
    )


# ---------------------------------------------------------------------------- simulation


@dataclass
class SimResult:
    mode: str  # sync | async
    eta: int
    wall_s: float
    step_end: list[float]
    throughput: float
    """Trained samples per second: N B n / wall."""
    train_busy_s: float
    slot_util: float
    """Integral of active slots over C * wall."""
    staleness: Counter = field(default_factory=Counter)
    """Trained groups by staleness."""
    dropped: int = 0
    gen_tokens: float = 0.0
    token_steps: float = 0.0
    """The token clock's advance while any sample was active: the decode steps an engine that
    samples one token per active stream per step takes (its steps counter)."""

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)

    @property
    def mean_active(self) -> float:
        """Active streams per decode step (an engine's tokens / steps): the admission rule's
        mark on the fleet, comparable with the rollout's engine counters."""
        return self.gen_tokens / self.token_steps if self.token_steps else 0.0

    def steady_throughput(self, m: int) -> float:
        """Samples per second over the second half of the steps (no warm-up)."""
        half = len(self.step_end) // 2
        if not half:
            return self.throughput
        return (len(self.step_end) - half) * m / (self.step_end[-1] - self.step_end[half - 1])


class _Fleet:
    """C slots on one token clock `tau`; each active entry is (tau at its end, seq, group,
    tau at its start)."""

    def __init__(self, w: Workload):
        self.w = w
        self.tau = 0.0
        self.active: list[tuple[float, int, int, float]] = []
        self.waiting: deque[tuple[int, int]] = deque()
        self._seq = 0
        self.slot_time = 0.0
        self.tokens = 0.0
        self.steps = 0.0
        """Token clock advanced with at least one sample active."""

    def submit(self, group: int, length: int) -> None:
        self.waiting.append((group, length))

    def fill(self) -> None:
        while self.waiting and len(self.active) < self.w.slots:
            group, length = self.waiting.popleft()
            heapq.heappush(self.active, (self.tau + length, self._seq, group, self.tau))
            self._seq += 1

    def time_to_next_end(self) -> float:
        if not self.active:
            return INF
        return (self.active[0][0] - self.tau) * self.w.t_tok(len(self.active))

    def run_to_next_end(self) -> tuple[float, list[int]]:
        """Generate until the next sample(s) end: (seconds taken, their groups)."""
        dt = self.time_to_next_end()
        self._account(dt, self.active[0][0] - self.tau)
        self.tau = self.active[0][0]
        ended = []
        while self.active and self.active[0][0] <= self.tau:
            ended.append(heapq.heappop(self.active)[2])
        return dt, ended

    def run_for(self, seconds: float) -> None:
        """Generate for `seconds` without reaching the next end."""
        if self.active and seconds > 0:
            dtau = seconds / self.w.t_tok(len(self.active))
            self._account(seconds, dtau)
            self.tau += dtau

    def abort(self, groups: set[int]) -> None:
        self.active = [e for e in self.active if e[2] not in groups]
        heapq.heapify(self.active)
        self.waiting = deque(e for e in self.waiting if e[0] not in groups)

    def _account(self, seconds: float, dtau: float) -> None:
        self.slot_time += len(self.active) * seconds
        self.tokens += len(self.active) * dtau
        self.steps += dtau


def simulate_sync(w: Workload, lengths: GroupLengths | None = None) -> SimResult:
    """Generate B groups, wait for all, train, update: N times."""
    lengths = lengths or GroupLengths(w)
    fleet, t, busy, step_end = _Fleet(w), 0.0, 0.0, []
    for k in range(w.steps):
        batch = [L for g in range(k * w.batch, (k + 1) * w.batch) for L in lengths(g)]
        for L in batch:
            fleet.submit(k, L)
        fleet.fill()
        while fleet.active:
            dt, _ = fleet.run_to_next_end()
            t += dt
            fleet.fill()
        train = w.train_time(batch)
        busy += train
        t += train + w.step_to_served
        step_end.append(t)
    return SimResult(
        mode="sync",
        eta=0,
        wall_s=t,
        step_end=step_end,
        throughput=w.steps * w.m / t,
        train_busy_s=busy,
        slot_util=fleet.slot_time / (w.slots * t),
        staleness=Counter({0: w.steps * w.batch}),
        gen_tokens=fleet.tokens,
        token_steps=fleet.steps,
    )


class _AsyncRun:
    """The state of one asynchronous simulation; `run` is the event loop."""

    def __init__(self, w: Workload, lengths: GroupLengths):
        self.w, self.lengths, self.fleet = w, lengths, _Fleet(w)
        self.t = 0.0
        self.version = self.accepted = self.running = self.admitted = 0
        self.group_version: list[int] = []
        self.row: list[tuple[int, int]] = []  # each admitted group's (prompt row, attempt)
        self.requeued: deque[tuple[int, int]] = deque()  # dropped prompts' next attempts, first
        self.rows_used = 0  # new prompts admitted so far
        self.left: list[int] = []  # samples of each group still generating
        self.live: set[int] = set()  # admitted, not finished, not aborted
        self.buffer: list[int] = []  # finished, untrained (heap: oldest first)
        self.trainer_until, self.training = INF, False
        self.updates: deque[tuple[float, float]] = deque()  # (pause starts, served) per version
        self.step_end: list[float] = []
        self.staleness: Counter = Counter()
        self.busy = 0.0
        self.dropped = 0

    def run(self) -> SimResult:
        w = self.w
        while len(self.step_end) < w.steps:
            if not self.paused:
                self._admit()
            self._start_step()
            gen = INF if self.paused else self.t + self.fleet.time_to_next_end()
            event = self._next_event()
            if gen == INF and event == INF:
                raise RuntimeError(f"deadlock at t={self.t}: v={self.version}")
            if gen <= event:  # ties: the sample ends first
                dt, ended = self.fleet.run_to_next_end()
                self.t += dt
                self._ended(ended)
                continue
            if not self.paused:
                self.fleet.run_for(event - self.t)
            self.t = event
            self._events()
        return SimResult(
            mode="async",
            eta=w.eta,
            wall_s=self.t,
            step_end=self.step_end,
            throughput=w.steps * w.m / self.t,
            train_busy_s=self.busy,
            slot_util=self.fleet.slot_time / (w.slots * self.t),
            staleness=self.staleness,
            dropped=self.dropped,
            gen_tokens=self.fleet.tokens,
            token_steps=self.fleet.steps,
        )

    def _admit(self) -> None:
        w = self.w
        while (
            self.running < w.group_cap
            and self.accepted + self.running < (w.eta + self.version + 1) * w.batch
        ):
            g = self.admitted
            self.row.append(self.requeued.popleft() if self.requeued else (self._next_row(), 0))
            self.admitted += 1
            self.running += 1
            self.group_version.append(self.version)
            self.left.append(w.n)
            self.live.add(g)
            for L in self.lengths(*self.row[g]):
                self.fleet.submit(g, L)
        self.fleet.fill()

    def _start_step(self) -> None:
        if self.trainer_until != INF or len(self.buffer) < self.w.batch:  # busy, or too few
            return
        batch = [heapq.heappop(self.buffer) for _ in range(self.w.batch)]
        for g in batch:
            self.staleness[self.version - self.group_version[g]] += 1
        dur = self.w.train_time([L for g in batch for L in self.lengths(*self.row[g])])
        self.busy += dur
        self.training, self.trainer_until = True, self.t + dur

    def _ended(self, groups: list[int]) -> None:
        for g in groups:
            self.left[g] -= 1
            if self.left[g] == 0 and g in self.live:
                self.live.discard(g)
                self.running -= 1
                if self.group_version[g] < self.version - self.w.eta:  # only with abort_lag
                    self._dropped([g])  # the trainer drops it when it reads it: a rejection
                    continue
                self.accepted += 1
                heapq.heappush(self.buffer, g)
        self.fleet.fill()

    @property
    def paused(self) -> bool:
        """Generation stops while an update's pause is under way."""
        return any(start <= self.t < end for start, end in self.updates)

    def _next_event(self) -> float:
        """The trainer's next event, or an update's pause starting or its version served."""
        later = [x for start, end in self.updates for x in (start, end) if x > self.t]
        return min([self.trainer_until, *later])

    def _events(self) -> None:
        """What is due at `t`, in this order: a step ends (its update is scheduled: served
        `step_to_served` later, no earlier than the previous version), versions are served,
        the trainer is free again."""
        w = self.w
        if self.training and self.trainer_until <= self.t:
            self.training = False
            served = self.t + w.step_to_served
            if self.updates:
                served = max(served, self.updates[-1][1])
            self.updates.append((served - w.pause, served))
            self.trainer_until = self.t + w.trainer_after_step
        while self.updates and self.updates[0][1] <= self.t:
            self.updates.popleft()
            self.version += 1
            self.step_end.append(self.t)
            self._drop_stale()
        if not self.training and self.trainer_until <= self.t:
            self.trainer_until = INF

    def _drop_stale(self) -> None:
        oldest_ok = self.version - self.w.eta  # admitted before it: can never be trained
        while self.buffer and self.group_version[self.buffer[0]] < oldest_ok:
            self._dropped([heapq.heappop(self.buffer)])
            self.accepted -= 1  # reported as rejected: frees admission capacity
        doomed = {g for g in self.live if self.group_version[g] < oldest_ok - self.w.abort_lag}
        if doomed:
            self.live -= doomed
            self.running -= len(doomed)
            self._dropped(sorted(doomed))
            self.fleet.abort(doomed)

    def _dropped(self, groups: list[int]) -> None:
        self.dropped += len(groups)
        if self.w.requeue:
            self.requeued.extend(
                (row, attempt + 1) for row, attempt in (self.row[g] for g in groups)
            )

    def _next_row(self) -> int:
        self.rows_used += 1
        return self.rows_used - 1


def simulate_async(w: Workload, lengths: GroupLengths | None = None) -> SimResult:
    """AReaL's admission with bounded staleness eta (see the module docstring)."""
    return _AsyncRun(w, lengths or GroupLengths(w)).run()


@dataclass(frozen=True)
class Ideal:
    """The model's answer for one workload at several eta."""

    bound: Bound
    sync: SimResult
    runs: dict[int, SimResult]
    sync_workload: Workload

    def speedup(self, eta: int) -> float:
        """Simulated async / sync wall time over the same N steps (eta 0: async at eta 0)."""
        return self.sync.wall_s / self.runs[eta].wall_s


def ideal(
    w: Workload,
    etas: Sequence[int],
    table: Sequence[Sequence[int]] | None = None,
    retry: Callable[[int, int], Sequence[int]] | None = None,
) -> Ideal:
    """Sync and async at each eta on the same groups, and the analytic bound."""
    flat = [L for row in table for L in row] if table else None
    runs = {eta: simulate_async(replace(w, eta=eta), GroupLengths(w, table, retry)) for eta in etas}
    return Ideal(analytic(w, flat), simulate_sync(w, GroupLengths(w, table)), runs, w)
