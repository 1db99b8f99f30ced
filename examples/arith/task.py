"""The arithmetic task: three-digit addition written little-endian.

Numbers are written least-significant digit first, operands zero-padded to three digits:
123 + 456 = 579 is the prompt "321+654=" with the answer "975". This is the digit order in
which small transformers learn addition quickly (each answer digit depends on the two aligned
operand digits and the carry out of the digit just written), so a tiny model gets through
supervised warm start in seconds and RL has a real skill left to sharpen.

The reward is the reward service's `exact_match`: the completion, stripped, equals the answer
(the completion ends with EOS, which decoding drops).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from asyncrl.rewards import exact_match

WIDTH = 3


def little_endian(n: int, width: int = 0) -> str:
    return f"{n:0{width}d}"[::-1]


def problem(a: int, b: int) -> dict:
    return {
        "prompt": f"{little_endian(a, WIDTH)}+{little_endian(b, WIDTH)}=",
        "answer": little_endian(a + b),
    }


def make_split(seed: int, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """Disjoint (train, eval) problem lists: distinct operand pairs drawn under `seed`."""
    rng = random.Random(seed)
    top = 10**WIDTH
    if n_train + n_eval > top * top:
        raise ValueError(f"{n_train} + {n_eval} problems requested, {top * top} exist")
    pairs: dict[tuple[int, int], None] = {}  # insertion-ordered set
    while len(pairs) < n_train + n_eval:
        pairs[(rng.randrange(top), rng.randrange(top))] = None
    rows = [problem(a, b) for a, b in pairs]
    return rows[n_eval:], rows[:n_eval]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@torch.no_grad()
def greedy_decode(model, ids: torch.Tensor, max_new_tokens: int, eos_id: int) -> list[list[int]]:
    """Greedy completions of a batch of equal-length prompts, each cut after its first EOS."""
    seq = ids
    for _ in range(max_new_tokens):
        nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        if (seq[:, ids.shape[1] :] == eos_id).any(dim=1).all():
            break
    outs = []
    for row in seq[:, ids.shape[1] :].tolist():
        outs.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return outs


@torch.no_grad()
def greedy_accuracy(model, tok, rows: list[dict], max_new_tokens: int = 6) -> float:
    """Fraction of prompts whose greedy completion exactly matches the answer. Prompts are
    decoded in batches of equal length (no padding needed)."""
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        by_len.setdefault(len(r["prompt"]), []).append(r)
    correct = 0.0
    for bucket in by_len.values():
        ids = torch.tensor([tok(r["prompt"], add_special_tokens=False).input_ids for r in bucket])
        outs = greedy_decode(model, ids, max_new_tokens, tok.eos_token_id)
        for r, out in zip(bucket, outs, strict=True):
            correct += exact_match(tok.decode(out, skip_special_tokens=True), r["answer"])
    return correct / len(rows)
