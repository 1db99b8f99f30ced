"""Chaos scenarios of the reward worker (issue 23 point 7).

hung-reward: the experiment's reward plugin hangs forever on every sample of 1 in 32 prompts
(`tests.fixtures_plugins.rewards:exact_or_hang`, timeout_s 5). Each of those items is killed
at its timeout and FAILED with the reason; the group fails whole, the prompt is `failed` in
the ledger (the task's failure, not an infrastructure fault: not retried), and the rest of the
run trains as usual: COMPLETED, nothing lost, every failed prompt's reason a timeout (or,
queued behind other hung items, not started before its Score call's deadline).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.chaos.run import Run
    from tests.chaos.scenarios import Scenario

HUNG_REWARD = "plugin:tests.fixtures_plugins.rewards:exact_or_hang"
TIMEOUT_S = 5
ONE_IN = 32
"""Every hung item holds a scoring process for TIMEOUT_S: 1 in 8 prompts (28 groups of 8 in a
run) held the 2 processes ~560 s, past the harness's 600 s; 1 in 32 leaves ~4 groups."""


async def hung_from_the_start(run: Run, rng: random.Random) -> None:
    """The fault is the spec's own reward function: there from the first group."""
    run.mark(f"reward hangs on 1 in {ONE_IN} prompts (timeout_s {TIMEOUT_S})")


def scenarios() -> list[Scenario]:
    from tests.chaos.scenarios import Scenario

    return [
        Scenario(
            "hung-reward",
            f"reward plugin hangs on 1 in {ONE_IN} prompts, timeout_s {TIMEOUT_S}",
            hung_from_the_start,
            infrastructure=False,
            sets=(
                f"reward.function={HUNG_REWARD}",
                f"reward.kwargs.one_in='{ONE_IN}'",
                f"reward.timeout_s={TIMEOUT_S}",
            ),
            # killed at its timeout, or never started before its Score call's deadline
            expect_failed_reasons=(
                f"timed out after {TIMEOUT_S}s",
                "not scored before the call's deadline",
            ),
        )
    ]
