"""Process groups outside torch's default group, for weight updates: the trainer is rank 0 of a
group with the engines' ranks (`trainer.weight_sync: nccl` into SGLang, `broadcast` into the
torch engine). Built the way SGLang builds its side: a store prefixed by the group's name, then
torch's group helper (private torch API, as SGLang uses it). NCCL when the process has a CUDA
device, else gloo."""

from __future__ import annotations

from datetime import timedelta

TIMEOUT_S = 600.0
"""Rendezvous and per-collective timeout."""


def collective_backend() -> str:
    """NCCL when this process has a CUDA device, else gloo."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def device_id(device) -> str:
    """Which device a rank's buffers are on: "cpu", or "cuda:<the GPU's UUID>" (two processes
    sharing one GPU say the same)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def group_backend(mine: str, devices: list[str]) -> str:
    """The backend of a weight group whose ranks hold `devices` (`device_id` each), where this
    rank alone would use `mine`: NCCL only when every rank has a GPU of its own (NCCL refuses
    two ranks on one GPU, a trainer and an engine sharing it), else gloo (which stages CUDA
    tensors through host memory)."""
    own_gpus = all(d.startswith("cuda:") for d in devices) and len(set(devices)) == len(devices)
    return "nccl" if mine == "nccl" and own_gpus else "gloo"


def plan_key(group_name: str, version: int) -> str:
    """The key of version `version`'s bucket plan in the store of group `group_name`
    (`trainer.weight_sync: nccl`: the trainer sets it, the SGLang engines read it)."""
    return f"{group_name}/v{version}/plan"


def group_on_store(
    store,
    backend: str,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = TIMEOUT_S,
):
    """A group of `world_size` ranks that meet on `store` (a TCPStore every rank reaches),
    under the prefix `group_name`, registered in torch's world (`dist.broadcast(...,
    group=)` takes it). Blocks until every rank has joined."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = timedelta(seconds=timeout_s)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    assert dist.get_world_size(pg) == world_size
    return pg


def init_custom_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = TIMEOUT_S,
):
    """A group whose rank 0 hosts the store at master_address:master_port (tcp rendezvous):
    SGLang's `init_weights_update_group`."""
    from torch.distributed.distributed_c10d import rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    return group_on_store(store, backend, rank, world_size, group_name, timeout_s)


def open_store(host: str, port: int, master: bool, timeout_s: float = TIMEOUT_S):
    """The TCPStore at host:port: hosted here (`master`, the trainer) or reached (an engine).
    An IPv6 host may come bracketed, as in an address ("[::1]"): TCPStore takes it bare."""
    from torch.distributed import TCPStore

    return TCPStore(
        host.removeprefix("[").removesuffix("]"),
        port,
        is_master=master,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        use_libuv=True,
    )


class Group:
    """A process group of its own, outside torch's world (`own_group`): no global name, so a
    process may hold several, even several ranks of one (the tests)."""

    def __init__(self, pg, name: str):
        self.pg, self.name = pg, name

    def broadcast(self, tensor, src: int = 0) -> None:
        """`tensor` from rank `src` to every rank; returns once done here."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except (AttributeError, RuntimeError):  # an older torch, a group already broken
            pass


def own_group(
    store, backend: str, rank: int, world_size: int, name: str, timeout_s: float = TIMEOUT_S
) -> Group:
    """`world_size` ranks meeting on `store` under the prefix `name` (a new name per group:
    several share one store). Blocks until every rank has joined."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{name}/", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return Group(dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), name)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return Group(dist.ProcessGroupNCCL(prefixed, rank, world_size, opts), name)
