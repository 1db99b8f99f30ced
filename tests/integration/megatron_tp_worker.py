"""Multi-process half of tests/integration/test_megatron_backend.py.

    torchrun --nproc_per_node 2 tests/integration/megatron_tp_worker.py MODEL_DIR OUT_DIR

runs `run_case` with TP=2 (then DP=2) on two gloo ranks -- rank 0 drives the backend, rank 1
`follow()`s it, exactly as under the trainer service -- and the test runs the same case with TP=1
in-process and compares logprobs, losses and the exported weights. `make_groups` is shared so
both sides train on identical trajectories.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

from asyncrl.spec import ExperimentSpec
from asyncrl.types import RewardStatus, Sample, TrajectoryGroup
from services.trainer.algo import pack_groups, token_logprobs

# a non-default objective whose parts span the whole batch (m2po's second moment, per-sample
# means): DP ranks must agree with one rank on them
CASE_TRAINER = dict(
    lr=1e-3,
    minibatches=2,
    kl_coef=0.05,
    grad_clip=1.0,
    offpolicy_correction="m2po",
    m2po_bound=0.05,
    loss_agg="seq_mean_token_mean",
)
MICRO_BATCH = 2


def make_spec(model_dir: str | Path, **trainer) -> ExperimentSpec:
    return ExperimentSpec(
        model={"path": str(model_dir)},
        dataset={"path": "unused.jsonl"},
        trainer={"backend": "megatron", **trainer},
        seed=3,
    )


def make_groups(
    model_dir: str | Path, seed: int = 0, n_groups: int = 3, n: int = 3
) -> list[TrajectoryGroup]:
    """Random prompts/outputs with behaviour logprobs near the model's own (noise +-0.5, and a
    few tokens 2.0 lower so the behaviour-weight cap masks them), one FAILED reward."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = cfg["vocab_size"]
    groups = []
    for gi in range(n_groups):
        prompt = torch.randint(4, vocab, (4 + gi,), generator=g).tolist()
        samples = []
        for si in range(n):
            out = torch.randint(4, vocab, (3 + (si + gi) % 4,), generator=g).tolist()
            samples.append(
                Sample(
                    output_ids=out,
                    logprobs=[],
                    versions=[0] * len(out),
                    reward=float((si + gi) % 2),
                )
            )
        if gi == 1:
            samples[0].reward_status = RewardStatus.FAILED
        groups.append(TrajectoryGroup("exp", f"g{gi}", f"p{gi}", "", "", prompt, samples))

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    batch = pack_groups(groups, pad_id=cfg.get("pad_token_id") or 0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    true = token_logprobs(logits[:, :-1], batch.targets)
    row = 0
    for grp in groups:
        p = len(grp.prompt_ids)
        for s in grp.samples:
            lp = true[row, p - 1 : p - 1 + len(s.output_ids)]
            noise = (torch.rand(lp.shape, generator=g) - 0.5) - 2.0 * (
                torch.rand(lp.shape, generator=g) < 0.15
            )
            s.logprobs = (lp + noise).tolist()
            row += 1
    return groups


def run_case(model_dir: str | Path, out_dir: Path, tp: int, dp: int) -> dict:
    """logprobs, two train steps (with a checkpoint between them, restored into a second
    backend that repeats step 2), HF export after step 1. Run on rank 0."""
    from services.trainer.backends.megatron_backend import MegatronBackend

    spec = make_spec(model_dir, tp_size=tp, dp_size=dp, **CASE_TRAINER)
    groups1, groups2 = make_groups(model_dir, seed=1), make_groups(model_dir, seed=2)
    backend = MegatronBackend(spec, micro_batch_size=MICRO_BATCH)
    backend.load(str(model_dir))
    logprobs = backend.logprobs(groups1)
    m1 = backend.train_step(groups1)
    backend.save_hf(out_dir / "step1")
    backend.save_checkpoint(out_dir / "ckpt")
    m2 = backend.train_step(groups2)

    restored = MegatronBackend(spec, micro_batch_size=MICRO_BATCH)
    restored.load(str(model_dir))
    restored.load_checkpoint(out_dir / "ckpt")
    m2_restored = restored.train_step(groups2)
    restored.close()
    return {"logprobs": logprobs, "m1": m1, "m2": m2, "m2_restored": m2_restored}


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from services.trainer.backends.megatron_backend import follow
    from services.trainer.megatron.parallel import init_default_group, shutdown_distributed

    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    init_default_group()
    for name, tp, dp in (("tp2", 2, 1), ("dp2", 1, 2)):
        if dist.get_rank() == 0:
            result = run_case(model_dir, out_dir / name, tp, dp)
            (out_dir / name / "result.json").write_text(json.dumps(result))
        else:
            follow()
    shutdown_distributed()


if __name__ == "__main__":
    main()
