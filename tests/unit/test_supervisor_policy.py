"""The supervisor's pure restart and replica-numbering policy."""

from __future__ import annotations

import pytest

from asyncrl.supervisor.daemon import backoff_s, free_index


@pytest.mark.parametrize("failures, delay", [(0, 0.5), (1, 0.5), (2, 1.0), (3, 2.0), (7, 30.0)])
def test_backoff_consecutive_failures_doubles_up_to_30s(failures, delay):
    assert backoff_s(failures) == delay


@pytest.mark.parametrize("used, index", [(set(), 0), ({0}, 1), ({0, 2}, 1), ({1, 2}, 0)])
def test_free_index_used_indices_lowest_free(used, index):
    assert free_index(used) == index
