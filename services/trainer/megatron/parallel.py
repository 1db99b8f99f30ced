"""Process groups for the megatron backend: torchrun (any world size) or one in-process rank.

`init_parallel(tp, dp, seed)` is idempotent. Under torchrun (RANK / WORLD_SIZE set) it joins the
default group; otherwise it starts a one-process group on 127.0.0.1 and a free port, which is
how the trainer service runs the backend in-process with TP=1. NCCL on CUDA, gloo on CPU. On
CPU, megatron-core's `torch.cuda.current_device()` calls are redirected to the CPU and the
model-parallel RNG tracker is the inference one (it never touches CUDA RNG state).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.errors import SpecError


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits in the TP x DP grid."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device

    @property
    def is_writer(self) -> bool:
        """The one rank that writes files shared by all ranks (HF export, metadata)."""
        return self.rank == 0


def use_cuda() -> bool:
    return torch.cuda.is_available()


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def apply_cpu_shims() -> None:
    """megatron-core allocates buffers on `torch.cuda.current_device()`: point it at the CPU."""
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]


def init_default_group() -> None:
    """torch.distributed's default group: torchrun's env, or one in-process rank."""
    if dist.is_initialized():
        return
    backend = "nccl" if use_cuda() else "gloo"
    if "RANK" not in os.environ:
        # in-process, single rank: an in-memory store, no port. A free port picked and then
        # bound by gloo's store raced with another process's binder (two test workers: the
        # gloo store's bind failed with EADDRINUSE); so would trainers started side by side.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    if use_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def die_with_launcher() -> None:
    """The kernel SIGKILLs this rank when its parent (torchrun) dies (Linux).

    torchrun forwards SIGTERM/SIGINT to its ranks, but a launcher killed outright (SIGKILL, the
    OOM killer) would leave them orphaned: rank 0 still registered and heartbeating, a
    supervisor-restarted trainer beside it. A launcher that dies abruptly ends the job abruptly;
    the next trainer resumes from the last checkpoint."""
    from asyncrl.proc import die_with_parent

    die_with_parent(signal.SIGKILL)


def shutdown_distributed() -> None:
    """Leave torch.distributed in order: every rank meets at a barrier, then megatron's groups and
    the default group are destroyed. A rank that exits with live gloo groups while its peer is
    still tearing down can abort in C++ ("terminate called without an active exception"), so
    every multi-rank entry point calls this last. Idempotent."""
    if not dist.is_initialized():
        return
    from megatron.core import parallel_state

    if dist.get_world_size() > 1:
        dist.barrier()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def init_parallel(tp_size: int, dp_size: int, seed: int) -> ParallelInfo:
    """Initialise torch.distributed and megatron's model-parallel state for TP x DP.

    Raises ValueError when the world size is not tp_size * dp_size."""
    from megatron.core import parallel_state, tensor_parallel

    if not use_cuda():
        apply_cpu_shims()
    init_default_group()
    world = dist.get_world_size()
    if world != tp_size * dp_size:
        raise SpecError(
            "trainer.tp_size", f"world size {world} != tp_size {tp_size} * dp_size {dp_size}"
        )
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() != tp_size:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=1
        )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not use_cuda(), force_reset_rng=True
    )
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda() else _cpu_device()
    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=world,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=tp_size,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device=device,
    )


def tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def dp_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()
