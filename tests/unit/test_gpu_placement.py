"""GPU placement of `make up` (asyncrl.supervisor.gpus): parsing ASYNCRL_GPUS, the default
split, the refusals, each replica's CUDA_VISIBLE_DEVICES, and the environment the supervisor
builds for (and a real process receives from) it. All on the CPU: no GPU is looked at."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from asyncrl.supervisor import gpus
from asyncrl.supervisor.commands import app as sup_app
from asyncrl.supervisor.daemon import SERVICES, Paths, Replica, Supervisor
from asyncrl.supervisor.gpus import PlacementError, Slot


@pytest.mark.parametrize(
    "text, ids",
    [
        ("0-3", ("0", "1", "2", "3")),
        ("0,2", ("0", "2")),
        ("0,2,5-6", ("0", "2", "5", "6")),
        ("7", ("7",)),
        ("03", ("3",)),
    ],
)
def test_parse_ids_ranges_and_lists_expanded(text, ids):
    assert gpus.parse_ids(text) == ids


@pytest.mark.parametrize("text", ["3-1", "a", "0,,1", "0-", "-2", "0,0", "0-2,1", "1.5"])
def test_parse_ids_malformed_refused(text):
    with pytest.raises(PlacementError):
        gpus.parse_ids(text)


def test_parse_services_and_widths():
    assert gpus.parse("rollout=0-3 trainer=4-7") == {
        "rollout": Slot(("0", "1", "2", "3")),
        "trainer": Slot(("4", "5", "6", "7")),
    }
    assert gpus.parse("  rollout=0-7/2\treward=7 ") == {
        "rollout": Slot(tuple(str(i) for i in range(8)), 2),
        "reward": Slot(("7",)),
    }


@pytest.mark.parametrize(
    "text, named",
    [
        ("nats=0", "unknown service 'nats'"),
        ("rolout=0", "unknown service 'rolout'"),
        ("rollout", "bad entry"),
        ("rollout=", "bad entry"),
        ("rollout=0 rollout=1", "placed twice"),
        ("rollout=0-3/0", "bad width"),
        ("rollout=0-3/x", "bad width"),
    ],
)
def test_parse_bad_entry_message_names_problem(text, named):
    with pytest.raises(PlacementError, match=named):
        gpus.parse(text)


@pytest.mark.parametrize(
    "visible, placement",
    [
        ([], {}),
        (["0"], {"rollout": Slot(("0",)), "trainer": Slot(("0",))}),
        (["0", "1"], {"rollout": Slot(("0",)), "trainer": Slot(("1",))}),
        (["2", "5", "6"], {"rollout": Slot(("2",)), "trainer": Slot(("5", "6"))}),
        (
            [str(i) for i in range(8)],
            {"rollout": Slot(("0", "1", "2", "3")), "trainer": Slot(("4", "5", "6", "7"))},
        ),
    ],
)
def test_default_placement_splits_visible_gpus(visible, placement):
    assert gpus.default_placement(visible) == placement
    assert gpus.resolve("", visible, "torch", 1) == placement


def test_resolve_cpu_machine_unset_no_placement():
    assert gpus.resolve("", None, "torch", 1) == {}
    assert gpus.devices_for({}, "rollout", 0, "torch") is None  # the environment untouched


@pytest.mark.parametrize(
    "text, visible, engine, nproc, named",
    [
        ("rollout=0-3 trainer=4-7", ["0", "1", "2", "3"], "torch", 1, "GPU 4,5,6,7 not visible"),
        ("trainer=1", [], "torch", 1, "not visible \\(visible: none\\)"),
        ("rollout=0-3 trainer=3-7", None, "torch", 1, "overlap on GPU 3"),
        ("rollout=0-2/2", None, "torch", 1, "do not split into replicas of 2"),
        ("trainer=0-3", None, "torch", 8, "8 torchrun ranks"),
        ("trainer=0-3/2", None, "torch", 4, "4 torchrun ranks"),
    ],
)
def test_resolve_bad_placement_refused_naming_it(text, visible, engine, nproc, named):
    with pytest.raises(PlacementError, match=named):
        gpus.resolve(text, visible, engine, nproc)


def test_resolve_same_gpus_shared_on_purpose_allowed():
    placement = gpus.resolve("rollout=0 trainer=0", ["0"], "torch", 1)
    assert placement["rollout"] == placement["trainer"] == Slot(("0",))


def test_devices_for_torch_rollouts_round_robin_one_gpu_each():
    placement = gpus.parse("rollout=0-2 trainer=3-4")
    got = [gpus.devices_for(placement, "rollout", i, "torch") for i in range(4)]
    assert got == ["0", "1", "2", "0"]
    assert gpus.devices_for(placement, "trainer", 0, "torch") == "3,4"


def test_devices_for_sglang_rollout_takes_all_or_width():
    placement = gpus.parse("rollout=0-3 trainer=4-7")
    assert gpus.devices_for(placement, "rollout", 0, "sglang") == "0,1,2,3"
    wide = gpus.parse("rollout=0-3/2")
    got = [gpus.devices_for(wide, "rollout", i, "sglang") for i in range(3)]
    assert got == ["0,1", "2,3", "0,1"]


@pytest.mark.parametrize("service", ["scheduler", "reward"])
def test_devices_for_unplaced_service_no_gpu(service):
    placement = gpus.parse("rollout=0 trainer=1")
    assert gpus.devices_for(placement, service, 0, "torch") == ""
    assert gpus.devices_for(gpus.parse("reward=7 rollout=0"), "reward", 0, "torch") == "7"


# ---------------------------------------------------------------- the supervisor's processes


@pytest.fixture
def gpu_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("ASYNCRL_ROLLOUT_ENGINE", raising=False)
    monkeypatch.delenv("ASYNCRL_GPUS", raising=False)
    return monkeypatch


def _sup(tmp_path: Path, placement) -> Supervisor:
    (tmp_path / "log").mkdir(exist_ok=True)
    return Supervisor(Paths(tmp_path), list(SERVICES), 4222, 50051, placement=placement)


def test_env_asyncrl_gpus_each_service_gets_its_devices(gpu_env, tmp_path):
    gpu_env.setenv("ASYNCRL_INSECURE", "1")
    sup = _sup(tmp_path, gpus.resolve("rollout=0-1 trainer=2-3", None, "torch", 1))
    envs = {(s, i): sup.env(s, i).get("CUDA_VISIBLE_DEVICES") for s in SERVICES for i in (0, 1)}
    assert envs == {
        ("scheduler", 0): "",
        ("scheduler", 1): "",
        ("reward", 0): "",
        ("reward", 1): "",
        ("rollout", 0): "0",
        ("rollout", 1): "1",
        ("trainer", 0): "2,3",
        ("trainer", 1): "2,3",
    }


def test_env_cpu_machine_no_placement_environment_unchanged(gpu_env, tmp_path):
    gpu_env.setenv("ASYNCRL_INSECURE", "1")
    sup = _sup(tmp_path, gpus.resolve("", None, "torch", 1))
    assert all("CUDA_VISIBLE_DEVICES" not in sup.env(s, 0) for s in SERVICES)
    gpu_env.setenv("CUDA_VISIBLE_DEVICES", "")  # the user's own: passed on as it was
    assert sup.env("trainer", 0)["CUDA_VISIBLE_DEVICES"] == ""


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_spawn_real_process_environ_has_its_devices(gpu_env, tmp_path):
    """A started process (a stand-in command: the placement is in its environment, whatever
    it runs) sees the GPUs its service and replica were placed on, in /proc/<pid>/environ."""
    gpu_env.setenv("ASYNCRL_INSECURE", "1")
    sup = _sup(tmp_path, gpus.resolve("rollout=4-5 trainer=6,7", None, "torch", 1))
    sup.command = lambda service, index=0: ["sleep", "30"]
    started = []
    try:
        for service, index in [("scheduler", 0), ("rollout", 0), ("rollout", 1), ("trainer", 0)]:
            r = Replica(service, index, sup.paths.log(service, index))
            sup.spawn(r)
            started.append(r)
        time.sleep(0.2)  # exec'd: /proc shows the child's own environment
        seen = {(r.service, r.index): _environ(r.proc.pid)["CUDA_VISIBLE_DEVICES"] for r in started}
        assert seen == {
            ("scheduler", 0): "",
            ("rollout", 0): "4",
            ("rollout", 1): "5",
            ("trainer", 0): "6,7",
        }
        assert [r.as_dict()["gpus"] for r in started] == ["", "4", "5", "6,7"]
    finally:
        for r in started:
            r.proc.kill()
            r.proc.wait()


def test_start_bad_placement_fails_with_message(gpu_env, tmp_path):
    gpu_env.setenv("ASYNCRL_GPUS", "rollout=0-3 trainer=3-7")
    result = CliRunner().invoke(sup_app, ["start", "--var", str(tmp_path)])
    assert result.exit_code == 1
    assert "bad GPU placement" in result.output and "overlap on GPU 3" in result.output
    assert not (tmp_path / "run" / "supervisor.pid").exists()
