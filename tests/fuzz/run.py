"""Drive the cases of `tests.fuzz.props` through hypothesis and collect what broke."""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field

from google.protobuf.descriptor import MethodDescriptor
from hypothesis import HealthCheck, given, settings

from tests.fuzz.cluster import FuzzCluster
from tests.fuzz.props import cases, check, path_of

SLOW_S = 5.0
"""A refused case longer than this (the call, the health checks, the victims' read) is a
finding: a request that holds a service up. (An accepted one may do real work: a
StartExperiment loads a model; an UNAVAILABLE one retried an unreachable dependency first, a
group whose reward addresses lead nowhere.)"""


@dataclass
class Finding:
    method: str
    identity: str
    problem: str
    request_hex: str
    """The request's bytes (the first 2,000 of them), hex."""


@dataclass
class Tally:
    cases: int = 0
    seconds: float = 0.0
    codes: dict[str, int] = field(default_factory=dict)
    details: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per method, the answers seen (code and the start of the message; the first 40)."""
    findings: list[Finding] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def fuzz_method(
    cluster: FuzzCluster,
    method: MethodDescriptor,
    examples: int,
    derandomize: bool,
    tally: Tally,
    stop_at: float | None = None,
) -> None:
    """`examples` cases of `method`; each finding is recorded once per (method, problem's
    first 60 characters) and the run goes on."""
    seen = {(f.method, re.sub(r"[0-9]+", "N", f.problem)[:60]) for f in tally.findings}
    path = path_of(method)

    @settings(
        max_examples=examples,
        derandomize=derandomize,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases(cluster, method))
    def one(case):
        if stop_at is not None and time.monotonic() > stop_at:
            return
        identity, data = case
        before = cluster.victims()
        start = time.monotonic()
        outcome, problems = check(cluster, method, identity, data, before)
        took = time.monotonic() - start
        tally.seconds += took
        details = tally.details.setdefault(path, {})
        if len(details) < 40:
            details.setdefault(f"{outcome.code.name}: {outcome.details[:100]}", 0)
        if took > SLOW_S and outcome.code.name not in ("OK", "UNAVAILABLE"):
            problems.append(f"slow: {took:.1f} s ({outcome.code.name})")
        tally.cases += 1
        tally.codes[outcome.code.name] = tally.codes.get(outcome.code.name, 0) + 1
        for problem in problems:
            key = (path, re.sub(r"[0-9]+", "N", problem)[:60])
            if key not in seen:
                seen.add(key)
                tally.findings.append(Finding(path, identity, problem, data[:2000].hex()))

    one()
