"""The megatron-core backend against the HuggingFace model it was built from (fp32, CPU, gloo).

Acceptance: HF -> Megatron -> HF export is exact; logprobs and one optimizer step match a
plain HF + services.trainer.algo reference within 1e-4; every choice of the objective
(services.trainer.losses) gives the torch backend's metrics within 1e-5; TP=2 and DP=2 (two gloo ranks under torchrun)
match TP=1; a checkpoint restored into a fresh backend continues bit-for-bit.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.net import free_port
from asyncrl.tiny import build_tiny_model
from services.trainer.algo import pack_groups, ppo_decoupled_loss, token_logprobs
from services.trainer.losses import ADVANTAGES, AGGREGATIONS, CORRECTIONS, KL_ESTIMATORS
from tests.integration.megatron_tp_worker import MICRO_BATCH, make_groups, make_spec, run_case

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

warnings.filterwarnings("ignore")
pytest.importorskip("megatron.core")

from services.trainer.backends.megatron_backend import MegatronBackend  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """A tied Qwen2 (qkv bias) and an untied Llama."""
    root = tmp_path_factory.mktemp("tiny")
    build_tiny_model(root / "qwen2", family="qwen2", tie_word_embeddings=True, seed=1)
    build_tiny_model(root / "llama", family="llama", tie_word_embeddings=False, seed=2)
    return {"qwen2": root / "qwen2", "llama": root / "llama"}


def _loaded(model_dir: Path, **trainer) -> MegatronBackend:
    backend = MegatronBackend(make_spec(model_dir, **trainer), micro_batch_size=MICRO_BATCH)
    backend.load(str(model_dir))
    return backend


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_save_hf_after_load_weights_exact_and_loadable(tiny_models, tmp_path, family):
    src = tiny_models[family]
    backend = _loaded(src)
    backend.save_hf(tmp_path / "out")

    original, exported = (
        load_file(str(src / "model.safetensors")),
        load_file(str(tmp_path / "out/model.safetensors")),
    )
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((tmp_path / "out/config.json").read_text()) == json.loads(
        (src / "config.json").read_text()
    )
    reloaded = _hf_model(tmp_path / "out")  # what the rollout engine does with a new version
    assert torch.equal(reloaded.model.embed_tokens.weight, original["model.embed_tokens.weight"])


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_logprobs_same_weights_match_hf_forward(tiny_models, family):
    src = tiny_models[family]
    groups = make_groups(src, seed=5)
    got = _loaded(src).logprobs(groups)

    batch = pack_groups(groups)
    with torch.no_grad():
        logits = _hf_model(src)(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).logits
    ref = token_logprobs(logits[:, :-1], batch.targets)
    row, worst = 0, 0.0
    for g, per_sample in zip(groups, got, strict=True):
        p = len(g.prompt_ids)
        for s, lp in zip(g.samples, per_sample, strict=True):
            assert len(lp) == len(s.output_ids)
            want = ref[row, p - 1 : p - 1 + len(s.output_ids)]
            worst = max(worst, (torch.tensor(lp) - want).abs().max().item())
            row += 1
    assert worst <= TOL


def _hf_reference_step(model_dir: Path, groups, t) -> tuple[float, dict[str, torch.Tensor]]:
    """One decoupled-PPO update of the HF model (whole batch, AdamW, clip_grad_norm_)."""
    model = _hf_model(model_dir)
    batch = pack_groups(groups)

    def logp():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return token_logprobs(out[:, :-1], batch.targets)

    with torch.no_grad():
        prox = logp()
    opt = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay
    )
    loss, _ = ppo_decoupled_loss(
        logp(),
        prox,
        batch.behav_logp,
        batch.advantages,
        batch.loss_mask,
        eps_clip=t.eps_clip,
        behav_imp_weight_cap=t.behav_imp_weight_cap,
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    opt.step()
    return loss.item(), {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_train_step_micro_batched_matches_hf_reference_step(tiny_models, tmp_path, family):
    src = tiny_models[family]
    groups = make_groups(src, seed=7)
    backend = _loaded(src, lr=1e-3, grad_clip=0.5)  # 9 samples in micro-batches of 2
    metrics = backend.train_step(groups)
    backend.save_hf(tmp_path / "out")

    ref_loss, ref_weights = _hf_reference_step(src, groups, backend.spec.trainer)
    assert metrics["loss"] == pytest.approx(ref_loss, abs=TOL)
    assert metrics["loss"] != 0.0
    exported = load_file(str(tmp_path / "out/model.safetensors"))
    assert _max_diff(exported, {k: ref_weights[k] for k in exported}) <= TOL
    moved = _max_diff(exported, load_file(str(src / "model.safetensors")))
    assert moved > 1e-4  # the step really changed the weights


def test_micro_batch_tokens_sets_rows_per_pass_same_step(tiny_models, tmp_path):
    """trainer.micro_batch_tokens: rows per forward pass = tokens // padded length (at least
    one); one row per pass and the whole batch in one pass train the same step."""
    src = tiny_models["llama"]
    groups = make_groups(src, seed=4)
    width = pack_groups(groups).input_ids.shape[1]
    results = {}
    for tokens in (1, 3 * width + 1, 8192):
        backend = MegatronBackend(make_spec(src, lr=1e-3, micro_batch_tokens=tokens))
        backend.load(str(src))
        rows = backend._micro_rows(pack_groups(groups))
        metrics = backend.train_step(groups)
        backend.save_hf(tmp_path / str(tokens))
        results[rows] = metrics, load_file(str(tmp_path / str(tokens) / "model.safetensors"))
    assert sorted(results) == [1, 3, 8192 // width]
    (m1, w1), (m_all, w_all) = results[1], results[8192 // width]
    for key in ("loss", "entropy", "clip_fraction", "grad_norm", "behav_weight_mean"):
        assert m1[key] == pytest.approx(m_all[key], abs=TOL), key
        assert results[3][0][key] == pytest.approx(m_all[key], abs=TOL), key
    assert _max_diff(w1, w_all) <= TOL


PARITY_KEYS = (
    "loss",
    "kl",
    "entropy",
    "clip_fraction",
    "grad_norm",
    "behav_weight_mean",
    "behav_weight_max",
    "is_masked_fraction",
    "is_truncated_fraction",
    "logprob_diff_mean",
    "logprob_diff_max",
    "logprob_diff_tokens",
    "tokens",
)
PARITY_TOL = 1e-5
OBJECTIVES = [
    {"kl_coef": 0.05},  # today's objective: grpo, token_cap, token_mean, k3 in the loss
    *({"offpolicy_correction": c} for c in CORRECTIONS[1:]),
    {"offpolicy_correction": "m2po", "m2po_bound": 0.02},  # masks some tokens of this batch
    *({"advantage": a} for a in ADVANTAGES[1:]),
    *({"loss_agg": a, "loss_agg_constant": 6} for a in AGGREGATIONS[1:]),
    *({"kl_coef": 0.05, "kl_estimator": k} for k in KL_ESTIMATORS[:2]),
    *({"kl_coef": 0.05, "kl_estimator": k, "kl_in": "reward"} for k in KL_ESTIMATORS),
    {"entropy_coef": 0.01},
    {"eps_clip": 0.1, "eps_clip_high": 0.28, "dual_clip": 2.0},
    {"offpolicy_correction": "cispo", "cispo_eps_low": 0.2, "cispo_eps_high": 0.2},
    {"masked_tokens_in_norm": False, "loss_agg": "seq_mean_token_mean"},
]


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: ",".join(map(str, o.values())))
def test_train_step_each_objective_matches_torch_backend(tiny_models, tmp_path, objective):
    """Both backends compute the same step for every choice of the objective: two versions of
    two minibatches, the megatron one in micro-batches of 2 rows, at 1e-5."""
    torch_backend = pytest.importorskip("services.trainer.backends.torch_backend")
    src = tiny_models["qwen2"]
    trainer = dict(lr=1e-3, minibatches=2, **objective)
    g1, g2 = make_groups(src, seed=1), make_groups(src, seed=2)
    mine = _loaded(src, **trainer)
    ref = torch_backend.TorchBackend(make_spec(src, **trainer), device="cpu")
    ref.load(str(src))
    for groups in (g1, g2):
        a, b = mine.train_step(groups), ref.train_step(groups)
        for key in PARITY_KEYS:
            assert a[key] == pytest.approx(b[key], abs=PARITY_TOL), key
    assert a["loss"] != 0.0
    if objective.get("kl_coef"):
        assert a["kl"] != 0
    mine.save_hf(tmp_path / "mine")
    ref.save_hf(tmp_path / "ref")
    assert (
        _max_diff(
            load_file(str(tmp_path / "mine/model.safetensors")),
            load_file(str(tmp_path / "ref/model.safetensors")),
        )
        <= TOL
    )


def test_checkpoint_restore_next_step_bit_identical(tiny_models, tmp_path):
    src = tiny_models["llama"]
    trainer = dict(lr=1e-3, minibatches=2)
    g1, g2 = make_groups(src, seed=1), make_groups(src, seed=2)
    run = _loaded(src, **trainer)
    run.train_step(g1)
    run.save_checkpoint(tmp_path / "ckpt")
    at_k = {"weights": run.hf_state_dict(), "optim": copy.deepcopy(run.opt.opt.state_dict())}
    uninterrupted = run.train_step(g2)

    restored = _loaded(src, **trainer)
    restored.load_checkpoint(tmp_path / "ckpt")
    assert restored.steps == 1
    weights = restored.hf_state_dict()
    assert all(torch.equal(weights[k], at_k["weights"][k]) for k in weights)
    optim = restored.opt.opt.state_dict()["state"]
    assert optim.keys() == at_k["optim"]["state"].keys()
    for i, st in optim.items():
        assert all(torch.equal(st[k], at_k["optim"]["state"][i][k]) for k in st)
    resumed = restored.train_step(g2)
    assert resumed["loss"] == uninterrupted["loss"]
    assert resumed["grad_norm"] == uninterrupted["grad_norm"]
    final_a, final_b = run.hf_state_dict(), restored.hf_state_dict()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_load_world_size_not_tp_times_dp_raises(tiny_models):
    backend = MegatronBackend(make_spec(tiny_models["qwen2"], tp_size=2))
    with pytest.raises(ValueError, match="trainer.tp_size"):
        backend.load(str(tiny_models["qwen2"]))


def test_tp2_and_dp2_under_torchrun_match_tp1(tiny_models, tmp_path):
    src = tiny_models["qwen2"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'libs'}:{ROOT}", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(ROOT / "tests/integration/megatron_tp_worker.py"),
        str(src),
        str(tmp_path / "multi"),
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]

    single = run_case(src, tmp_path / "tp1", tp=1, dp=1)
    single_w = load_file(str(tmp_path / "tp1/step1/model.safetensors"))
    for name in ("tp2", "dp2"):
        multi = json.loads((tmp_path / "multi" / name / "result.json").read_text())
        worst = max(
            (torch.tensor(a) - torch.tensor(b)).abs().max().item()
            for ga, gb in zip(multi["logprobs"], single["logprobs"], strict=True)
            for a, b in zip(ga, gb, strict=True)
        )
        assert worst <= TOL, name
        for step in ("m1", "m2"):
            for key in ("loss", "kl", "entropy", "grad_norm", "clip_fraction"):
                assert multi[step][key] == pytest.approx(single[step][key], abs=TOL), (
                    name,
                    step,
                    key,
                )
        assert multi["m2_restored"] == multi["m2"], name  # resumed run is bit-identical
        multi_w = load_file(str(tmp_path / "multi" / name / "step1/model.safetensors"))
        assert _max_diff(multi_w, single_w) <= TOL, name


MASKING = ("token_cap", "token_mis", "icepop", "m2po", "seq_mis")


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_one_extreme_token_is_masked_and_the_step_taken_on_both_backends(tiny_models, correction):
    """A behaviour logprob of -100 on one token (the trainer's is ~-5: a log-ratio ~95, past
    float32's exp) gives a finite step on both backends, equal to each other, with the token
    masked (or its weight truncated) and every weight finite after the update."""
    from services.trainer.backends.base import check_finite_step
    from services.trainer.backends.torch_backend import TorchBackend

    src = tiny_models["qwen2"]
    groups = make_groups(src, seed=4)
    groups[0].samples[1].logprobs[1] = -100.0
    trainer = {"lr": 1e-3, "offpolicy_correction": correction}
    mine = _loaded(src, **trainer)
    ref = TorchBackend(make_spec(src, **trainer), device="cpu")
    ref.load(str(src))
    for backend in (mine, ref):
        stats = backend.train_step(groups)
        check_finite_step(backend, stats, 0)  # raises Diverged on a NaN loss or weight
        assert backend.nonfinite_weight() is None
        if correction in MASKING:
            assert stats["is_masked_fraction"] > 0
        elif correction != "cispo":  # cispo's clip sits in its surrogate
            assert stats["is_truncated_fraction"] > 0
    a, b = mine.train_step(groups), ref.train_step(groups)
    for key in PARITY_KEYS:
        assert a[key] == pytest.approx(b[key], abs=PARITY_TOL), key


def test_a_minibatch_with_every_token_masked_takes_no_adam_step(tiny_models):
    """Behaviour logprobs far below the trainer's on every token: token_cap masks them all,
    so the step changes no weight (an Adam step on zero gradients would, through momentum
    after a first real step)."""
    from services.trainer.backends.torch_backend import TorchBackend

    src = tiny_models["qwen2"]
    trainer = {"lr": 1e-2, "minibatches": 1}
    mine = _loaded(src, **trainer)
    ref = TorchBackend(make_spec(src, **trainer), device="cpu")
    ref.load(str(src))
    masked = make_groups(src, seed=5)
    for g in masked:
        for s in g.samples:
            s.logprobs = [-60.0] * len(s.logprobs)
    for backend in (mine, ref):
        backend.train_step(make_groups(src, seed=6))  # a real step: Adam has momentum now
        before = {k: v.clone() for k, v in _state(backend).items()}
        stats = backend.train_step(masked)
        assert stats["is_masked_fraction"] == 1.0
        after = _state(backend)
        assert all(torch.equal(before[k], after[k]) for k in before)


def _state(backend) -> dict[str, torch.Tensor]:
    if hasattr(backend, "hf_state_dict"):
        return backend.hf_state_dict()
    return {k: v.detach().clone() for k, v in backend.model.state_dict().items()}


def test_trainer_logprobs_and_entropy_are_at_the_sampling_temperature(tiny_models):
    """rollout.gconfig.temperature 0.7: both backends give log_softmax(logits / 0.7) of the
    HF model's logits (and so differ from the unscaled ones)."""
    from services.trainer.backends.torch_backend import TorchBackend

    src = tiny_models["llama"]
    groups = make_groups(src, seed=7)
    spec = make_spec(src).model_copy(deep=True)
    spec.rollout.gconfig.temperature = 0.7
    mine = MegatronBackend(spec, micro_batch_size=MICRO_BATCH)
    mine.load(str(src))
    ref = TorchBackend(spec, device="cpu")
    ref.load(str(src))
    model = _hf_model(src)
    batch = pack_groups(groups)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    want = token_logprobs(logits[:, :-1] / 0.7, batch.targets)
    unscaled = token_logprobs(logits[:, :-1], batch.targets)
    for backend in (mine, ref):
        got = backend.logprobs(groups)
        row = 0
        for g, per_sample in zip(groups, got, strict=True):
            p = len(g.prompt_ids)
            for s, lp in zip(g.samples, per_sample, strict=True):
                n = len(s.output_ids)
                assert lp == pytest.approx(want[row, p - 1 : p - 1 + n].tolist(), abs=1e-5)
                assert lp != pytest.approx(unscaled[row, p - 1 : p - 1 + n].tolist(), abs=1e-3)
                row += 1


def test_a_diverged_step_names_a_weight_beyond_the_finite_bound(tiny_models):
    """lr 1e30: the first step moves the weights by ~1e30, finite in fp32 but inf in the next
    forward; the megatron backend names a weight, as the torch one does."""
    from services.trainer.backends.base import Diverged, check_finite_step

    src = tiny_models["qwen2"]
    mine = _loaded(src, lr=1e30)
    assert mine.nonfinite_weight() is None
    stats = mine.train_step(make_groups(src, seed=8))
    assert mine.nonfinite_weight() is not None
    with pytest.raises(Diverged, match="non-finite weights at v1"):
        check_finite_step(mine, stats, 1)
