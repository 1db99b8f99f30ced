"""Every environment variable asyncrl reads, in one place.

    from asyncrl.settings import settings
    settings().scheduler        # ASYNCRL_SCHEDULER, default 127.0.0.1:50051

`settings()` reads the environment when called (tests and the supervisor change it between
calls), so nothing caches a stale value. Flags on the command line win over these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ASYNCRL_", extra="ignore", env_ignore_empty=True)

    nats_url: str = Field("nats://127.0.0.1:4222", validation_alias="NATS_URL")
    """NATS server (or cluster) for trajectories and scheduler state (NATS_URL)."""
    nats_replicas: int = Field(1, ge=1, le=5)
    """Replicas of the streams and the KV bucket asyncrl creates (3 on a three-node cluster)."""
    scheduler: str = "127.0.0.1:50051"
    """host:port of the scheduler, for workers and clients."""
    advertise_host: str = "127.0.0.1"
    """The host other services use to reach this one (its registered address)."""
    bind_host: str = "127.0.0.1"
    """Address the services and the nats-server `make up` starts listen on (0.0.0.0: all)."""
    metrics_host: str = "127.0.0.1"
    """Bind address of the Prometheus /metrics endpoint."""
    var: Path = Path("var")
    """State directory: trainer checkpoints, logs, the local cluster's files."""
    weights: Path = Path("var/weights")
    """Weight store: one directory of HF safetensors per committed version."""
    weights_transport: Literal["file", "nats"] = "file"
    """Deprecated alias of the spec's `trainer.weight_sync: nats` (services/trainer/transport.py):
    `nats` sends every experiment's versions through the NATS object store too, with a warning
    in the trainer's log; `file` (the default) leaves the choice to the spec."""
    broadcast_shm: bool = True
    """`trainer.weight_sync: broadcast` hands a version to the engines of the trainer's host
    through shared memory (/dev/shm; `asyncrl.shm`); 0: over the socket like the others."""
    log_format: str = "json"
    """`json` (services) or `console`."""
    log_level: str = "INFO"

    # security (asyncrl.security): TLS + tokens + NATS users, on unless `insecure`
    secrets: Path | None = None
    """Secrets directory (CA, certificates, tokens, NATS passwords); default `<var>/secrets`."""
    insecure: bool = False
    """Plain gRPC, no tokens, anonymous NATS. For the benchmark's same-run comparison only."""
    mtls: bool = False
    """Mutual TLS: servers also require a client certificate signed by the CA."""
    identity: str = "admin"
    """Whose token the CLI and SDK present (admin or viewer; services use their own)."""
    token: SecretStr | None = None
    """A bearer token, instead of reading `tokens/<identity>.jwt` from the secrets directory."""
    token_file: Path | None = None
    """File holding this process's bearer token (the supervisor sets one per replica)."""
    token_pubkey: Path | None = None
    """Key that verifies tokens; default `<secrets>/token.pub`."""
    tls_ca: Path | None = None
    """CA certificate to trust; default `<secrets>/ca.pem`."""
    tls_cert: Path | None = None
    """This host's certificate; default `<secrets>/server.pem`."""
    tls_key: Path | None = None
    """Its private key; default `<secrets>/server.key`."""
    tls_hosts: str = ""
    """Comma-separated extra names/IPs for the certificate `make up` creates (other hosts)."""
    nats_user: str | None = None
    """NATS user; default: the service kind (scheduler, trainer, rollout, reward, admin)."""
    nats_password: SecretStr | None = None
    """Its password; default `<secrets>/nats/<user>.password`."""

    # the local cluster (`make up`, asyncrl.supervisor)
    metrics_port: int | None = None
    """Base of fixed /metrics ports for `make up` (scheduler B, trainer B+1.., rollout B+10..)."""
    trainer_nproc: int = 1
    """`make up` runs each trainer as `torchrun --nproc_per_node N` when N > 1."""
    bench_min_step_s: float = Field(0.0, ge=0)
    """A benchmark knob, 0 in use: each train step of the trainer takes at least this long (it
    waits out the rest), as a bigger model's step would, so that generation runs ahead of
    training and staleness reaches eta (`bench.offpolicy`). The step's metrics time the
    training alone."""
    rollout_engine: str = "torch"
    """Engine of the rollouts `make up` starts."""
    cpu_affinity: bool = False
    """`make up` on a machine of its own: each torch rollout replica gets a core to itself and
    every other process (trainer, scheduler, reward, nats) the cores left (the supervisor's
    `cpus`). Off by default: supervisors sharing a machine (tests, several "hosts" in network
    namespaces) would pin their rollouts to the same core."""
    gpus: str = ""
    """GPU placement of `make up`, e.g. `rollout=0-3 trainer=4-7` (asyncrl.supervisor.gpus:
    each process gets CUDA_VISIBLE_DEVICES for its GPUs); unset: the visible GPUs split
    between rollout and trainer, nothing on a machine without one."""
    nats_port: int = 4222
    nats_routes: str = ""
    """Comma-separated host:port of the other NATS cluster nodes' route ports: the nats-server
    `make up` starts joins them as a cluster (JetStream clustered; NATS_URL lists the nodes)."""
    nats_cluster_port: int = 6222
    """Route port of the nats-server `make up` starts when it is a cluster node."""
    nats_name: str = ""
    """That node's server name, unique in the cluster (default nats-<advertise host>)."""
    scheduler_port: int = 50051
    scheduler_standby: bool = False
    """`make up` starts a second scheduler on scheduler_port + 1, the first one's standby
    (services/scheduler/leadership.py); the services get both addresses."""
    scheduler_args: str = ""
    """Extra command-line flags for the scheduler `make up` starts (likewise for the others)."""
    rollout_args: str = ""
    reward_args: str = ""
    trainer_args: str = ""

    @property
    def secrets_dir(self) -> Path:
        return self.secrets or self.var / "secrets"

    @property
    def nats_route_list(self) -> list[str]:
        return [h.strip() for h in self.nats_routes.split(",") if h.strip()]

    @property
    def tls_host_list(self) -> list[str]:
        return [h.strip() for h in self.tls_hosts.split(",") if h.strip()]

    def service_args(self, service: str) -> str:
        """The extra flags for `service` (scheduler, rollout, reward, trainer)."""
        return getattr(self, f"{service}_args", "")


def settings() -> Settings:
    """The settings as the environment holds them now."""
    return Settings()
