"""`freeze_heap` leaves the young generation collected every GEN0_THRESHOLD allocations, the
older generations' thresholds as they were."""

from __future__ import annotations

import gc

from asyncrl.runtime import GEN0_THRESHOLD, freeze_heap


def test_freeze_heap_raises_only_the_young_threshold():
    before = gc.get_threshold()
    try:
        freeze_heap()
        assert gc.get_threshold() == (GEN0_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
