"""The reference trainer backend: a HuggingFace causal LM trained with torch AdamW.

Precision: the weights and AdamW's state are fp32 everywhere. On a GPU the forwards and
backwards run under autocast in the model's own dtype (config.json `torch_dtype`: bf16 for
most released models; `asyncrl.devices.model_dtype`) and each published version is cast to it,
what an engine serving the model in that dtype loads; on the CPU everything stays fp32.

One `train_step` is one policy version: the groups are packed, the proximal logprobs are
recomputed with the current weights, and the samples are split into `trainer.minibatches`
minibatches with one optimizer update each (the spec's objective, `services.trainer.losses`:
advantage estimator, off-policy correction, aggregation, KL to a frozen copy of the initial
model, entropy bonus). Logprobs and entropy are those of the logits divided by the sampling
temperature (`rollout.gconfig.temperature`; 1 for greedy), exactly as the rollout engines
report behaviour logprobs: the policy trained is the one sampled.

With `trainer.lora` the base is frozen and a peft LoRA adapter trains (services/trainer/lora.py):
the optimizer, the gradient clip, checkpoints and the published version cover the adapter only,
and the KL reference is the base with the adapter disabled (no copy kept).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch

from asyncrl import devices
from asyncrl.types import TrajectoryGroup
from asyncrl.weights import copy_tokenizer
from services.trainer import lora
from services.trainer.algo import (
    PackedBatch,
    lr_at,
    token_entropy,
    token_logprobs,
    unpack_output_logprobs,
)
from services.trainer.backends.base import TrainerBackend, finite_bound
from services.trainer.losses import Correction, aggregation_weights, minibatch_loss

MODEL_FILE = "model.pt"
OPTIM_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "backend_state.json"


def _forward_logits(
    model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0
) -> torch.Tensor:
    """Logits / temperature in target space: [N, T-1, V], position t predicts input_ids[:, t+1]."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    return out.logits[:, :-1].float() / temperature


class TorchBackend(TrainerBackend):
    """HuggingFace `AutoModelForCausalLM` + AdamW on one process (CPU or one GPU)."""

    def __init__(self, spec, device: str | None = None):
        super().__init__(spec)
        self.device = devices.pick_device(device or "auto")
        self.dtype = torch.float32
        """The dtype of the forwards (autocast) and of the published versions (`load`)."""
        self.model: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.model_dir: Path | None = None

    # -- setup ----------------------------------------------------------------------------
    def load(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        t = self.spec.trainer
        self.model_dir = Path(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.to(self.device)
        self.dtype = devices.pick_dtype("auto", self.device, model_dir)
        if t.lora is not None:
            self.model = lora.wrap(self.model, t.lora)
        # RL on policy logprobs: no dropout, so prox logprobs equal the first update's logprobs.
        self.model.eval()
        self.pad_id = self.model.config.pad_token_id or 0
        if t.kl_coef > 0 and t.lora is None:  # LoRA's reference: the base, adapter disabled
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            lora.trainable(self.model),
            lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2),
            weight_decay=t.weight_decay,
        )
        self.steps = 0

    def _autocast(self):
        """The forwards' precision: the model's dtype on a GPU (fp32 weights), else none."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @torch.no_grad()
    def _frozen_logprobs(self, model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
        with self._autocast():
            logits = _forward_logits(model, batch, self.loss_cfg.temperature)
        return token_logprobs(logits, batch.targets)

    def _ref_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """The KL reference's logprobs: the frozen copy of the initial model, or under LoRA
        the base with the adapter disabled."""
        if self.ref_model is not None:
            return self._frozen_logprobs(self.ref_model, batch)
        with lora.reference(self.model):
            return self._frozen_logprobs(self.model, batch)

    # -- training -------------------------------------------------------------------------
    def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        assert self.model is not None and self.optimizer is not None, "load() first"
        t = self.spec.trainer
        batch = self._pack(groups)
        prox_logp = self._frozen_logprobs(self.model, batch)
        ref_logp = self._ref_logprobs(batch) if t.kl_coef > 0 else None
        batch, corr, metrics = self._prepare(batch, prox_logp, ref_logp)

        lr = lr_at(self.steps, t.total_steps, t.lr, t.lr_schedule, t.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        n = batch.input_ids.shape[0]
        chunks = torch.arange(n, device=self.device).chunk(min(t.minibatches, n))
        chunks = [c for c in chunks if self._has_gradient(batch, corr, c)]
        totals = dict.fromkeys(("loss", "clip_fraction", "entropy", "kl", "grad_norm"), 0.0)
        for idx in chunks:
            ref = ref_logp[idx] if ref_logp is not None else None
            parts = self._train_minibatch(batch.select(idx), prox_logp[idx], ref, corr.rows(idx))
            for k, v in parts.items():
                totals[k] += v
        self.steps += 1
        step = {k: v / max(len(chunks), 1) for k, v in totals.items()}
        step.update(metrics)  # the diagnostics, and kl when it went into the rewards
        step["lr"] = lr
        return step

    def _train_minibatch(
        self, mb: PackedBatch, prox: torch.Tensor, ref: torch.Tensor | None, corr: Correction
    ) -> dict[str, float]:
        """One optimizer update on one minibatch; its loss parts and grad norm."""
        cfg = self.loss_cfg
        share = aggregation_weights(corr.norm, cfg.agg, cfg.agg_constant)
        with (
            lora.dropout_on(self.model),
            self._autocast(),
        ):  # LoRA's dropout: nothing for a full model
            logits = _forward_logits(self.model, mb, cfg.temperature)
        logp = token_logprobs(logits, mb.targets)
        entropy = token_entropy(logits if cfg.entropy_coef > 0 else logits.detach())
        loss, parts = minibatch_loss(
            logp,
            prox,
            mb.behav_logp,
            mb.advantages,
            mb.loss_mask,
            corr,
            share,
            cfg,
            n_tokens=max(float(mb.n_tokens), 1.0),
            ref=ref,
            entropy=entropy,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            lora.trainable(self.model), self.spec.trainer.grad_clip
        )
        self.optimizer.step()
        return {
            "loss": parts["loss"],
            "clip_fraction": parts["clipped"] / max(corr.norm.sum().item(), 1.0),
            "entropy": parts["entropy"],
            "kl": parts["kl"],
            "grad_norm": grad_norm.item(),
        }

    @torch.no_grad()
    def logprobs(self, groups: list[TrajectoryGroup]) -> list[list[list[float]]]:
        assert self.model is not None, "load() first"
        batch = self._pack(groups)
        logp = self._frozen_logprobs(self.model, batch).cpu()
        return unpack_output_logprobs(groups, logp)

    # -- persistence ----------------------------------------------------------------------
    def save_hf(self, out_dir: Path) -> None:
        assert self.model is not None, "load() first"
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if lora.is_lora(self.model):  # the adapter alone
            for name, data in lora.adapter_files(self.model).items():
                (out_dir / name).write_bytes(data)
        else:
            self.model.save_pretrained(str(out_dir), safe_serialization=True)
        if self.model_dir is not None:
            copy_tokenizer(self.model_dir, out_dir)

    @torch.no_grad()
    def nonfinite_weight(self) -> str | None:
        assert self.model is not None, "load() first"
        bound = finite_bound(self.dtype)
        for name, param in self.model.named_parameters():  # the base too: it is read
            low, high = param.aminmax()  # one pass, no copy; NaN fails both comparisons
            if not (-bound <= low.item() and high.item() <= bound):
                return name
        return None

    def hf_state(self) -> tuple[dict[str, torch.Tensor], bytes]:
        """The state dict (a tied lm_head left out, as save_pretrained leaves it) in the
        published dtype, and the model's config as JSON."""
        assert self.model is not None, "load() first"
        if lora.is_lora(self.model):
            raise NotImplementedError("a LoRA version is its adapter files, not streamed")
        state = self.model.state_dict()
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        state = {k: v.detach().to(self.dtype) for k, v in state.items()}
        config = json.loads(self.model.config.to_json_string())
        for key in ("dtype", "torch_dtype"):  # transformers 5 writes `dtype`, 4 `torch_dtype`
            if key in config or key == "dtype":
                config[key] = str(self.dtype).removeprefix("torch.")
        return state, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()

    def hf_files(self) -> dict[str, bytes]:
        """What `save_hf` writes, as bytes: the state dict (a tied lm_head left out, as
        save_pretrained leaves it) serialised by safetensors, and the model's config."""
        from safetensors.torch import save

        assert self.model is not None, "load() first"
        if lora.is_lora(self.model):
            return lora.adapter_files(self.model)
        state, config = self.hf_state()
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        return {
            "model.safetensors": save(tensors, metadata={"format": "pt"}),
            "config.json": config,
        }

    def save_checkpoint(self, ckpt_dir: Path) -> None:
        assert self.model is not None and self.optimizer is not None, "load() first"
        ckpt_dir = Path(ckpt_dir)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        torch.save(lora.model_state(self.model), ckpt_dir / MODEL_FILE)  # LoRA: the adapter
        torch.save(self.optimizer.state_dict(), ckpt_dir / OPTIM_FILE)
        torch.save(self._rng_state(), ckpt_dir / RNG_FILE)
        (ckpt_dir / STATE_FILE).write_text(json.dumps({"steps": self.steps}))

    def load_checkpoint(self, ckpt_dir: Path) -> None:
        """Restore a checkpoint into a backend already built with `load(model_dir)` (the
        initial model, which also serves as the KL reference)."""
        assert self.model is not None and self.optimizer is not None, "load() first"
        ckpt_dir = Path(ckpt_dir)
        state = torch.load(ckpt_dir / MODEL_FILE, map_location=self.device)
        lora.load_model_state(self.model, state)
        self.optimizer.load_state_dict(torch.load(ckpt_dir / OPTIM_FILE, map_location=self.device))
        self._set_rng_state(torch.load(ckpt_dir / RNG_FILE, weights_only=False))
        self.steps = json.loads((ckpt_dir / STATE_FILE).read_text())["steps"]
