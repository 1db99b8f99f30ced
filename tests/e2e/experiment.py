"""Shared pieces of the end-to-end tests: a cluster per engine started through the supervisor,
the small addition task, its spec, running an experiment to the end, and the checks of a
completed small experiment (the same for every engine and trainer backend)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from typer.testing import CliRunner

from asyncrl.cli import app as cli_app
from asyncrl.cli import load_spec_dict
from asyncrl.client import AsyncrlClient, is_terminal, state_name
from asyncrl.supervisor import pid_alive
from tests.cluster import ROOT, Cluster, parse_events, wait_for

TOTAL_STEPS = 4
ARITH_DEMO = ROOT / "examples" / "arith" / "experiment.yaml"


def write_task(root: Path, n_train: int, n_eval: int) -> tuple[Path, Path]:
    rng = random.Random(0)

    def rows(n):
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            yield {"prompt": f"{a}+{b}=", "answer": str(a + b)}

    train, evals = root / "train.jsonl", root / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows(n_train)))
    evals.write_text("".join(json.dumps(r) + "\n" for r in rows(n_eval)))
    return train, evals


def small_spec(task: tuple[Path, Path, Path], engine: str = "torch", **trainer) -> dict:
    model, train, evals = task
    return {
        "name": "e2e",
        "model": {"path": str(model)},
        "dataset": {"path": str(train), "epochs": 50},
        "rollout": {
            "engine": engine,
            "n_samples": 4,
            "max_head_offpolicyness": 1,
            "max_concurrent_rollouts": 8,
            "filter": "none",  # a random model rarely gets a reward: keep every group
            "gconfig": {"temperature": 1.0, "max_new_tokens": 4},
        },
        "reward": {"function": "exact_match"},
        "trainer": {
            "backend": "torch",
            "batch_size": 2,
            "total_steps": TOTAL_STEPS,
            "lr": 1e-3,
            "checkpoint_every": 2,
            **trainer,
        },
        "eval": {
            "dataset_path": str(evals),
            "every_versions": 2,
            "n_samples": 1,
            "gconfig": {"temperature": 0.0, "max_new_tokens": 4},
        },
    }


def build_arith_demo(root: Path) -> None:
    """The demo's data and warm-started model in `root` (train.jsonl, eval.jsonl, model/), built
    by the command `make demo` runs."""
    subprocess.run(
        [sys.executable, "-m", "examples.arith.build", "--out", str(root / "model")],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )


def arith_demo_spec(root: Path, total_steps: int) -> dict:
    """The demo's experiment file on the data and model built in `root`, with the overrides a
    user would pass with `--set`: `total_steps` on the torch backend, eval at v0 and the end."""
    return load_spec_dict(
        ARITH_DEMO,
        [
            f"model.path={root / 'model'}",
            f"dataset.path={root / 'train.jsonl'}",
            f"eval.dataset_path={root / 'eval.jsonl'}",
            "trainer.backend=torch",
            f"trainer.total_steps={total_steps}",
            "eval.every_versions=0",
        ],
    )


def sglang_launch_args() -> str:
    """ASYNCRL_ROLLOUT_ARGS for a rollout that launches and supervises the HTTP fake of SGLang
    as its child server (the fake answers `--model-path ... --port ...` like launch_server)."""
    launch_cmd = f"launch_cmd=[{sys.executable}, -m, tests.fakes.sglang_server]"
    return f"--sglang-launch --engine-opt {shlex.quote(launch_cmd)}"


def start_cluster(var: Path, engine: str) -> Iterator[Cluster]:
    """A module fixture's body: all services under the supervisor, the rollout on `engine`;
    everything it started (SGLang children included) is killed at the end."""
    c = Cluster(var)
    c.env["ASYNCRL_ROLLOUT_ENGINE"] = engine
    if engine == "sglang":
        c.env["ASYNCRL_ROLLOUT_ARGS"] = sglang_launch_args()
    try:
        started = c.sup("start", "--timeout", "240", timeout=300)
        assert started.returncode == 0, started.stdout + started.stderr
        c.state()
        yield c
    finally:
        c.kill_all()
        for child in sglang_children(c):  # a rollout stops its child, unless it was killed
            kill_sglang_child(child["pid"])


def sglang_children(cluster: Cluster) -> list[dict]:
    """Every SGLang child the rollout workers launched, oldest first: {pid, url, ...}."""
    return [
        record
        for log in sorted((cluster.var / "log").glob("rollout-*.log"))
        for record in log_events(log, "sglang_started")
    ]


async def run_experiment(
    scheduler: str, spec: dict, timeout: float = 600, on_progress=None, poll_s: float = 0.5
):
    """Submit `spec` and poll every `poll_s` until the experiment ends; `on_progress(exp)` is
    called on every poll while it runs. The experiment is returned with its history (the polls
    leave it out: a long run's history is most of the message)."""
    async with AsyncrlClient(scheduler) as client:
        exp = await client.submit(spec)
        deadline = time.monotonic() + timeout
        while not is_terminal(exp):
            assert time.monotonic() < deadline, f"experiment stuck in {state_name(exp.state)}"
            if on_progress is not None:
                on_progress(exp)
            await asyncio.sleep(poll_s)
            exp = await client.get(exp.id)
        return await client.get(exp.id, with_history=True)


def assert_completed(exp, total_steps: int = TOTAL_STEPS) -> None:
    """Completed with B=2 groups per version, staleness bounded by eta=1, evals at 0, every 2
    versions and at the end."""
    assert state_name(exp.state) == "COMPLETED", exp.message
    p = exp.progress
    assert p.version == total_steps
    assert [h.version for h in exp.history] == list(range(1, total_steps + 1))
    assert all(h.groups == 2 for h in exp.history)
    assert max(h.staleness_max for h in exp.history) <= 1
    assert sorted({e.version for e in p.evals}) == sorted({*range(0, total_steps, 2), total_steps})
    assert all(e.n_samples == 8 for e in p.evals)


def assert_dump_decodes(cluster: Cluster, exp, out: Path, total_steps: int = TOTAL_STEPS) -> None:
    """The experiment's trajectories read back from JetStream with `asyncrl dump`."""
    result = CliRunner().invoke(
        cli_app,
        [
            "--scheduler",
            cluster.scheduler,
            "dump",
            exp.id,
            "--out",
            str(out),
            "--nats",
            f"nats://127.0.0.1:{cluster.nats_port}",
        ],
    )
    assert result.exit_code == 0, result.output
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) >= 2 * total_steps  # B * total_steps trained groups at least
    first = groups[0]
    assert len(first["samples"]) == 4
    for s in first["samples"]:
        assert len(s["versions"]) == len(s["output_ids"]) == len(s["logprobs"])


def ledger_report(cluster: Cluster, exp) -> dict:
    """`asyncrl ledger ID --json`: every prompt's fate, from the ledger stream."""
    result = CliRunner().invoke(
        cli_app, ["ledger", exp.id, "--json", "--nats", f"nats://127.0.0.1:{cluster.nats_port}"]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def assert_ledger_clean(cluster: Cluster, exp, batch_size: int = 2) -> dict:
    """Nothing lost, nothing trained twice, nothing left open, and the ledger agrees with the
    trainer: trained groups = steps x B."""
    report = wait_for(lambda: _settled_ledger(cluster, exp), timeout=30)
    totals = report["totals"]
    assert totals["lost"] == 0 and totals["trained_twice"] == 0, totals
    assert report["steps"] == exp.progress.version, report["steps"]
    assert report["trained_groups"] == report["steps"] * batch_size
    assert totals["trained"] == report["trained_groups"]
    return report


def _settled_ledger(cluster: Cluster, exp) -> dict | None:
    """The ledger once the trainer has recorded what was left over (it does so as it stops)."""
    report = ledger_report(cluster, exp)
    return report if report["totals"]["in_flight"] == 0 and report["totals"]["lost"] == 0 else None


def kill_sglang_child(pid: int) -> None:
    """SIGKILL `pid` if it is still a (fake) SGLang server: pids get reused."""
    try:
        alive = pid_alive(pid) and b"sglang" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if alive:
        os.kill(pid, signal.SIGKILL)


def log_events(path: Path, event: str) -> list[dict]:
    """The JSON log lines of `event` in a service log (other lines are skipped)."""
    return parse_events(path.read_text(), event)
