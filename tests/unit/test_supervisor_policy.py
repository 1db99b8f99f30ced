"""The supervisor's pure policy: restart backoff, replica numbering, each replica's command
line (torchrun for a multi-rank trainer) and metrics port; `start`'s service list and the
daemon's command line."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import typer

from asyncrl.supervisor.commands import Launch, _parse_services
from asyncrl.supervisor.daemon import (
    SERVICES,
    Paths,
    Replica,
    Supervisor,
    backoff_s,
    free_index,
    metrics_port_for,
)


@pytest.mark.parametrize("failures, delay", [(0, 0.5), (1, 0.5), (2, 1.0), (3, 2.0), (7, 30.0)])
def test_backoff_consecutive_failures_doubles_up_to_30s(failures, delay):
    assert backoff_s(failures) == delay


@pytest.mark.parametrize("used, index", [(set(), 0), ({0}, 1), ({0, 2}, 1), ({1, 2}, 0)])
def test_free_index_used_indices_lowest_free(used, index):
    assert free_index(used) == index


# ---------------------------------------------------------------- command construction


@pytest.fixture
def sup_env(monkeypatch):
    """No per-service extras or engine choice from the caller's environment."""
    for service in ("SCHEDULER", "REWARD", "ROLLOUT", "TRAINER"):
        monkeypatch.delenv(f"ASYNCRL_{service}_ARGS", raising=False)
    monkeypatch.delenv("ASYNCRL_ROLLOUT_ENGINE", raising=False)
    monkeypatch.delenv("ASYNCRL_CPU_AFFINITY", raising=False)
    return monkeypatch


def _sup(tmp_path, **kw) -> Supervisor:
    return Supervisor(Paths(tmp_path), list(SERVICES), 4222, 50051, **kw)


def test_command_defaults_no_metrics_single_rank(sup_env, tmp_path):
    sup = _sup(tmp_path)
    py = sys.executable
    assert sup.command("scheduler") == [py, "-m", "services.scheduler", "--port", "50051"]
    assert sup.command("reward") == [py, "-m", "services.reward"]
    assert sup.command("rollout", 2) == [py, "-m", "services.rollout", "--engine", "torch"]
    assert sup.command("trainer")[:3] == [py, "-m", "services.trainer"]


def test_command_metrics_base_9100_fixed_ports_per_replica(sup_env, tmp_path):
    sup = _sup(tmp_path, metrics_base=9100)
    py = sys.executable
    assert sup.command("scheduler") == [
        py, "-m", "services.scheduler", "--port", "50051", "--metrics-port", "9100",
    ]  # fmt: skip
    assert sup.command("trainer")[:5] == [py, "-m", "services.trainer", "--metrics-port", "9101"]
    assert sup.command("rollout", 0) == [
        py, "-m", "services.rollout", "--engine", "torch", "--metrics-port", "9110",
    ]  # fmt: skip
    assert sup.command("rollout", 3)[-2:] == ["--metrics-port", "9113"]
    assert sup.command("reward", 1) == [py, "-m", "services.reward"]


def test_command_extra_args_after_supervisor_flags(sup_env, tmp_path):
    sup_env.setenv("ASYNCRL_ROLLOUT_ENGINE", "sglang")
    sup_env.setenv("ASYNCRL_ROLLOUT_ARGS", "--sglang-url http://h:30000 --capacity 8")
    assert _sup(tmp_path, metrics_base=9100).command("rollout", 1) == [
        sys.executable, "-m", "services.rollout", "--engine", "sglang", "--metrics-port", "9111",
        "--sglang-url", "http://h:30000", "--capacity", "8",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "cores, rollouts, nproc, threads",
    [(2, 1, 1, 1), (16, 1, 1, 15), (16, 3, 2, 6), (2, 4, 1, 1), (8, 0, 1, 8)],
)
def test_command_trainer_threads_cores_left_by_rollouts(
    sup_env, tmp_path, cores, rollouts, nproc, threads
):
    sup_env.setattr("os.cpu_count", lambda: cores)
    sup = _sup(tmp_path, trainer_nproc=nproc)
    (tmp_path / "run").mkdir(exist_ok=True)
    sup.paths.replicas.write_text(f'{{"rollout": {rollouts}}}')
    assert sup.command("trainer")[-2:] == ["--threads", str(threads)]


def test_command_trainer_threads_given_by_caller_kept(sup_env, tmp_path):
    sup_env.setenv("ASYNCRL_TRAINER_ARGS", "--threads 3")
    cmd = _sup(tmp_path).command("trainer")
    assert cmd[cmd.index("--threads") :] == ["--threads", "3"]


def test_command_trainer_nproc_2_torchrun_with_free_master_port(sup_env, tmp_path):
    sup_env.setenv("ASYNCRL_TRAINER_ARGS", "--threads 4")
    cmd = _sup(tmp_path, metrics_base=9100, trainer_nproc=2).command("trainer")
    master_port = cmd.index("--master_port") + 1
    assert cmd[:master_port] == [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port",
    ]  # fmt: skip
    assert 0 < int(cmd[master_port]) < 65536
    assert cmd[master_port + 1 :] == [
        "-m", "services.trainer", "--metrics-port", "9101", "--threads", "4",
    ]  # fmt: skip


def test_command_trainer_nproc_2_only_changes_the_trainer(sup_env, tmp_path):
    plain, multi = _sup(tmp_path), _sup(tmp_path, trainer_nproc=2)
    for service, index in (("scheduler", 0), ("reward", 0), ("rollout", 1)):
        assert multi.command(service, index) == plain.command(service, index)


@pytest.mark.parametrize(
    "service, index, base, port",
    [
        ("scheduler", 0, 9100, 9100),
        ("trainer", 0, 9100, 9101),
        ("trainer", 8, 9100, 9109),
        ("trainer", 9, 9100, None),  # would take rollout-0's port
        ("rollout", 0, 9100, 9110),
        ("rollout", 25, 9100, 9135),
        ("reward", 0, 9100, None),
        ("nats", 0, 9100, None),
        ("scheduler", 0, None, None),
        ("rollout", 3, None, None),
    ],
)
def test_metrics_port_for_base_offset_plus_replica(service, index, base, port):
    assert metrics_port_for(service, index, base) == port


def test_replica_as_dict_carries_metrics_port(tmp_path):
    r = Replica("rollout", 1, tmp_path / "rollout-1.log", metrics_port=9111)
    assert r.as_dict()["metrics_port"] == 9111
    assert Replica("reward", 0, tmp_path / "reward-0.log").as_dict()["metrics_port"] is None


# ---------------------------------------------------------------- `start`'s steps


def test_parse_services_any_order_start_order():
    assert _parse_services(" trainer,scheduler ,,reward") == ["scheduler", "reward", "trainer"]


def test_parse_services_unknown_name_refused():
    with pytest.raises(typer.BadParameter, match="nats"):
        _parse_services("scheduler,nats")


def test_launch_daemon_command_metrics_flag_only_with_a_base(tmp_path):
    launch = Launch(tmp_path, ["scheduler", "reward"], 4222, 50051, None, 2)
    assert launch.daemon_command() == [
        sys.executable, "-m", "asyncrl.supervisor", "run", "--var", str(tmp_path),
        "--services", "scheduler,reward", "--nats-port", "4222", "--scheduler-port", "50051",
        "--trainer-nproc", "2",
    ]  # fmt: skip
    with_metrics = dataclasses.replace(launch, metrics_port=9100).daemon_command()
    assert with_metrics[-2:] == ["--metrics-port", "9100"]


@pytest.mark.parametrize(
    "cores, rollouts, expected",
    [
        (2, 1, {"rollout": [{1}], "trainer": {0}, "nats": {0}, "scheduler": {0}}),
        (8, 3, {"rollout": [{7}, {6}, {5}], "trainer": {0, 1, 2, 3, 4}, "reward": {0, 1, 2, 3, 4}}),
        (2, 2, {"rollout": [None, None], "trainer": None}),  # nothing left for the others
        (4, 0, {"trainer": None}),
    ],
)
def test_cpus_a_core_per_rollout_the_rest_for_everything_else(
    sup_env, tmp_path, cores, rollouts, expected
):
    sup_env.setenv("ASYNCRL_CPU_AFFINITY", "1")
    sup_env.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    sup = _sup(tmp_path)
    (tmp_path / "run").mkdir(exist_ok=True)
    sup.paths.replicas.write_text(f'{{"rollout": {rollouts}}}')
    for service, want in expected.items():
        if service == "rollout":
            assert [sup.cpus("rollout", i) for i in range(len(want))] == want
        else:
            assert sup.cpus(service) == want


def test_cpus_none_unless_asked_and_for_a_gpu_engine(sup_env, tmp_path):
    sup_env.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    sup = _sup(tmp_path)
    assert sup.cpus("rollout") is None and sup.cpus("trainer") is None  # off by default
    sup_env.setenv("ASYNCRL_CPU_AFFINITY", "1")
    sup_env.setenv("ASYNCRL_ROLLOUT_ENGINE", "sglang")
    assert sup.cpus("rollout") is None and sup.cpus("trainer") is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_spawn_starts_each_replica_on_its_cores(sup_env, tmp_path):
    sup_env.setenv("ASYNCRL_CPU_AFFINITY", "1")
    sup_env.setenv("ASYNCRL_INSECURE", "1")  # no token files for the worker replicas
    cores = sorted(os.sched_getaffinity(0))
    sup = _sup(tmp_path)
    (tmp_path / "run").mkdir(exist_ok=True)
    sup.paths.replicas.write_text('{"rollout": 1}')
    probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    sup_env.setattr(sup, "command", lambda service, index=0: probe)
    for service, want in (("rollout", cores[-1:]), ("trainer", cores[:-1])):
        replica = Replica(service, 0, tmp_path / f"{service}.log")
        sup.spawn(replica)
        assert replica.proc.wait(30) == 0
        assert replica.log.read_text().strip() == str(want)
