"""The chaos report, pure: one row per run from what the run recorded (its faults, the version
timeline it polled, the ledger and status JSON), the suite's verdict, and the table.

A run's row:

    fault, at_version       the scenario and the version the first fault hit
    faults                  every injection: {what, at_version, at_s, recovery_s}
    completed, state        the experiment ended COMPLETED (state: its final state)
    steps, lost, trained_twice, failed, filtered, left_over, in_flight, quarantined,
    duplicates, trained_groups   from `asyncrl ledger ID --json`
    replayed                the trainer's count of replayed (already trained) groups it skipped,
                            summed over the status history
    expected_groups         steps x B (the ledger agrees with the trainer when trained == it)
    recovery_s              the slowest fault's time from injection to new progress (faults
                            the run ended right after, without new progress, are left out)
    stall_s                 the longest time without a new version around any fault
                            (`stall_s`); judged against the scenario's max_stall_s
    wall_s                  submit to the end of the experiment
"""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

COLUMNS = (
    "fault",
    "at_version",
    "completed",
    "steps",
    "lost",
    "trained_twice",
    "failed",
    "quarantined",
    "recovery_s",
    "stall_s",
    "wall_s",
)


def recovery_s(timeline: list[tuple[float, int]], fault: dict) -> float | None:
    """Seconds from the fault to new progress: the first version past every version seen
    until the faulted process was back (`back_s` after the fault; the fault itself when
    nothing was restarted). In-flight commits that land just after a kill, and steps trained
    again after a rewind to a checkpoint, do not count. None when no new progress came."""
    at_s = fault["at_s"]
    back = at_s + (fault.get("back_s") or 0.0)
    peak = max([fault["at_version"], *(v for t, v in timeline if t <= back)])
    for t, version in timeline:
        if t > back and version > peak:
            return round(t - at_s, 2)
    return None


def stall_s(timeline: list[tuple[float, int]], fault: dict) -> float | None:
    """The longest time the run stood still around the fault: the longest gap between two
    version changes from the last one before the fault until the end of the fault (`done_s`:
    its service replaced and new progress made; without it, the recovery; without that, the
    run's end). None when the run made no progress after the fault."""
    end = fault.get("done_s")
    recovered = recovery_s(timeline, fault)
    if end is None and recovered is not None:
        end = fault["at_s"] + recovered
    elif end is None:
        end = timeline[-1][0] if timeline else fault["at_s"]
    times = [t for t, _ in timeline]
    before = [t for t in times if t <= fault["at_s"]]
    points = [before[-1] if before else fault["at_s"]]
    points += [t for t in times if fault["at_s"] < t <= end]
    gaps = [b - a for a, b in zip(points, points[1:], strict=False)]
    return round(max(gaps), 2) if gaps else None


def lowest_after(timeline: list[tuple[float, int]], fault: dict) -> int | None:
    """The lowest version seen after the fault (below at_version: the run was rewound)."""
    seen = [v for t, v in timeline if t >= fault["at_s"]]
    return min(seen) if seen else None


def with_recovery(faults: list[dict], timeline: list[tuple[float, int]]) -> list[dict]:
    return [
        f
        | {
            "recovery_s": recovery_s(timeline, f),
            "lowest_after": lowest_after(timeline, f),
            "stall_s": stall_s(timeline, f),
        }
        for f in faults
    ]


def make_row(run: dict, ledger: dict, status: dict) -> dict:
    """The report row of one run. `run`: fault, faults, timeline, wall_s, batch_size (and any
    extra keys, kept); `ledger`: the ledger JSON; `status`: the status JSON."""
    totals = ledger.get("totals", {})
    faults = with_recovery(run["faults"], run["timeline"])
    recoveries = [f["recovery_s"] for f in faults if f["recovery_s"] is not None]
    stalls = [f["stall_s"] for f in faults if f["stall_s"] is not None]
    state = str(status.get("state", "UNKNOWN")).removeprefix("EXPERIMENT_STATE_")
    steps = ledger.get("steps", 0)
    extra = {k: v for k, v in run.items() if k not in ("faults", "timeline")}
    return extra | {
        "at_version": faults[0]["at_version"] if faults else None,
        "faults": faults,
        "completed": state == "COMPLETED",
        "state": state,
        "message": status.get("message", ""),
        "steps": steps,
        **{fate: totals.get(fate, 0) for fate in ("trained", "trained_twice", "lost")},
        **{fate: totals.get(fate, 0) for fate in ("failed", "filtered", "left_over")},
        "in_flight": totals.get("in_flight", 0),
        "quarantined": ledger.get("quarantined", 0),
        "duplicates": ledger.get("duplicates", 0),
        "replayed": sum(int(h.get("replayed", 0)) for h in status.get("history", [])),
        "trained_groups": ledger.get("trained_groups", 0),
        "failed_reasons": sorted(
            {p.get("reason", "") for p in ledger.get("prompts", []) if p.get("fate") == "failed"}
        ),
        "expected_groups": steps * run.get("batch_size", 0),
        "recovery_s": max(recoveries, default=None),
        "stall_s": max(stalls, default=None),
    }


def problems(row: dict) -> list[str]:
    """What makes a run fail the acceptance: not COMPLETED, a prompt lost or trained twice, an
    infrastructure fault turned into a failed prompt, poison not quarantined (or a replay not
    skipped as one), trained groups
    that are not steps x B."""
    found = []
    if not row.get("completed"):
        found.append(f"ended {row.get('state')}: {row.get('message', '')}".strip())
    for key in ("lost", "trained_twice", "in_flight"):
        if row.get(key):
            found.append(f"{key}={row[key]}")
    if row.get("infrastructure", True) and row.get("failed"):
        found.append(f"failed={row['failed']}")
    for key in ("quarantined", "replayed"):
        expected = row.get(f"expect_{key}", 0)
        if row.get(key, 0) < expected:
            found.append(f"{key} {row.get(key, 0)} < {expected}")
    expected = row.get("expect_failed_reasons")
    if expected and not row.get("failed"):
        found.append(f"no prompt failed with {expected}")
    elif expected and any(all(e not in r for e in expected) for r in row["failed_reasons"]):
        found.append(f"a failed prompt's reason is none of {expected}: {row['failed_reasons']}")
    if row.get("completed") and not row.get("steps"):
        found.append("the ledger has no steps")
    if row.get("steps") and row.get("trained_groups") != row.get("expected_groups"):
        found.append(f"trained_groups {row['trained_groups']} != {row['expected_groups']}")
    limit = row.get("max_stall_s")
    if limit is not None and row.get("stall_s") is None:
        found.append("no stall measured (no fault followed by progress)")
    elif limit is not None and row["stall_s"] > limit:
        found.append(f"stalled {row['stall_s']} s > {limit} s")
    if row.get("error"):
        found.append(row["error"])
    return found


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    if key == "completed":
        return "[green]yes[/green]" if value else f"[red]{escape(str(row.get('state')))}[/red]"
    if key in ("lost", "trained_twice", "failed") and value:
        return f"[red]{value}[/red]"
    return "-" if value is None else str(value)


def table(rows: list[dict], title: str = "make chaos") -> Table:
    t = Table(title=title)
    for col in ("run", *COLUMNS, "verdict"):
        t.add_column(col, justify="left" if col in ("run", "fault", "verdict") else "right")
    for row in rows:
        issues = problems(row)
        verdict = (
            "[green]ok[/green]" if not issues else "[red]" + escape("; ".join(issues)) + "[/red]"
        )
        t.add_row(row.get("run", ""), *(_cell(row, c) for c in COLUMNS), verdict)
    return t
