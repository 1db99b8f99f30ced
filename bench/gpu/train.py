"""Part `train`: megatron-core train steps on one device, random weights.

`MegatronBackend` exactly as the trainer service runs it in-process (TP=1, DP=1: NCCL, bf16,
Megatron DDP + distributed optimizer on CUDA; gloo, fp32, AdamW on CPU), on synthetic groups
(`bench.trainer.make_groups`: rewards alternate, so every step has a gradient). One warm-up
step, then `steps` timed steps, then a checkpoint saved, a step, the checkpoint loaded back and the step replayed
(the weights must come back exactly, the replay match the step); tokens/s counts every token of the packed rows (prompt and
output: the forward and backward work), loss tokens/s only the trained output tokens.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from asyncrl.spec import ExperimentSpec
from bench.gpu.shapes import SHAPES, build, n_params
from bench.trainer import make_groups


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(shape: str, work: Path, sizes: dict) -> dict:
    """One shape: `sizes` = {groups, samples, prompt_len, out_len, steps, micro_batch_tokens}."""
    from services.trainer.backends.megatron_backend import MegatronBackend

    model_dir = build(shape, work / "models" / shape)
    spec = ExperimentSpec(
        model={"path": str(model_dir)},
        dataset={"path": "unused.jsonl"},
        trainer={
            "backend": "megatron",
            "lr": 1e-5,
            "minibatches": 1,
            "micro_batch_tokens": sizes["micro_batch_tokens"],
        },
        seed=1,
    )
    groups = make_groups(
        SHAPES[shape]["vocab_size"],
        sizes["groups"],
        sizes["samples"],
        sizes["prompt_len"],
        sizes["out_len"],
    )
    rows = sizes["groups"] * sizes["samples"]
    row_tokens = sizes["prompt_len"] + sizes["out_len"]
    t0 = time.perf_counter()
    backend = MegatronBackend(spec)
    backend.load(str(model_dir))
    load_s = time.perf_counter() - t0
    cuda = backend.device.type == "cuda"
    first = _timed_step(backend, groups)  # the optimizer's state is allocated here
    times, losses = [], []
    for _ in range(sizes["steps"]):
        seconds, metrics = _timed_step(backend, groups)
        times.append(seconds)
        losses.append(metrics["loss"])
    step_s = statistics.median(times)
    checkpoint = _checkpoint_round_trip(backend, work / "checkpoints" / shape, groups)
    return {
        "shape": shape,
        "params_m": round(n_params(shape) / 1e6, 1),
        "device": str(backend.device),
        "dtype": "bf16" if cuda else "fp32",
        "rows": rows,
        "row_tokens": row_tokens,
        "micro_batch_tokens": sizes["micro_batch_tokens"],
        "load_s": round(load_s, 2),
        "first_step_s": round(first[0], 3),
        "step_s": round(step_s, 6),
        "step_s_all": [round(t, 4) for t in times],
        "tokens_per_s": round(rows * row_tokens / step_s, 1),
        "loss_tokens_per_s": round(first[1]["tokens"] / step_s, 1),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
        "loss": losses,
        "grad_norm": round(first[1]["grad_norm"], 4),
        "checkpoint": checkpoint,
        "problems": [] if checkpoint["ok"] else [f"checkpoint: {checkpoint['error']}"],
    }


def _checkpoint_round_trip(backend, ckpt_dir: Path, groups) -> dict:
    """`save_checkpoint`, a step, `load_checkpoint`, the same step again, as a trainer that
    resumes does: the load must give back the saved weights exactly, and the replayed step the
    same weights as the first (the optimizer's moments and step count came back too)."""
    t0 = time.perf_counter()
    try:
        saved_params = _params(backend)
        backend.save_checkpoint(ckpt_dir)
        saved = time.perf_counter()
        backend.train_step(groups)
        stepped = _params(backend)
        t1 = time.perf_counter()
        backend.load_checkpoint(ckpt_dir)
        loaded = time.perf_counter()
        restored = _max_abs_diff(_params(backend), saved_params)
        backend.train_step(groups)
        replayed = _max_abs_diff(_params(backend), stepped)
    except Exception as exc:  # noqa: BLE001 - reported as a problem, the figures stand
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    moved = _max_abs_diff(stepped, saved_params)
    ok = restored == 0.0 and moved > 0.0 and replayed <= 0.01 * moved
    return {
        "ok": ok,
        "error": "" if ok else f"restored {restored}, replayed {replayed}, step moved {moved}",
        "save_s": round(saved - t0, 2),
        "load_s": round(loaded - t1, 2),
        "restored_max_abs": restored,
        "replayed_max_abs": replayed,
        "step_max_abs": moved,
    }


def _params(backend) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in backend.built.model.named_parameters()}


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _timed_step(backend, groups) -> tuple[float, dict]:
    _sync()
    t0 = time.perf_counter()
    metrics = backend.train_step(groups)
    _sync()
    return time.perf_counter() - t0, metrics
