"""Benchmarks: `python -m bench [--quick] [--only NAME]` (or `make bench`).

Every result is a ratio against a peer measured in the same run (a competing implementation,
the same thing without the feature, or a limit), so a report stays meaningful on a loaded or
slower machine. Each benchmark module exposes `run(ctx) -> list[Result]`; `BENCHMARKS` maps
the names accepted by `--only` to those modules (imported lazily: megatron is slow to import).
"""

from __future__ import annotations

BENCHMARKS: dict[str, str] = {
    "rollout": "bench.rollout",
    "interrupt": "bench.interrupt",
    "trainer": "bench.trainer",
    "transport": "bench.transport",
    "admission": "bench.admission",
    "agent": "bench.agent",
    "ledger": "bench.ledger",
    "security": "bench.security",
    "system": "bench.system",
    "control_plane": "bench.control_plane",
    "weight_sync": "bench.weight_sync",
    "weight_transfer": "bench.weight_transfer",
    "weights": "bench.weights",
    "fingerprint": "bench.fingerprint",
    "scale": "bench.scale",
    "offpolicy": "bench.offpolicy",
    "shared_fleet": "bench.shared_fleet",
}
