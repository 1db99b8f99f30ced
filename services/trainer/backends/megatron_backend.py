"""The megatron-core trainer backend: a GPTModel built from the HuggingFace config, TP x DP.

Same objective as the torch backend (`services.trainer.losses`: the spec's advantage
estimator, off-policy correction, loss aggregation, KL to the initial model and entropy bonus;
`trainer.minibatches` updates per version), computed with vocab-parallel logprobs. Each
minibatch's rows are dealt round-robin to the DP ranks and run in micro-batches of
`trainer.micro_batch_tokens` padded tokens (rows x padded length); every token's share of the
loss is fixed from the minibatch's *global* counts before the first micro-batch, so the summed
gradients equal one big batch's exactly.

Under torchrun, rank 0 is the trainer (the service drives it like any backend) and every other
rank runs `follow()`: each collective method called on rank 0 first broadcasts its name and
arguments, the followers run the same call on their own shards, and `close()` ends them.
In-process (one rank, TP=1) nothing is broadcast.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.devices import config_dtype
from asyncrl.errors import SpecError
from asyncrl.types import TrajectoryGroup
from asyncrl.weights import copy_tokenizer, load_state_dict_files
from services.trainer.algo import PackedBatch, lr_at, unpack_output_logprobs
from services.trainer.backends.base import TrainerBackend, finite_bound
from services.trainer.losses import aggregation_weights, minibatch_loss
from services.trainer.megatron import model as mg
from services.trainer.megatron.optim import build_optimizer
from services.trainer.megatron.parallel import (
    ParallelInfo,
    dp_group,
    init_default_group,
    init_parallel,
    tp_group,
)

STATE_FILE = "backend_state.json"


class MegatronBackend(TrainerBackend):
    def __init__(self, spec, micro_batch_size: int | None = None):
        super().__init__(spec)
        self.micro_batch_size = micro_batch_size
        """Rows per micro-batch; None: as many as `trainer.micro_batch_tokens` holds."""
        self.par: ParallelInfo | None = None
        self.built: mg.BuiltModel | None = None
        self.ref: mg.BuiltModel | None = None
        self.opt = None
        self.model_dir: Path | None = None
        self.steps = 0

    @property
    def device(self) -> torch.device:
        return self.par.device

    # -- setup ----------------------------------------------------------------------------
    def load(self, model_dir: str) -> None:
        t = self.spec.trainer
        init_default_group()
        _announce("load", self.spec, self.micro_batch_size, model_dir)
        self.par = init_parallel(t.tp_size, t.dp_size, self.spec.seed)
        self.model_dir = Path(model_dir)
        cfg = mg.read_hf_config(model_dir)
        self.pad_id = cfg.get("pad_token_id") or 0
        cuda = self.par.device.type == "cuda"
        hf = load_state_dict_files(model_dir)
        self.built = mg.build_model(cfg, self.par.tp_rank, self.par.tp_size, cuda=cuda)
        mg.load_hf_weights(self.built, hf)
        if t.kl_coef > 0:
            self.ref = mg.build_model(cfg, self.par.tp_rank, self.par.tp_size, cuda=cuda)
            mg.load_hf_weights(self.ref, hf)
            self.ref.model.requires_grad_(False)
        self.opt = build_optimizer(self.built, t, self.par)
        self.steps = 0

    def _micro_rows(self, batch: PackedBatch) -> int:
        """Rows per forward pass: `micro_batch_size`, else as many rows of the batch's padded
        length as `trainer.micro_batch_tokens` holds (at least one)."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        return max(1, self.spec.trainer.micro_batch_tokens // batch.input_ids.shape[1])

    def _vocab(self) -> int:
        return self.built.layout.vocab_size

    @torch.no_grad()
    def _logprobs_rows(
        self, built: mg.BuiltModel, batch: PackedBatch, rows: torch.Tensor
    ) -> torch.Tensor:
        """[N, T-1] logprobs, filled at `rows` (zero elsewhere), micro-batched, no grad."""
        out = torch.zeros_like(batch.loss_mask)
        for micro in rows.split(self._micro_rows(batch)):
            mb = batch.select(micro)
            logits = mg.forward_logits(built.model, mb.input_ids, mb.attention_mask)
            logits = logits / self.loss_cfg.temperature
            out[micro] = mg.token_logprobs(logits, mb.targets, self._vocab(), built.tp_rank)
        return out

    # -- training -------------------------------------------------------------------------
    def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        assert self.built is not None, "load() first"
        t = self.spec.trainer
        _announce("train_step", groups)
        batch = self._pack(groups)
        lr = lr_at(self.steps, t.total_steps, t.lr, t.lr_schedule, t.min_lr_ratio)
        self.opt.set_lr(lr)
        n = batch.input_ids.shape[0]
        all_rows = [c for c in torch.arange(n).chunk(min(t.minibatches, n)) if len(c)]
        own = torch.cat([c[self.par.dp_rank :: self.par.dp_size] for c in all_rows])
        # proximal (and reference) logprobs: the weights before this version's first update.
        # Each rank computes its own rows (zero elsewhere); summed, every rank has the batch's
        prox = self._dp_sum(self._logprobs_rows(self.built, batch, own))
        ref = None
        if self.ref is not None:
            ref = self._dp_sum(self._logprobs_rows(self.ref, batch, own))
        batch, corr, metrics = self._prepare(batch, prox, ref)
        # the same choice on every rank: the whole minibatch decides (`_has_gradient`)
        chunks = [c for c in all_rows if self._has_gradient(batch, corr, c.to(prox.device))]
        mine = [c[self.par.dp_rank :: self.par.dp_size] for c in chunks]

        totals: dict[str, float] = defaultdict(float)
        for chunk, rows in zip(chunks, mine, strict=True):
            for k, v in self._train_minibatch(batch, chunk, rows, prox, ref, corr).items():
                totals[k] += v
        self.steps += 1
        step = {k: v / max(len(chunks), 1) for k, v in totals.items()}
        step.update(metrics)  # the diagnostics, and kl when it went into the rewards
        step["lr"] = lr
        return step

    def _dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the data-parallel ranks, in place (itself with one rank)."""
        if self.par.dp_size > 1:
            dist.all_reduce(x, group=dp_group())
        return x

    def _train_minibatch(self, batch, chunk, rows, prox, ref, corr) -> dict[str, float]:
        """One optimizer update on minibatch `chunk`, this rank's `rows` of it in
        micro-batches; each token's share of the loss is the whole minibatch's."""
        cfg = self.loss_cfg
        share = torch.zeros_like(corr.norm)
        share[chunk] = aggregation_weights(corr.norm[chunk], cfg.agg, cfg.agg_constant)
        n_norm = max(corr.norm[chunk].sum().item(), 1.0)
        n_tok = max(batch.loss_mask[chunk].sum().item(), 1.0)
        sums = torch.zeros(4, dtype=torch.float64)  # loss, clipped tokens, entropy, kl
        self.opt.zero_grad()
        for micro in rows.split(self._micro_rows(batch)):
            mb = batch.select(micro)
            logits = mg.forward_logits(self.opt.module, mb.input_ids, mb.attention_mask)
            logits = logits / cfg.temperature
            logp = mg.token_logprobs(logits, mb.targets, self._vocab(), self.par.tp_rank)
            ent_in = logits if cfg.entropy_coef > 0 else logits.detach()
            ent = mg.token_entropy(ent_in, self._vocab(), self.par.tp_rank, tp_group())
            loss, parts = minibatch_loss(
                logp,
                prox[micro],
                mb.behav_logp,
                mb.advantages,
                mb.loss_mask,
                corr.rows(micro),
                share[micro],
                cfg,
                n_tokens=n_tok,
                ref=ref[micro] if ref is not None else None,
                entropy=ent,
            )
            loss.backward()
            sums += torch.tensor(
                [parts["loss"], parts["clipped"], parts["entropy"], parts["kl"]],
                dtype=torch.float64,
            )
        grad_norm = self.opt.step()
        loss, clipped, entropy, kl = self._dp_sum(sums.to(self.par.device)).tolist()
        return {
            "loss": loss,
            "clip_fraction": clipped / n_norm,
            "entropy": entropy,
            "kl": kl,
            "grad_norm": grad_norm,
        }

    def logprobs(self, groups: list[TrajectoryGroup]) -> list[list[list[float]]]:
        assert self.built is not None, "load() first"
        _announce("logprobs", groups)
        batch = self._pack(groups)
        logp = self._logprobs_rows(self.built, batch, torch.arange(batch.input_ids.shape[0])).cpu()
        return unpack_output_logprobs(groups, logp)

    # -- persistence ----------------------------------------------------------------------
    @torch.no_grad()
    def nonfinite_weight(self) -> str | None:
        """This rank's shard (rank 0's under TP/DP: the check runs where the step is served):
        a divergence such as lr 1e30 moves every shard at once."""
        assert self.built is not None, "load() first"
        bound = finite_bound(self._published_dtype())
        for name, param in self.built.model.named_parameters():
            low, high = param.aminmax()  # one pass, no copy; NaN fails both comparisons
            if not (-bound <= low.item() and high.item() <= bound):
                return name
        return None

    def _published_dtype(self) -> torch.dtype:
        return config_dtype(self.built.hf_config)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model in HuggingFace names and shapes, in the source model's dtype (all ranks)."""
        dtype = self._published_dtype()
        return {k: v.to(dtype) for k, v in mg.gather_hf_weights(self.built, tp_group()).items()}

    def hf_state(self) -> tuple[dict[str, torch.Tensor], bytes]:
        """`hf_state_dict` (gathered: new tensors) and the source's config.json (all ranks)."""
        assert self.built is not None, "load() first"
        _announce("hf_state")
        return self.hf_state_dict(), (self.model_dir / "config.json").read_bytes()

    def save_hf(self, out_dir: Path) -> None:
        """config.json (copied from the source) + model.safetensors + tokenizer files. All
        ranks must call it (the TP shards are gathered); rank 0 writes."""
        from safetensors.torch import save_file

        assert self.built is not None, "load() first"
        _announce("save_hf", out_dir)
        weights = self.hf_state_dict()
        if self.par.is_writer:
            out_dir = Path(out_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
            shutil.copy2(self.model_dir / "config.json", out_dir / "config.json")
            copy_tokenizer(self.model_dir, out_dir)
        dist.barrier()

    def hf_files(self) -> dict[str, bytes]:
        """What `save_hf` writes, as bytes (all ranks gather; the writer's answer is the
        files, every other rank's is empty)."""
        from safetensors.torch import save

        assert self.built is not None, "load() first"
        _announce("hf_files")
        weights = self.hf_state_dict()
        if not self.par.is_writer:
            return {}
        return {
            "model.safetensors": save(
                {k: v.cpu().contiguous() for k, v in weights.items()}, metadata={"format": "pt"}
            ),
            "config.json": (self.model_dir / "config.json").read_bytes(),
        }

    def save_checkpoint(self, ckpt_dir: Path) -> None:
        assert self.built is not None, "load() first"
        _announce("save_checkpoint", ckpt_dir)
        ckpt_dir = Path(ckpt_dir)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.opt.save(ckpt_dir)
        torch.save(self._rng_state(), ckpt_dir / f"rng_rank{self.par.rank:03d}.pt")
        if self.par.is_writer:
            state = {"steps": self.steps, "tp_size": self.par.tp_size, "dp_size": self.par.dp_size}
            (ckpt_dir / STATE_FILE).write_text(json.dumps(state))
        dist.barrier()

    def load_checkpoint(self, ckpt_dir: Path) -> None:
        """Restore into a backend built with `load(model_dir)` under the same TP and DP sizes."""
        assert self.built is not None, "load() first"
        _announce("load_checkpoint", ckpt_dir)
        ckpt_dir = Path(ckpt_dir)
        state = json.loads((ckpt_dir / STATE_FILE).read_text())
        if (state["tp_size"], state["dp_size"]) != (self.par.tp_size, self.par.dp_size):
            raise SpecError(
                "trainer.tp_size",
                f"checkpoint was written with tp={state['tp_size']} "
                f"dp={state['dp_size']}, running tp={self.par.tp_size} dp={self.par.dp_size}",
            )
        self.opt.load(ckpt_dir)
        self._set_rng_state(
            torch.load(ckpt_dir / f"rng_rank{self.par.rank:03d}.pt", weights_only=False)
        )
        self.steps = state["steps"]

    def _rng_state(self) -> dict:
        """The host RNG states, plus on CUDA the device's and megatron's model-parallel tracker's."""
        state = super()._rng_state()
        if torch.cuda.is_available():
            from megatron.core import tensor_parallel

            state["cuda"] = torch.cuda.get_rng_state()
            state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
        return state

    def _set_rng_state(self, state: dict) -> None:
        super()._set_rng_state(state)
        if "cuda" in state:
            from megatron.core import tensor_parallel

            torch.cuda.set_rng_state(state["cuda"])
            tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])

    def close(self) -> None:
        """Release the follower ranks (they return from `follow()`); a no-op in-process."""
        _announce("close")


# -- torchrun: rank 0 leads, the other ranks follow ---------------------------------------------


_followers_listening = True  # rank 0's view: are the other ranks inside follow()?


def _announce(op: str, *args) -> None:
    """On rank 0 of a multi-rank run: tell the followers which call comes next."""
    global _followers_listening
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() == 0:
        dist.broadcast_object_list([(op, args)], src=0)
        _followers_listening = op != "close"


def release_followers() -> None:
    """Rank 0, on its way out: end the followers' `follow()` loops if no `close()` has. A trainer
    that never trained (or whose experiment ended without closing its backend) still lets
    the other ranks exit."""
    if _followers_listening:
        _announce("close")


def follow() -> None:
    """The loop of every rank but 0 under torchrun: run the calls rank 0's backend announces
    (`load` builds a new backend from rank 0's spec) until rank 0 calls `close()`."""
    init_default_group()
    backend: MegatronBackend | None = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        op, args = box[0]
        if op == "close":
            return
        if op == "load":
            spec, micro_batch_size, model_dir = args
            backend = MegatronBackend(spec, micro_batch_size=micro_batch_size)
            backend.load(model_dir)
        else:
            getattr(backend, op)(*args)
