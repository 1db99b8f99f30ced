"""`asyncrl status` / `watch` show why groups failed and what was left over."""

from __future__ import annotations

from rich.console import Console

from asyncrl.v1 import scheduler_pb2
from asyncrl.watchview import ProgressView, failure_summary


def _view(progress: scheduler_pb2.Progress) -> ProgressView:
    view = ProgressView("x-000000")
    exp = scheduler_pb2.Experiment(id="x-000000", progress=progress)
    view.update(scheduler_pb2.ProgressEvent(kind="snapshot", experiment=exp))
    return view


def test_status_view_with_failures_shows_reasons_and_left_over():
    progress = scheduler_pb2.Progress(failed=5, left_over=1)
    progress.failure_reasons.update({"reward raised: ZeroDivisionError": 4, "timeout": 1})
    console = Console(width=200, record=True)
    console.print(_view(progress).render())
    text = console.export_text()
    assert "4x reward raised: ZeroDivisionError; 1x timeout" in text
    assert "left over 1" in text
    assert "failures: 4x reward raised" in _view(progress).line("state")


def test_failure_summary_many_reasons_names_the_rest():
    progress = scheduler_pb2.Progress()
    progress.failure_reasons.update({f"r{i}": i + 1 for i in range(7)})
    assert failure_summary(progress).endswith("; and 2 more")
    assert failure_summary(progress).startswith("7x r6; 6x r5")
