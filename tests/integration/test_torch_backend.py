"""TorchBackend on a real tiny HF model: logprob alignment, learning direction, KL, HF export
and bit-exact checkpoint resume."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.spec import validate_spec
from asyncrl.tiny import build_tiny_model
from asyncrl.types import RewardStatus, Sample, TrajectoryGroup
from services.trainer.backends.torch_backend import TorchBackend

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_model(d, hidden_size=32, num_layers=1, intermediate_size=64, seed=0)
    return str(d)


def make_backend(model_dir, **trainer):
    spec = validate_spec(
        {
            "model": {"path": model_dir},
            "dataset": {"path": "unused.jsonl"},
            "trainer": {"backend": "torch", "lr": 1e-2, **trainer},
        }
    )
    be = TorchBackend(spec, device="cpu")
    be.load(model_dir)
    return be


def make_groups(seed: int, n_groups: int = 2, n: int = 4) -> list[TrajectoryGroup]:
    """Random prompts/outputs with rewards 1, 0, 0, ... per group; behaviour logprobs are
    filled in by the caller (see `on_policy`)."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(4, 90) for _ in range(rng.randint(2, 5))]
        samples = []
        for i in range(n):
            out = [rng.randrange(4, 90) for _ in range(rng.randint(1, 4))]
            samples.append(Sample(out, [0.0] * len(out), [0] * len(out), reward=float(i == 0)))
        groups.append(TrajectoryGroup("e", f"g{seed}-{g}", f"p{g}", "", "", prompt, samples))
    return groups


def on_policy(be: TorchBackend, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    for g, per_sample in zip(groups, be.logprobs(groups), strict=True):
        for s, lp in zip(g.samples, per_sample, strict=True):
            s.logprobs = lp
    return groups


def test_logprobs_match_an_unpadded_forward_pass(model_dir):
    be = make_backend(model_dir)
    groups = make_groups(0)
    got = be.logprobs(groups)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for g, per_sample in zip(groups, got, strict=True):
        for s, lp in zip(g.samples, per_sample, strict=True):
            ids = torch.tensor([g.prompt_ids + s.output_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
            p = len(g.prompt_ids)
            want = [logp[p - 1 + j, t].item() for j, t in enumerate(s.output_ids)]
            assert lp == pytest.approx(want, abs=1e-5)


def test_train_step_on_policy_raises_logprob_of_rewarded_sample(model_dir):
    be = make_backend(model_dir)
    groups = on_policy(be, make_groups(1))
    before = [sum(per[0]) for per in be.logprobs(groups)]
    m = be.train_step(groups)
    after = [sum(per[0]) for per in be.logprobs(groups)]
    assert all(a > b for a, b in zip(after, before, strict=True))
    assert set(m) >= {"loss", "clip_fraction", "entropy", "kl", "grad_norm", "tokens"}
    # on policy with one minibatch: ratio 1 and behaviour weight 1 everywhere
    assert m["clip_fraction"] == 0.0
    assert m["behav_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["tokens"] == sum(len(s.output_ids) for g in groups for s in g.samples)
    assert m["entropy"] > 0 and m["grad_norm"] > 0


def test_train_step_minibatches_take_one_optimizer_step_each(model_dir):
    be = make_backend(model_dir, minibatches=4)
    be.train_step(on_policy(be, make_groups(2)))
    steps = {int(s["step"]) for s in be.optimizer.state_dict()["state"].values()}
    assert steps == {4}


def test_train_step_linear_schedule_sets_optimizer_lr_per_version(model_dir):
    be = make_backend(model_dir, lr_schedule="linear", min_lr_ratio=0.5, total_steps=3)
    seen = []
    for seed in range(3):
        be.train_step(on_policy(be, make_groups(seed)))
        seen.append(be.optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx([1e-2, 7.5e-3, 5e-3])


def test_train_step_failed_samples_contribute_no_tokens(model_dir):
    be = make_backend(model_dir)
    groups = on_policy(be, make_groups(3))
    for s in groups[0].samples:
        s.reward_status = RewardStatus.FAILED
    m = be.train_step(groups)
    assert m["tokens"] == sum(len(s.output_ids) for s in groups[1].samples)


def test_train_step_all_failed_leaves_weights_unchanged(model_dir):
    be = make_backend(model_dir, minibatches=2)
    be.train_step(on_policy(be, make_groups(8)))  # Adam now has momentum
    before = {k: v.clone() for k, v in be.model.state_dict().items()}
    groups = on_policy(be, make_groups(9))
    for g in groups:
        for s in g.samples:
            s.reward_status = RewardStatus.FAILED
    assert be.train_step(groups)["tokens"] == 0
    for k, v in be.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_train_step_kl_is_zero_at_start_and_positive_once_weights_move(model_dir):
    be = make_backend(model_dir, kl_coef=0.1, minibatches=2)
    assert be.ref_model is not None
    groups = on_policy(be, make_groups(4))
    m1 = be.train_step(groups)
    # minibatch 1 runs on the initial weights (kl 0), minibatch 2 after one update (kl > 0)
    assert m1["kl"] > 0
    m2 = be.train_step(on_policy(be, make_groups(5)))
    assert m2["kl"] > 0
    no_kl = make_backend(model_dir)
    assert no_kl.ref_model is None
    assert no_kl.train_step(on_policy(no_kl, make_groups(4)))["kl"] == 0.0


def test_save_hf_roundtrip_gives_same_logprobs(model_dir, tmp_path):
    be = make_backend(model_dir)
    be.train_step(on_policy(be, make_groups(6)))
    be.save_hf(tmp_path / "v1")
    assert (tmp_path / "v1" / "config.json").is_file()
    assert (tmp_path / "v1" / "model.safetensors").is_file()
    assert (tmp_path / "v1" / "tokenizer.json").is_file()
    other = make_backend(str(tmp_path / "v1"))
    groups = make_groups(7)
    assert other.logprobs(groups) == be.logprobs(groups)


def test_checkpoint_resume_is_bit_identical_to_uninterrupted_run(model_dir, tmp_path):
    batches = [make_groups(10 + i) for i in range(3)]
    kw = dict(minibatches=2, kl_coef=0.05, weight_decay=0.01)

    straight = make_backend(model_dir, **kw)
    for b in batches[:2]:
        straight.train_step(on_policy(straight, b))
    straight.save_checkpoint(tmp_path / "ckpt")
    want = straight.train_step(on_policy(straight, batches[2]))

    resumed = make_backend(model_dir, **kw)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.steps == 2
    got = resumed.train_step(on_policy(resumed, batches[2]))

    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_nonfinite_weight_named_and_step_check_names_step(model_dir):
    from services.trainer.backends.base import Diverged, check_finite_step

    be = make_backend(model_dir)
    assert be.nonfinite_weight() is None
    check_finite_step(be, {"loss": 0.5, "grad_norm": 1.0}, 3)  # finite: nothing raised
    with pytest.raises(Diverged, match=r"^diverged: grad_norm is inf at the step to v3$"):
        check_finite_step(be, {"loss": 0.5, "grad_norm": float("inf")}, 3)
    name, param = next(iter(be.model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    assert be.nonfinite_weight() == name
    with pytest.raises(Diverged) as e:
        check_finite_step(be, {"loss": 0.5, "grad_norm": 1.0}, 4)
    assert str(e.value) == f"diverged: non-finite weights at v4 ({name})"
    with torch.no_grad():  # finite in fp32, but its square (a forward's norm) is not
        param.view(-1)[0] = 1e30
    assert be.nonfinite_weight() == name
    param.data.view(-1)[0] = 1e19  # within the bound: a forward keeps it finite
    assert be.nonfinite_weight() is None
