"""Every environment variable asyncrl reads, in one place.

    from asyncrl.settings import settings
    settings().scheduler        # ASYNCRL_SCHEDULER, default 127.0.0.1:50051

`settings()` reads the environment when called (tests and the supervisor change it between
calls), so nothing caches a stale value. Flags on the command line win over these.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ASYNCRL_", extra="ignore", env_ignore_empty=True)

    nats_url: str = Field("nats://127.0.0.1:4222", validation_alias="NATS_URL")
    """NATS server (or cluster) for trajectories and scheduler state (NATS_URL)."""
    scheduler: str = "127.0.0.1:50051"
    """host:port of the scheduler, for workers and clients."""
    advertise_host: str = "127.0.0.1"
    """The host other services use to reach this one (its registered address)."""
    metrics_host: str = "127.0.0.1"
    """Bind address of the Prometheus /metrics endpoint."""
    var: Path = Path("var")
    """State directory: trainer checkpoints, logs, the local cluster's files."""
    weights: Path = Path("var/weights")
    """Weight store: one directory of HF safetensors per committed version."""
    log_format: str = "json"
    """`json` (services) or `console`."""
    log_level: str = "INFO"

    # the local cluster (`make up`, asyncrl.supervisor)
    metrics_port: int | None = None
    """Base of fixed /metrics ports for `make up` (scheduler B, trainer B+1.., rollout B+10..)."""
    trainer_nproc: int = 1
    """`make up` runs each trainer as `torchrun --nproc_per_node N` when N > 1."""
    rollout_engine: str = "torch"
    """Engine of the rollouts `make up` starts."""
    nats_port: int = 4222
    scheduler_port: int = 50051
    scheduler_args: str = ""
    """Extra command-line flags for the scheduler `make up` starts (likewise for the others)."""
    rollout_args: str = ""
    reward_args: str = ""
    trainer_args: str = ""

    def service_args(self, service: str) -> str:
        """The extra flags for `service` (scheduler, rollout, reward, trainer)."""
        return getattr(self, f"{service}_args", "")


def settings() -> Settings:
    """The settings as the environment holds them now."""
    return Settings()
