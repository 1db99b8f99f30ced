"""LoRA against full-model versions of the same base, in one process (docs/lora.md).

`python -m bench.lora refit [--model DIR ...] [--repeats N]`: for each base, the torch backend
with and without `trainer.lora` (rank 16, alpha 32, q/k/v/o) publishes a version as the trainer
does (`hf_files`, then `write_version` with its fingerprint manifest), and a torch engine that
serves the base takes it (`update_weights`: read, fingerprint, apply at a token boundary, no
request in flight). Reported per kind: the version's bytes (its *.safetensors; config and
tokenizer aside), the trainer's serialise + write seconds and the engine's update seconds
(medians). One process, one thread each side: the same base, the same run.

`python -m bench.lora eval --base DIR [--adapter DIR] --data JSONL`: the demo's eval (greedy,
6 tokens, exact match) of one stored version, offline, on the torch engine.

`python -m bench.lora demo [--steps N]`: the arith demo (examples/arith/experiment.yaml, the
torch backend, eta 2) as a LoRA experiment through all four services under the supervisor, as
tests/e2e run them; prints the evals and the ledger totals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from asyncrl.logging import configure_logging

LORA = {"rank": 16, "alpha": 32.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
DEMO_LORA = {
    "rank": 16,
    "alpha": 32.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
DEMO_LR = 2e-3
"""LoRA's learning rate on the demo (the full-model demo's is 3e-4: an adapter's B starts at
zero and moves a rank-16 subspace, the usual LoRA choice is ~10x the full-model rate)."""


def _backend(model_dir: Path, lora: dict | None):
    from asyncrl.spec import validate_spec
    from services.trainer.backends.torch_backend import TorchBackend

    trainer = {"backend": "torch", **({"lora": lora} if lora else {})}
    spec = validate_spec(
        {"model": {"path": str(model_dir)}, "dataset": {"path": "-"}, "trainer": trainer}
    )
    backend = TorchBackend(spec, device="cpu")
    backend.load(str(model_dir))
    if lora:  # a trained adapter: B moved off zero (peft starts it there)
        with torch.no_grad():
            for name, p in backend.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01)
    return backend


async def _refit(model_dir: Path, work: Path, repeats: int) -> list[dict]:
    from services.rollout.torch_engine import TorchEngine
    from services.trainer.publish import write_version

    engine = TorchEngine(seed=0)
    await engine.start()
    await engine.load(str(model_dir), 0)
    rows = []
    try:
        for kind, lora in (("full", None), ("lora", LORA)):
            backend = _backend(model_dir, lora)
            publish_s, update_s = [], []
            for i in range(repeats):
                version = 1 + i + (0 if lora else 1000)
                t0 = time.perf_counter()
                files = backend.hf_files()
                write_version(work, kind, version, files, model_dir, keep=2)
                publish_s.append(time.perf_counter() - t0)
                vdir = work / kind / f"v{version:06d}"
                t0 = time.perf_counter()
                await engine.update_weights(str(vdir), version)
                update_s.append(time.perf_counter() - t0)
            weights = sum(p.stat().st_size for p in vdir.glob("*.safetensors"))
            rows.append(
                {
                    "model": model_dir.name,
                    "kind": kind,
                    "version_bytes": weights,
                    "trainable_params": sum(
                        p.numel() for p in backend.optimizer.param_groups[0]["params"]
                    ),
                    "publish_s": round(statistics.median(publish_s), 4),
                    "engine_update_s": round(statistics.median(update_s), 4),
                    "repeats": repeats,
                }
            )
            del backend
    finally:
        await engine.stop()
    return rows


def refit(models: list[Path], repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-lora-") as tmp:
        for model_dir in models:
            rows += asyncio.run(_refit(Path(model_dir), Path(tmp), repeats))
    return rows


def demo(steps: int, built: Path | None = None) -> dict:
    from asyncrl.security import ensure_secrets
    from tests.e2e.experiment import (
        arith_demo_spec,
        build_arith_demo,
        ledger_report,
        run_experiment,
        start_cluster,
    )

    with tempfile.TemporaryDirectory(prefix="asyncrl-lora-demo-") as tmp:
        root = Path(tmp)
        os.environ.setdefault("ASYNCRL_SECRETS", str(root / "secrets"))  # as tests/conftest.py
        ensure_secrets()
        if built is None:
            build_arith_demo(root)
        else:  # what `make demo` built already (it skips the build too when it is there)
            for name in ("model", "train.jsonl", "eval.jsonl"):
                copy = shutil.copytree if (built / name).is_dir() else shutil.copy2
                copy(built / name, root / name)
        spec = arith_demo_spec(root, total_steps=steps)
        spec["trainer"].update(lora=DEMO_LORA, lr=DEMO_LR)
        cluster_gen = start_cluster(root / "var", engine="torch")
        cluster = next(cluster_gen)
        try:
            t0 = time.perf_counter()
            exp = asyncio.run(run_experiment(cluster.scheduler, spec, timeout=3600))
            out = {
                "state": exp.state,
                "message": exp.message,
                "evals": [(e.version, e.accuracy) for e in exp.progress.evals],
                "wall_s": round(time.perf_counter() - t0, 1),
                "lora": DEMO_LORA,
                "lr": DEMO_LR,
            }
            print(json.dumps(out), file=sys.stderr, flush=True)  # kept if the ledger read fails
            time.sleep(5)  # the trainer records what was left over as it stops
            report = ledger_report(cluster, exp)
            out |= {"ledger": report["totals"], "steps": report["steps"]}
        finally:
            cluster_gen.close()
    return out


async def _greedy_accuracy(base: Path, adapter: Path | None, data: Path, max_new: int) -> float:
    """The run's eval, offline: greedy, `max_new` tokens, EOS stops, exact_match on the text
    the rollout would decode; the engine serving `base` with `adapter` on top."""
    from transformers import AutoTokenizer

    from asyncrl.rewards import exact_match
    from asyncrl.spec import SamplingParams
    from services.rollout.engine import GenRequest
    from services.rollout.torch_engine import TorchEngine

    tok = AutoTokenizer.from_pretrained(str(base))
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    engine = TorchEngine(seed=0)
    await engine.start()
    try:
        await engine.load(str(base), 0)
        if adapter is not None:
            await engine.update_weights(str(adapter), 1)
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
        reqs = [
            GenRequest(f"e{i}", tok.encode(r["prompt"], add_special_tokens=False), params)
            for i, r in enumerate(rows)
        ]
        for req in reqs:
            req.stop_token_ids = [tok.eos_token_id]
        outs = await engine.generate_many(reqs)
    finally:
        await engine.stop()
    texts = [tok.decode(o.output_ids, skip_special_tokens=True) for o in outs]
    return sum(exact_match(t, r["answer"]) for t, r in zip(texts, rows, strict=True)) / len(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__)
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("refit")
    r.add_argument("--model", type=Path, action="append", required=True)
    r.add_argument("--repeats", type=int, default=5)
    d = sub.add_parser("demo")
    d.add_argument("--steps", type=int, default=250)
    d.add_argument("--built", type=Path, help="a directory `make demo` built (var/demo)")
    e = sub.add_parser("eval", help="greedy exact-match accuracy of a stored adapter version")
    e.add_argument("--base", type=Path, required=True)
    e.add_argument("--adapter", type=Path)
    e.add_argument("--data", type=Path, required=True)
    e.add_argument("--max-new-tokens", type=int, default=6)
    args = ap.parse_args(argv)
    configure_logging("bench", json=False, level="WARNING")
    if args.what == "refit":
        out = refit(args.model, args.repeats)
    elif args.what == "eval":
        acc = _greedy_accuracy(args.base, args.adapter, args.data, args.max_new_tokens)
        out = {"adapter": str(args.adapter), "accuracy": asyncio.run(acc)}
    else:
        out = demo(args.steps, args.built)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
