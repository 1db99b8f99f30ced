"""Build the demo: the data sets and a warm-started tiny model.

    python -m examples.arith.build --out var/demo/model [--data var/demo] [--seed 0]

Writes <data>/train.jsonl and <data>/eval.jsonl (keys prompt, answer; disjoint), builds a
tiny Qwen2-architecture model with a character tokenizer, and warm-starts it with teacher
forcing on correct answers just until its greedy accuracy on the eval set reaches
`--target` (0.15 by default). The model is stopped in the middle of learning the task, on
purpose: RL from the exact-match reward then has most of the accuracy left to win. The
warm-started model is saved as the HuggingFace directory the experiment trains
(`model.path` in experiment.yaml); a `warmstart.json` beside it records what was done.
Deterministic under the seed (single-threaded torch).
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
    """Stop the warm start once greedy eval accuracy reaches this."""
    eval_every: int = 10
    max_steps: int = 4000


def warm_start(
    model,
    tok,
    train: list[dict],
    evals: list[dict],
    cfg: WarmStartConfig,
    seed: int,
    console: Console,
) -> dict:
    """Teacher forcing on prompt + answer + EOS (loss on the answer tokens and EOS only)."""
    rng = random.Random(seed)
    eos = tok.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    t0 = time.monotonic()
    loss = acc = float("nan")
    for step in range(1, cfg.max_steps + 1):
        seqs, masks = [], []
        for row in rng.sample(train, cfg.batch_size):
            p = tok(row["prompt"], add_special_tokens=False).input_ids
            a = tok(row["answer"], add_special_tokens=False).input_ids + [eos]
            seqs.append(p + a)
            masks.append([0.0] * (len(p) - 1) + [1.0] * len(a))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        mask = torch.tensor([m + [0.0] * (width - 1 - len(m)) for m in masks])
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1)
        nll = -(logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask).sum() / mask.sum()
        opt.zero_grad()
        nll.backward()
        opt.step()
        loss = nll.item()
        if step % cfg.eval_every == 0:
            acc = greedy_accuracy(model, tok, evals)
            if step % (cfg.eval_every * 20) == 0 or acc >= cfg.target_accuracy:
                console.log(f"step {step:5d}  loss {loss:.3f}  greedy eval accuracy {acc:.3f}")
            if acc >= cfg.target_accuracy:
                break
    return {
        "steps": step,
        "loss": loss,
        "greedy_eval_accuracy": acc,
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
