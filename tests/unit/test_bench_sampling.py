"""bench.sampling reads py-spy's raw output (collapsed stacks, outermost frame first)."""

from __future__ import annotations

from bench.sampling import _name, _wrapper, plot_samples, print_samples, read_stacks

RAW = (
    "_run_module_as_main (<frozen runpy>:198);<module> (services/rollout/__main__.py:107);"
    "BaseEventLoop._run_once (asyncio/base_events.py:1922);"
    "RolloutService._publish (services/rollout/service.py:520);"
    "group_to_bytes (libs/asyncrl/convert.py:92);sample_to_proto (libs/asyncrl/convert.py:26) 3\n"
    "_run_module_as_main (<frozen runpy>:198);<module> (services/rollout/__main__.py:107);"
    "BaseEventLoop._run_once (asyncio/base_events.py:1922);"
    "RolloutService._publish (services/rollout/service.py:531);"
    "publish_group (libs/asyncrl/natsutil.py:405) 1\n"
    "\n"
)


def test_read_stacks_counts_each_function_once_a_sample_lines_aside(tmp_path):
    path = tmp_path / "rollout.txt"
    path.write_text(RAW)
    inclusive, leaf, total = read_stacks(path)
    assert total == 4
    assert inclusive["RolloutService._publish (rollout/service.py)"] == 4  # two lines, one row
    assert inclusive["group_to_bytes (asyncrl/convert.py)"] == 3
    assert leaf == {
        "sample_to_proto (asyncrl/convert.py)": 3,
        "publish_group (asyncrl/natsutil.py)": 1,
    }


def test_names_keep_the_last_two_path_parts_and_wrappers_are_known():
    assert _name("wait_for (asyncio/tasks.py:476)") == "wait_for (asyncio/tasks.py)"
    assert _name("<lambda>") == "<lambda>"  # no file: as it is
    assert _wrapper("_run_code (<frozen runpy>)")
    assert _wrapper("<module> (rollout/__main__.py)")
    assert _wrapper("BaseEventLoop._run_once (asyncio/base_events.py)")
    assert not _wrapper("BaseEventLoop.create_task (asyncio/base_events.py)")
    assert not _wrapper("RolloutService._publish (rollout/service.py)")


def test_print_samples_shows_shares_without_the_wrappers(tmp_path, capsys):
    (tmp_path / "rollout.txt").write_text(RAW)
    print_samples(tmp_path, {"rollout": 900.0, "trainer": 400.0}, top=10)
    out = capsys.readouterr().out
    assert "## rollout: 900 CPU-µs/group in this window, 4 samples" in out
    assert "| 100.0 % | 0.0 % | RolloutService._publish (rollout/service.py) |" in out
    assert "| 75.0 % | 75.0 % | sample_to_proto (asyncrl/convert.py) |" in out
    assert "runpy" not in out and "_run_once" not in out
    assert "trainer" not in out  # no file: nothing to show


def test_plot_samples_draws_one_panel_a_service_with_samples(tmp_path):
    (tmp_path / "rollout.txt").write_text(RAW)
    (tmp_path / "scheduler.txt").write_text(RAW.replace("rollout", "scheduler"))
    out = plot_samples(tmp_path, {"scheduler": 350.0, "rollout": 900.0, "trainer": 400.0})
    assert out == tmp_path / "samples.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
