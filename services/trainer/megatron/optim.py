"""Optimizer + gradient reduction + model/optimizer checkpoints, one class per device kind.

- `CpuOptimizer` (gloo): torch AdamW on this rank's shard, gradients summed over the DP group,
  global-norm clipping over the TP group (each replicated parameter counted once), checkpoint
  = one `torch.save` file per TP rank.
- `CudaOptimizer` (NCCL, bf16): Megatron's `DistributedDataParallel` + distributed optimizer
  (fp32 main weights, clipping inside `step`), checkpoint = one file per rank (the model's
  state dict, each inner torch optimizer's state and fp32 main-parameter shard). Untested in
  this repository's CI (no GPU; `make gpu-check` runs it); kept deliberately small.

The loss each rank backpropagates is already normalised by the global token count, so
gradients are *summed* over DP (TransformerConfig.calculate_per_token_loss=True makes
Megatron's DDP sum too).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.spec import TrainerSpec
from services.trainer.megatron.model import BuiltModel
from services.trainer.megatron.parallel import ParallelInfo, dp_group, tp_group


class CpuOptimizer:
    def __init__(self, built: BuiltModel, t: TrainerSpec, par: ParallelInfo):
        self.built = built
        self.par = par
        self.module = built.model
        self.clip = t.grad_clip
        self.params = [p for p in built.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(
            self.params, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay
        )

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def _reduce_dp(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.par.dp_size == 1:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group())
        for g, r in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(r)

    def _clip(self) -> float:
        """torch.nn.utils.clip_grad_norm_ over the whole (TP-sharded) model."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        norms = [
            torch.linalg.vector_norm(p.grad.float())
            for p in self.params
            if param_is_not_tensor_parallel_duplicate(p)
        ]
        sq = torch.stack(norms).pow(2).sum() if norms else torch.zeros(())
        if self.par.tp_size > 1:
            dist.all_reduce(sq, group=tp_group())
        total = sq.sqrt()
        coef = (self.clip / (total + 1e-6)).clamp(max=1.0)
        for p in self.params:
            p.grad.mul_(coef.to(p.grad.dtype))
        return total.item()

    def set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr

    def step(self) -> float:
        """Reduce, clip, update; returns the gradient norm before clipping."""
        self._reduce_dp()
        norm = self._clip()
        self.opt.step()
        return norm

    def save(self, ckpt_dir: Path) -> None:
        if self.par.dp_rank == 0:
            state = {"model": self.module.state_dict(), "optimizer": self.opt.state_dict()}
            torch.save(state, ckpt_dir / f"tp{self.par.tp_rank:02d}.pt")

    def load(self, ckpt_dir: Path) -> None:
        state = torch.load(ckpt_dir / f"tp{self.par.tp_rank:02d}.pt", weights_only=False)
        self.module.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])


class CudaOptimizer:
    def __init__(self, built: BuiltModel, t: TrainerSpec, par: ParallelInfo):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.built = built
        self.par = par
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        self.module = DistributedDataParallel(built.model.config, ddp_config, built.model)
        self.opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=t.lr,
                weight_decay=t.weight_decay,
                adam_beta1=t.adam_beta1,
                adam_beta2=t.adam_beta2,
                adam_eps=1e-8,
                clip_grad=t.grad_clip,
                bf16=True,
                params_dtype=torch.bfloat16,
                use_distributed_optimizer=True,
            ),
            [self.module],
        )

    def zero_grad(self) -> None:
        self.module.zero_grad_buffer()
        self.opt.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr

    def step(self) -> float:
        self.module.finish_grad_sync()
        _, grad_norm, _ = self.opt.step()
        return float(grad_norm or 0.0)

    def save(self, ckpt_dir: Path) -> None:
        """Each rank writes its own shard: the model's state dict, and for each of Megatron's
        inner torch optimizers its state (Adam moments, step) and the fp32 main parameters it
        updates (this rank's slice of the model). A checkpoint resumes under the same TP and DP
        sizes, which `load_checkpoint` enforces. Megatron's own formats are not used: in
        megatron-core 0.16.1 without Transformer Engine or Apex, `dist_checkpointing` raises
        `flattened_range is not supported` (default layout) or fails on load (`dp_reshardable`),
        and the legacy `save_parameter_state` / `load_parameter_state` fail on a model with
        biases (a size mismatch gathering them) and on load (`KeyError: 'step'`: torch's Adam
        keeps a step per parameter); all measured on an H100, docs/gpu.md."""
        state = {
            "model": self.built.model.state_dict(),
            "optimizers": [optimizer_shard(o.optimizer) for o in self._inner()],
        }
        torch.save(state, ckpt_dir / f"rank{self.par.rank:03d}.pt")
        dist.barrier()

    def load(self, ckpt_dir: Path) -> None:
        state = torch.load(
            ckpt_dir / f"rank{self.par.rank:03d}.pt", map_location="cpu", weights_only=False
        )
        with torch.no_grad():
            self.built.model.load_state_dict(state["model"])
        inner = self._inner()
        if len(inner) != len(state["optimizers"]):
            raise ValueError(f"{ckpt_dir}: {len(state['optimizers'])} optimizers, not {len(inner)}")
        for o, shard in zip(inner, state["optimizers"], strict=True):
            load_optimizer_shard(o.optimizer, shard)

    def _inner(self) -> list:
        """Megatron's per-dtype distributed optimizers (a ChainedOptimizer holds one or more)."""
        return list(getattr(self.opt, "chained_optimizers", [self.opt]))


def optimizer_shard(opt: torch.optim.Optimizer) -> dict:
    """A torch optimizer's state and the values of the parameters it updates, copied to the CPU
    (`state_dict()` alone hands out the live moment tensors, which the next step changes)."""
    sd = opt.state_dict()
    sd["state"] = {i: {k: _cpu(v) for k, v in st.items()} for i, st in sd["state"].items()}
    params = [[_cpu(p) for p in g["params"]] for g in opt.param_groups]
    return {"state": sd, "params": params}


def _cpu(value):
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def load_optimizer_shard(opt: torch.optim.Optimizer, shard: dict) -> None:
    """Inverse of `optimizer_shard` into an optimizer built the same way."""
    shapes = [[p.shape for p in g["params"]] for g in opt.param_groups]
    if shapes != [[p.shape for p in g] for g in shard["params"]]:
        raise ValueError("optimizer checkpoint: parameter shapes differ from this optimizer's")
    with torch.no_grad():
        for group, values in zip(opt.param_groups, shard["params"], strict=True):
            for p, v in zip(group["params"], values, strict=True):
                p.copy_(v)
    opt.load_state_dict(shard["state"])


def build_optimizer(built: BuiltModel, t: TrainerSpec, par: ParallelInfo):
    return (
        CudaOptimizer(built, t, par) if par.device.type == "cuda" else CpuOptimizer(built, t, par)
    )
