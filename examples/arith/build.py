"""Build the demo: the data sets and a warm-started tiny model.

    python -m examples.arith.build --out var/demo/model [--data var/demo] [--seed 0]

Writes <data>/train.jsonl and <data>/eval.jsonl (keys prompt, answer; disjoint), builds a
tiny Qwen2-architecture model with a character tokenizer, and warm-starts it with teacher
forcing on correct answers until its greedy accuracy on the eval set reaches `--target`
(0.15 by default), then bisects along the last step for the accuracy closest to it. The
model is stopped in the middle of learning the task, on purpose: RL from the exact-match reward then has most of the accuracy left to win. The
warm-started model is saved as the HuggingFace directory the experiment trains
(`model.path` in experiment.yaml); a `warmstart.json` beside it records what was done.
Deterministic under the seed on one machine (single-threaded torch); on another CPU the
float path differs, and the bisection still lands near the target (`warmstart.json` records
the accuracy reached).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console

from asyncrl.tiny import build_tiny_model
from examples.arith.task import greedy_accuracy, make_split, write_jsonl


@dataclass
class WarmStartConfig:
    hidden_size: int = 64
    num_layers: int = 2
    intermediate_size: int = 256
    n_train: int = 20000
    """Training prompts (far more than a demo run consumes)."""
    n_eval: int = 200
    lr: float = 1e-3
    batch_size: int = 64
    target_accuracy: float = 0.15
    """Stop the warm start once greedy eval accuracy reaches this; keep the closest checkpoint."""
    eval_every: int = 10
    """Steps between greedy evaluations while the accuracy is far below the target."""
    near_fraction: float = 0.2
    """From accuracy >= near_fraction * target on, evaluate after every step."""
    tolerance: float = 0.02
    """How close to the target the bisection between the last two checkpoints settles."""
    max_steps: int = 4000


def _batch(tok, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of prompt + answer + EOS, padded, and the mask of the answer and EOS targets."""
    eos = tok.eos_token_id
    seqs, masks = [], []
    for row in rows:
        p = tok(row["prompt"], add_special_tokens=False).input_ids
        a = tok(row["answer"], add_special_tokens=False).input_ids + [eos]
        seqs.append(p + a)
        masks.append([0.0] * (len(p) - 1) + [1.0] * len(a))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([m + [0.0] * (width - 1 - len(m)) for m in masks])
    return ids, mask


def _blend(before: dict, after: dict, alpha: float) -> dict:
    return {k: torch.lerp(before[k], after[k], alpha) for k in before}


def _settle(model, tok, evals, before: dict, acc_before: float, acc_after: float, cfg) -> dict:
    """Bisect along the last training step, from the weights `before` it (below the target)
    to the model's current ones (at or above it), for the accuracy closest to the target."""
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    target = cfg.target_accuracy
    best = min(
        (abs(acc_before - target), 0.0, acc_before), (abs(acc_after - target), 1.0, acc_after)
    )
    lo, hi = 0.0, 1.0
    for _ in range(8):
        if best[0] <= cfg.tolerance:
            break
        mid = (lo + hi) / 2
        model.load_state_dict(_blend(before, after, mid))
        acc = greedy_accuracy(model, tok, evals)
        best = min(best, (abs(acc - target), mid, acc))
        lo, hi = (mid, hi) if acc < target else (lo, mid)
    model.load_state_dict(_blend(before, after, best[1]))
    return {"greedy_eval_accuracy": best[2], "blend": best[1]}


def warm_start(
    model,
    tok,
    train: list[dict],
    evals: list[dict],
    cfg: WarmStartConfig,
    seed: int,
    console: Console,
) -> dict:
    """Teacher forcing on prompt + answer + EOS (loss on the answer tokens and EOS only).

    Greedy accuracy climbs steeply once answers start to come out right (one step can take it
    from 0.08 to 0.19), and the float path, so the exact curve, differs between CPUs. So once
    it is within reach of the target every step is evaluated, and at the first step at or
    above the target the weights are bisected between the two last checkpoints
    (`_settle`), so the model lands near the target whatever the CPU's float path."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    t0 = time.monotonic()
    acc = 0.0
    before, acc_before = None, 0.0
    for step in range(1, cfg.max_steps + 1):
        near = acc >= cfg.near_fraction * cfg.target_accuracy
        if near or step % cfg.eval_every == 1:
            before = {k: v.detach().clone() for k, v in model.state_dict().items()}
            acc_before = acc
        ids, mask = _batch(tok, rng.sample(train, cfg.batch_size))
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1)
        nll = -(logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask).sum() / mask.sum()
        opt.zero_grad()
        nll.backward()
        opt.step()
        loss = nll.item()
        if not near and step % cfg.eval_every:
            continue
        acc = greedy_accuracy(model, tok, evals)
        if step % (cfg.eval_every * 20) == 0:
            console.log(f"step {step:5d}  loss {loss:.3f}  greedy eval accuracy {acc:.3f}")
        if acc >= cfg.target_accuracy:
            break
    settled = _settle(model, tok, evals, before, acc_before, acc, cfg)
    console.log(
        f"step {step:5d}  loss {loss:.3f}: accuracy {acc_before:.3f} before the step, "
        f"{acc:.3f} after; settled at {settled['greedy_eval_accuracy']:.3f} "
        f"({settled['blend']:.3f} of the step)"
    )
    return {
        "steps": step,
        "loss": loss,
        **settled,
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="var/demo/model", help="model directory to write")
    ap.add_argument(
        "--data", default=None, help="where train/eval.jsonl go (default: parent of --out)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--target",
        type=float,
        default=WarmStartConfig.target_accuracy,
        help="greedy eval accuracy at which the warm start stops",
    )
    args = ap.parse_args(argv)
    cfg = WarmStartConfig(target_accuracy=args.target)
    out = Path(args.out)
    data = Path(args.data) if args.data else out.parent
    console = Console()
    torch.set_num_threads(1)

    train, evals = make_split(args.seed, cfg.n_train, cfg.n_eval)
    write_jsonl(data / "train.jsonl", train)
    write_jsonl(data / "eval.jsonl", evals)
    console.log(
        f"wrote {len(train)} train and {len(evals)} eval prompts to {data}/ "
        f"(e.g. {train[0]['prompt']}{train[0]['answer']})"
    )

    model, tok = build_tiny_model(
        out,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        intermediate_size=cfg.intermediate_size,
        seed=args.seed,
    )
    n_params = sum(p.numel() for p in model.parameters())
    console.log(
        f"tiny qwen2 model: {n_params} parameters; warm start to accuracy >= {cfg.target_accuracy}"
    )
    result = warm_start(model, tok, train, evals, cfg, args.seed, console)
    model.save_pretrained(str(out), safe_serialization=True)
    summary = {"seed": args.seed, "parameters": n_params, **result, "config": asdict(cfg)}
    (out / "warmstart.json").write_text(json.dumps(summary, indent=2))
    console.log(
        f"warm start: {result['steps']} steps in {result['seconds']}s, loss "
        f"{result['loss']:.3f}, initial greedy eval accuracy "
        f"{result['greedy_eval_accuracy']:.3f}; model saved to {out}"
    )
    return summary


if __name__ == "__main__":
    main()
