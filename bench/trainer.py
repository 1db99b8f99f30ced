"""Trainer step: one `train_step` on the same groups, TorchBackend vs MegatronBackend (TP=1).

Both backends load the same tiny HF model and train the same synthetic groups with the same
spec (one minibatch, no KL); megatron runs the whole minibatch as one micro-batch so both do
the same shapes of work. Step time is the best of `repeats` steps after one warm-up step;
tokens/s counts the loss tokens the step reports.
"""

from __future__ import annotations

import json
import time
import warnings

import torch

from asyncrl.spec import ExperimentSpec
from asyncrl.types import Sample, TrajectoryGroup
from bench.report import Context, Result, Skip

NAME = "trainer"


def make_groups(
    vocab: int, n_groups: int, n: int, prompt_len: int, out_len: int
) -> list[TrajectoryGroup]:
    """Deterministic random groups; rewards alternate so GRPO advantages are non-zero and the
    behaviour logprobs are plausible (-log vocab) so the importance weights stay near 1."""
    g = torch.Generator().manual_seed(0)
    lp = -float(torch.log(torch.tensor(float(vocab))))
    groups = []
    for gi in range(n_groups):
        prompt = torch.randint(4, vocab, (prompt_len,), generator=g).tolist()
        samples = [
            Sample(
                output_ids=(out := torch.randint(4, vocab, (out_len,), generator=g).tolist()),
                logprobs=[lp] * len(out),
                versions=[0] * len(out),
                reward=float((si + gi) % 2),
            )
            for si in range(n)
        ]
        groups.append(TrajectoryGroup("bench", f"g{gi}", f"p{gi}", "", "", prompt, samples))
    return groups


def _step_seconds(backend, groups, repeats: int) -> tuple[float, float]:
    """(best step time, loss tokens per step) after one warm-up step."""
    tokens = backend.train_step(groups)["tokens"]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        backend.train_step(groups)
        best = min(best, time.perf_counter() - t0)
    return best, tokens


def run(ctx: Context) -> list[Result]:
    try:
        from services.trainer.backends.megatron_backend import MegatronBackend
    except ImportError as exc:  # megatron-core is pinned, but keep the torch numbers reachable
        raise Skip(f"megatron backend unavailable: {exc}") from exc
    from services.trainer.backends.torch_backend import TorchBackend

    warnings.filterwarnings("ignore")
    n_groups, n = ctx.size(4, 2), ctx.size(8, 2)
    prompt_len, out_len = ctx.size(24, 4), ctx.size(64, 4)
    repeats = ctx.size(5, 1)
    model_dir = ctx.tiny_model()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    groups = make_groups(vocab, n_groups, n, prompt_len, out_len)

    def spec(backend: str) -> ExperimentSpec:
        return ExperimentSpec(
            model={"path": str(model_dir)},
            dataset={"path": "unused.jsonl"},
            trainer={"backend": backend, "lr": 1e-4, "batch_size": n_groups, "minibatches": 1},
            seed=0,
        )

    torch_backend = TorchBackend(spec("torch"), device="cpu")
    torch_backend.load(str(model_dir))
    torch_s, tokens = _step_seconds(torch_backend, groups, repeats)

    megatron = MegatronBackend(spec("megatron"), micro_batch_size=n_groups * n)
    megatron.load(str(model_dir))
    mg_s, mg_tokens = _step_seconds(megatron, groups, repeats)
    megatron.close()
    assert tokens == mg_tokens, (tokens, mg_tokens)

    settings = {
        "groups": n_groups,
        "samples_per_group": n,
        "prompt_tokens": prompt_len,
        "output_tokens": out_len,
        "loss_tokens": int(tokens),
        "minibatches": 1,
        "megatron_micro_batch": n_groups * n,
        "tp": 1,
        "repeats": repeats,
        "model": ctx.model_config() or "tiny default",
    }
    return [
        Result(
            NAME,
            "MegatronBackend step time (TP=1)",
            mg_s,
            "s",
            "TorchBackend step time",
            torch_s,
            settings,
        ),
        Result(
            NAME,
            "MegatronBackend tokens/s (TP=1)",
            mg_tokens / mg_s,
            "tok/s",
            "TorchBackend tokens/s",
            tokens / torch_s,
            settings,
        ),
    ]
