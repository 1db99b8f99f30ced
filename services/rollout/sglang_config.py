"""Configuration of the SGLang engine: which server (attach to a URL, or launch a managed
child), how weights reach it, and its timeouts.

`python -m services.rollout --engine sglang --engine-opt key=value ...` gives flat options;
`SGLangConfig.from_options` sorts them: the launch options (`LaunchConfig`'s fields) go to
the nested `launch`, the rest are `SGLangConfig`'s own fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from services.rollout.sglang_process import LaunchConfig

WEIGHT_SYNCS = ("disk", "nccl")


@dataclass
class SGLangConfig:
    """How the rollout worker reaches its SGLang server and updates its weights."""

    url: str | None = None
    """Attach to the server at this URL (`--sglang-url`); it is somebody else's to run."""
    launch: LaunchConfig | None = None
    """Launch and supervise a child server with these options (`--sglang-launch`)."""
    sglang_version: str | None = None
    """Skip version detection (`/get_server_info` when attached, the installed package when
    launched), e.g. "0.5.9"."""
    weight_sync: str = "disk"
    """How a new version reaches the server: "disk" (`/update_weights_from_disk`) or "nccl"
    (broadcast from the trainer, see sglang_sync)."""
    nccl_master: str | None = None
    """host:port of the trainer's rendezvous and store (rank 0; the buckets' plan, sized by the
    trainer's `broadcast_bucket_mb`, is read there); required with weight_sync nccl."""
    nccl_group: str = "asyncrl-weights"
    """Name of the weight-update process group (the trainer uses the same)."""
    nccl_rank_offset: int = 1
    """Rank of the server's first GPU in that group (the trainer is rank 0)."""
    nccl_world_size: int | None = None
    """Ranks in the group; None: 1 + the launched server's tp_size (1 + 1 when attached)."""
    nccl_backend: str = "nccl"
    """torch.distributed backend of the group ("gloo" in CPU tests)."""
    startup_timeout_s: float = 900.0
    """How long a server may take to become healthy (first start, restart, reconnect)."""
    drain_timeout_s: float = 5.0
    """How long an update waits for the answers of the requests it aborted."""

    def __post_init__(self) -> None:
        if self.weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync: expected disk or nccl, got {self.weight_sync!r}")
        if self.weight_sync == "nccl":
            host, _, port = (self.nccl_master or "").rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(
                    "nccl_master: required as host:port (the trainer's rendezvous) for "
                    f"weight_sync nccl, got {self.nccl_master!r}"
                )
        if self.url and self.launch is not None:
            raise ValueError("sglang: give either url (attach) or launch options, not both")
        if not self.url and self.launch is None:
            raise ValueError("sglang: needs --sglang-url URL (attach) or --sglang-launch")

    @property
    def nccl_world(self) -> int:
        """Size of the weight-update group: the trainer plus the server's GPUs."""
        if self.nccl_world_size:
            return self.nccl_world_size
        return 1 + (self.launch.tp_size if self.launch else 1)

    @classmethod
    def from_options(cls, **opts) -> SGLangConfig:
        """The config of flat `--engine-opt` options: `url`, `launch` (true: launch a child;
        implied by `model_path` or `launch_cmd`), `LaunchConfig`'s fields and this class's.
        Raises ValueError naming an unknown option, or a launch option given with `url`."""
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"sglang: unknown engine option {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(OPTIONS)})"
            )
        own = {k: v for k, v in opts.items() if k in OWN_OPTIONS}
        child = {k: v for k, v in opts.items() if k in LAUNCH_OPTIONS}
        if opts.get("launch") or child.get("model_path") or child.get("launch_cmd"):
            return cls(launch=LaunchConfig(**child), **own)
        if child and own.get("url"):
            hint = (
                " (for the weight-update group set nccl_world_size)" if "tp_size" in child else ""
            )
            raise ValueError(
                f"sglang: {', '.join(sorted(child))}: options of a launched server "
                f"(--sglang-launch), not of one you attach to{hint}"
            )
        return cls(**own)


LAUNCH_OPTIONS = tuple(
    f.name for f in fields(LaunchConfig) if f.name not in ("weight_version", "lora")
)
OWN_OPTIONS = tuple(f.name for f in fields(SGLangConfig) if f.name != "launch")
OPTIONS = tuple(sorted({*LAUNCH_OPTIONS, *OWN_OPTIONS, "launch"}))
