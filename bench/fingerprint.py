"""What the weights fingerprints cost (issue 23): per version, and per group, each beside the
work it rides on.

For the demo's model (examples/arith: hidden 64, 2 layers) and a larger one (hidden 512, 8
layers, ~130 MB of fp32; hidden 256, 4 layers with --quick), built and saved as the trainer
saves a version (its safetensors files' bytes, what `TrainerBackend.hf_files` returns):

- trainer, per version: `fingerprint.of_files` of the version's files (what `write_version`
  records in the manifest) against the whole `write_version` (the publish: files written,
  fingerprint, tokenizer, rename, prune), measured in the same run.
- rollout, per version: `fingerprint.of_state` of the tensors as read (what the torch engine
  reports with UpdateWeights) against the weight update without it: read the files
  (`load_state_dict_files`) + `load_state_dict` into the model.
- trainer, per group: the fingerprint part of admitting a group of 16 samples (the group's
  fingerprints against the trainer's record, `_fingerprint_reason`, and the verified count,
  `fingerprint_tally`) against the whole admission check of the group (`invalid_reason`, which
  includes it).

Each ratio is the fingerprint's share of its peer (0.1 = the fingerprint costs a tenth of the
work beside it); the best of the repeats, as in every benchmark here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from asyncrl import fingerprint
from asyncrl.tiny import build_tiny_model
from asyncrl.weights import load_state_dict_files
from bench.report import Context, Result
from bench.transport import make_groups
from services.trainer.publish import write_version
from services.trainer.validation import (
    Admission,
    _fingerprint_reason,
    fingerprint_tally,
    invalid_reason,
)

NAME = "fingerprint"
DEMO = {"hidden_size": 64, "num_layers": 2, "intermediate_size": 256}
"""examples/arith's model (WarmStartConfig)."""
LARGER = {"hidden_size": 512, "num_layers": 8, "intermediate_size": 2048, "num_heads": 8}
LARGER_QUICK = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 1024}
GROUP_SAMPLES = 16
"""Samples per group (the demo's n_samples)."""


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _per_version(ctx: Context, label: str, config: dict) -> list[Result]:
    model_dir = ctx.work_dir / f"fp-{label}"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, family="qwen2", **config)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # the version's files as the trainer holds them (TrainerBackend.hf_files: save_hf's files)
    names = ["config.json", *(p.name for p in model_dir.glob("*.safetensors"))]
    files = {name: (model_dir / name).read_bytes() for name in names}
    mb = sum(len(v) for k, v in files.items() if k.endswith(".safetensors")) / 2**20
    repeats = ctx.size(5, 2)
    store = ctx.work_dir / f"fp-store-{label}"
    version = iter(range(1, 10_000))

    def publish() -> None:
        write_version(store, "bench", next(version), files, model_dir, keep=2)

    def update() -> None:
        model.load_state_dict(load_state_dict_files(str(model_dir)), strict=False)

    loaded = load_state_dict_files(str(model_dir))
    trainer_fp = _best_s(lambda: fingerprint.of_files(files), repeats)
    rollout_fp = _best_s(lambda: fingerprint.of_state(loaded), repeats)
    settings = {"model": label, **config, "weights_mb": round(mb, 1), "repeats": repeats}
    return [
        Result(
            NAME,
            f"{label}: trainer fingerprint s per version (of the files)",
            trainer_fp,
            "s",
            "write_version (the publish, fingerprint included)",
            _best_s(publish, repeats),
            settings,
        ),
        Result(
            NAME,
            f"{label}: rollout fingerprint s per version (of the tensors read)",
            rollout_fp,
            "s",
            "the weight update without it: read the files + load_state_dict",
            _best_s(update, repeats),
            settings,
        ),
    ]


def _per_group(ctx: Context) -> Result:
    fp = "sha256:" + "ab" * 32
    [group] = make_groups("bench", 1, GROUP_SAMPLES, 16)  # every sample at version 3
    group.fingerprints = {3: fp}
    known = {3: fp}
    admission = Admission("bench", vocab_size=100, trainer_version=4, eta=2, fingerprints=known)
    rounds = ctx.size(20_000, 2_000)

    def check_fingerprints() -> None:
        for _ in range(rounds):
            _fingerprint_reason(group, admission)
            fingerprint_tally(group, known)

    def admit() -> None:
        for _ in range(rounds):
            invalid_reason(group, admission)
            fingerprint_tally(group, known)

    assert invalid_reason(group, admission) == ""  # the whole check passes: nothing cut short
    repeats = ctx.size(5, 2)
    return Result(
        NAME,
        f"trainer fingerprint check µs per group ({GROUP_SAMPLES} samples)",
        _best_s(check_fingerprints, repeats) / rounds * 1e6,
        "µs",
        "the trainer's whole admission check of the group (it included)",
        _best_s(admit, repeats) / rounds * 1e6,
        {"samples": GROUP_SAMPLES, "rounds": rounds, "repeats": repeats},
    )


def run(ctx: Context) -> list[Result]:
    results = _per_version(ctx, "demo", DEMO)
    results += _per_version(ctx, "larger", ctx.size(LARGER, LARGER_QUICK))
    results.append(_per_group(ctx))
    return results


if __name__ == "__main__":  # python -m bench.fingerprint: print the results
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for r in run(Context(work_dir=Path(d), quick=False)):
            print(
                f"{r.metric}: {r.value:.4g} {r.unit} / {r.peer} {r.peer_value:.4g} = {r.ratio:.3f}"
            )
