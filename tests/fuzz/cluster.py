"""The fuzzer's system under test: a real nats-server and one real server of each service
(scheduler, reward, rollout with the torch engine on a tiny model, trainer) on port 0, secure
as under `make up`, started once and served from an event loop of their own (a thread), so
that hypothesis drives cases from plain synchronous code.

Three experiments stand in the scheduler: the operator's, tenant acme's and tenant bcorp's.
The fuzzer calls as acme (its admin and viewer), as the operator's viewer, as the workers and
the scheduler; the operator's admin never names another experiment than its own fuzz ones.
None of those may change the operator's or bcorp's experiment: `victims()` is compared before
and after every case."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncrl.grpcutil import CHANNEL_OPTIONS, bearer_interceptors, channel
from asyncrl.natsutil import LocalNatsServer
from asyncrl.security import Credentials, ensure_tenant, mint_token, secrets_dir
from asyncrl.tiny import build_tiny_model
from asyncrl.v1 import common_pb2, rollout_pb2, scheduler_pb2
from asyncrl.weights import path_to_uri

CODE = grpc.StatusCode
CALL_TIMEOUT_S = 20.0
HEALTH_S = 10.0
SETUP_TRIES = 5
SERVICES = ("Scheduler", "Reward", "Rollout", "Trainer")
TENANTS = ("acme", "bcorp")
BOUND = "fuzz-bound-0001"
"""The experiment the rollout and the reward service are bound to when the fuzzing starts (the
rollout with the tiny model's v0 loaded): GenerateGroup and Score have something to do."""


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str


def path_of(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


class Loop:
    """An event loop on a thread of its own; `run(coro)` waits for the result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def rebind(self) -> None:
        """Back to BOUND with v0 (after a case bound another spec or loaded other weights)."""
        self.loop.run(self._bind(), timeout=120)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def spec_dict(root: Path) -> dict:
    """A valid spec on the tiny model and a 20-line dataset under `root`."""
    return {
        "name": "fuzz",
        "model": {"path": str(root / "model")},
        "dataset": {"path": str(root / "train.jsonl"), "shuffle": False},
        "rollout": {"n_samples": 2, "gconfig": {"max_new_tokens": 4}},
        "eval": {"n_samples": 1, "gconfig": {"max_new_tokens": 4}},
        "reward": {"function": "exact_match", "timeout_s": 5.0},
        "trainer": {"batch_size": 2, "total_steps": 2},
    }


class FuzzCluster:
    """See the module's doc. `start()` / `stop()` from synchronous code."""

    def __init__(self, root: Path):
        self.root = root
        self.loop = Loop()
        self.runtimes: dict[str, object] = {}
        self.addresses: dict[str, str] = {}
        self.tokens: dict[str, str] = {}
        self.channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self.experiments: dict[str, str] = {}
        """Who submitted it ("operator", "acme", "bcorp") -> experiment id."""
        self.nats: LocalNatsServer | None = None
        self.spec = spec_dict(root)

    # ---- start and stop -------------------------------------------------------------------

    def start(self) -> FuzzCluster:
        build_tiny_model(self.root / "model", seed=0)
        rows = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(20)]
        (self.root / "train.jsonl").write_text("\n".join(rows) + "\n")
        for tenant in TENANTS:
            ensure_tenant(secrets_dir(), tenant)
        self.nats = LocalNatsServer(self.root / "jetstream").__enter__()
        try:
            self.loop.run(self._start(), timeout=180)
        except BaseException:
            self.stop()
            raise
        return self

    async def _start(self) -> None:
        from services.reward.server import create_reward
        from services.rollout.server import create_rollout
        from services.rollout.torch_engine import TorchEngine
        from services.scheduler import authority
        from services.scheduler.server import create_scheduler
        from services.trainer.server import create_trainer

        # a trainer's call for an experiment no trainer was started for waits this long for one
        # (the restart case): 10 s a case would leave the fuzzer little else to do
        authority.TRAINER_WAIT_S = 0.5
        url = self.nats.url
        sched, _ = await create_scheduler(url, grace_s=0, lease_ttl_s=3.0, heartbeat_interval_s=0.5)
        self.runtimes["Scheduler"] = sched
        self.runtimes["Reward"], _ = await create_reward(port=0, workers=1, register=False)
        rollout, _ = await create_rollout(url, TorchEngine(seed=0), register=False)
        self.runtimes["Rollout"] = rollout
        self.runtimes["Trainer"], _ = await create_trainer(
            url,
            scheduler=f"127.0.0.1:{sched.port}",
            register=False,
            var_dir=self.root / "var",
            weights_dir=self.root / "weights",
        )
        self.addresses = {n: f"127.0.0.1:{rt.port}" for n, rt in self.runtimes.items()}
        for tenant in TENANTS:
            for role in ("admin", "viewer"):
                token = mint_token(secrets_dir(), f"{tenant}-{role}", role, tenant=tenant)
                self.tokens[f"{tenant}-{role}"] = token
        spec = json.dumps(self.spec)
        for who in ("operator", *TENANTS):
            identity = "admin" if who == "operator" else f"{who}-admin"
            answer = await self._setup(
                "Scheduler",
                "SubmitExperiment",
                identity,
                scheduler_pb2.SubmitExperimentRequest(spec_json=spec).SerializeToString(),
            )
            assert answer[0].code == CODE.OK, answer
            self.experiments[who] = scheduler_pb2.Experiment.FromString(answer[1]).id
        await self._bind()

    async def _bind(self) -> None:
        """The rollout and the reward service bound to BOUND, the rollout with v0 loaded."""
        bind = common_pb2.BindExperimentRequest(
            experiment_id=BOUND, spec_json=json.dumps(self.spec)
        ).SerializeToString()
        for service in ("Rollout", "Reward"):
            outcome, _ = await self._setup(service, "BindExperiment", "scheduler", bind)
            assert outcome.code == CODE.OK, outcome
        update = rollout_pb2.UpdateWeightsRequest(
            experiment_id=BOUND, version=0, uri=path_to_uri(self.root / "model")
        ).SerializeToString()
        outcome, _ = await self._setup("Rollout", "UpdateWeights", "scheduler", update)
        assert outcome.code == CODE.OK, outcome

    async def _setup(self, *args) -> tuple[Outcome, bytes]:
        """A call of the fixture's own, tried again while a loaded machine fails its
        connection (UNAVAILABLE: a TLS handshake cut short)."""
        for _ in range(SETUP_TRIES - 1):
            answer = await self.call(*args)
            if answer[0].code != CODE.UNAVAILABLE:
                return answer
            await asyncio.sleep(1.0)
        return await self.call(*args)

    def rebind(self) -> None:
        """Back to BOUND with v0 (after a case bound another spec or loaded other weights)."""
        self.loop.run(self._bind(), timeout=120)

    def stop(self) -> None:
        try:
            if self.runtimes:
                self.loop.run(self._stop(), timeout=120)
        finally:
            self.loop.stop()
            if self.nats is not None:
                self.nats.__exit__(None, None, None)

    async def _stop(self) -> None:
        for ch in self.channels.values():
            await ch.close()
        for runtime in reversed(list(self.runtimes.values())):
            await runtime.close()

    # ---- calls ---------------------------------------------------------------------------

    def _channel(self, service: str, identity: str) -> grpc.aio.Channel:
        key = (service, identity)
        if key not in self.channels:
            address = self.addresses[service]
            if identity in self.tokens:  # a tenant's token
                creds = Credentials.load("admin").channel_credentials()
                interceptors = bearer_interceptors(self.tokens[identity])
                self.channels[key] = grpc.aio.secure_channel(
                    address, creds, options=CHANNEL_OPTIONS, interceptors=interceptors
                )
            else:
                self.channels[key] = channel(address, identity)
        return self.channels[key]

    async def call(
        self, service: str, method: str, identity: str, data: bytes, stream: bool = False
    ) -> tuple[Outcome, bytes]:
        """One call with `data` as the request's bytes; a stream is read to its first message
        (a watch goes on while the experiment runs)."""
        ch = self._channel(service, identity)
        path = f"/asyncrl.v1.{service}/{method}"
        try:
            if stream:
                call = ch.unary_stream(path)(data, timeout=CALL_TIMEOUT_S)
                async for first in call:
                    call.cancel()
                    return Outcome(CODE.OK, ""), first
                return Outcome(CODE.OK, ""), b""
            answer = await ch.unary_unary(path)(data, timeout=CALL_TIMEOUT_S)
            return Outcome(CODE.OK, ""), answer
        except grpc.aio.AioRpcError as e:
            return Outcome(e.code(), e.details() or ""), b""

    def call_sync(self, method: MethodDescriptor, identity: str, data: bytes) -> Outcome:
        service = method.containing_service.name
        coro = self.call(service, method.name, identity, data, method.server_streaming)
        return self.loop.run(coro, timeout=CALL_TIMEOUT_S + 30)[0]

    # ---- what must not change ------------------------------------------------------------

    async def _victims(self) -> dict[str, tuple]:
        out = {}
        for who in ("operator", "bcorp"):
            request = scheduler_pb2.GetExperimentRequest(experiment_id=self.experiments[who])
            outcome, data = await self._setup(
                "Scheduler", "GetExperiment", "viewer", request.SerializeToString()
            )
            exp = scheduler_pb2.Experiment.FromString(data) if data else None
            # a waiting experiment's message names the kinds of worker missing: the shared
            # fleet's state (a worker registering changes it), not the experiment's own
            waiting = exp is not None and exp.state == scheduler_pb2.EXPERIMENT_STATE_PENDING
            message = "" if waiting or exp is None else exp.message
            out[who] = (
                outcome.code,
                exp and (exp.state, message, exp.spec_json, exp.tenant, exp.name),
            )
        return out

    def victims(self) -> dict[str, tuple]:
        return self.loop.run(self._victims(), timeout=60)

    async def _health(self) -> dict[str, str]:
        out = {}
        for name in self.addresses:
            stub = health_pb2_grpc.HealthStub(self._channel(name, "viewer"))
            try:
                answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_S)
                out[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
            except grpc.aio.AioRpcError as e:
                out[name] = f"{e.code().name}: {e.details()}"
        return out

    def health(self) -> dict[str, str]:
        """Each service's health: SERVING unless it crashed or stopped serving."""
        return self.loop.run(self._health(), timeout=60)

    def ids(self) -> tuple[str, ...]:
        """Real entity ids a case may name: every experiment, the bound one."""
        return (*self.experiments.values(), BOUND)


__all__ = ["FuzzCluster", "Outcome", "path_of"]
