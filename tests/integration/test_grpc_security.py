"""gRPC and /metrics under `make up`'s security, against the real scheduler, rollout, reward and
trainer servers on port 0 (one of each for the module; the calls here are refused before any
handler runs, so they leave no state behind).

Every RPC is found in the compiled proto descriptors (`asyncrl.v1.*_pb2`), never listed by hand:
an RPC added to a proto is covered by the next run, and a new service fails these tests until a
server for it is started here.
"""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
import jwt
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives import serialization
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import asyncrl.v1
from asyncrl.grpcutil import channel, check_health
from asyncrl.natsutil import LocalNatsServer
from asyncrl.security import (
    ISSUER,
    POLICY,
    ROLES,
    Credentials,
    ensure_secrets,
    mint_token,
    secrets_dir,
)
from services.reward.server import create_reward
from services.rollout.server import create_rollout
from services.rollout.torch_engine import TorchEngine
from services.scheduler.server import create_scheduler
from services.trainer.server import create_trainer

pytestmark = pytest.mark.asyncio(loop_scope="module")

CODE = grpc.StatusCode
TIMEOUT_S = 10.0


def asyncrl_services() -> list[ServiceDescriptor]:
    """Every gRPC service in the compiled asyncrl protos."""
    services = []
    for info in pkgutil.iter_modules(asyncrl.v1.__path__):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"asyncrl.v1.{info.name}")
            services.extend(module.DESCRIPTOR.services_by_name.values())
    return services


def path_of(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


RPCS: list[MethodDescriptor] = [m for s in asyncrl_services() for m in s.methods]
METHODS = {path_of(m): m for m in RPCS}


@dataclass
class Cluster:
    addresses: dict[str, str]
    """Service full name (asyncrl.v1.Scheduler) -> host:port of its server."""
    metrics_port: int
    """The scheduler's /metrics port."""

    def address(self, method: MethodDescriptor) -> str:
        service = method.containing_service.full_name
        assert service in self.addresses, f"no server for {service}: start one in `cluster`"
        return self.addresses[service]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory):
    """One real server of each service, secure as under `make up` (the session's secrets)."""
    root = tmp_path_factory.mktemp("grpc-security")
    runtimes = []
    with LocalNatsServer(root / "jetstream") as nats_server:
        try:
            sched, _ = await create_scheduler(nats_server.url, metrics_port=0)
            runtimes.append(sched)
            reward, _ = await create_reward(port=0, workers=1, register=False)
            runtimes.append(reward)
            rollout, _ = await create_rollout(nats_server.url, TorchEngine(seed=0), register=False)
            runtimes.append(rollout)
            trainer, _ = await create_trainer(
                nats_server.url,
                scheduler=f"127.0.0.1:{sched.port}",
                register=False,
                var_dir=root / "var",
                weights_dir=root / "weights",
            )
            runtimes.append(trainer)
            names = ["Scheduler", "Reward", "Rollout", "Trainer"]
            ports = {f"asyncrl.v1.{n}": rt.port for n, rt in zip(names, runtimes, strict=True)}
            addresses = {service: f"127.0.0.1:{port}" for service, port in ports.items()}
            yield Cluster(addresses, sched.metrics_port)
        finally:
            for runtime in reversed(runtimes):
                await runtime.close()


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    debug: str

    def text(self) -> str:
        return f"{self.details} {self.debug}"


async def call(ch: grpc.aio.Channel, method: MethodDescriptor, metadata=None) -> Outcome:
    """Call `method` with an empty request over `ch` (any of the four RPC kinds)."""
    request = GetMessageClass(method.input_type)()
    serialize = type(request).SerializeToString
    deserialize = GetMessageClass(method.output_type).FromString
    kind = {
        (False, False): ch.unary_unary,
        (False, True): ch.unary_stream,
        (True, False): ch.stream_unary,
        (True, True): ch.stream_stream,
    }[(method.client_streaming, method.server_streaming)]
    rpc = kind(path_of(method), request_serializer=serialize, response_deserializer=deserialize)
    arg = iter([request]) if method.client_streaming else request
    try:
        answer = rpc(arg, timeout=TIMEOUT_S, metadata=metadata)
        if method.server_streaming:
            async for _ in answer:
                pass
        else:
            await answer
    except grpc.aio.AioRpcError as e:
        return Outcome(e.code(), e.details() or "", e.debug_error_string() or "")
    return Outcome(CODE.OK, "", "")


async def call_as(cluster: Cluster, path: str, identity: str) -> Outcome:
    method = METHODS[path]
    async with channel(cluster.address(method), identity) as ch:
        return await call(ch, method)


def _signing_key():
    return serialization.load_pem_private_key((secrets_dir() / "token.key").read_bytes(), None)


def _claims(**changes) -> dict:
    claims = {"sub": "admin", "role": "admin", "iss": ISSUER} | changes
    return {k: v for k, v in claims.items() if v is not None}


def _tampered() -> str:
    """The viewer's real token with its payload changed to role admin, signature kept."""
    header, _, signature = Credentials.load("viewer").token.split(".")
    forged_payload = jwt.encode(_claims(), _signing_key(), algorithm="EdDSA").split(".")[1]
    return f"{header}.{forged_payload}.{signature}"


def bad_authorization(kind: str, tmp_path) -> str:
    """The `authorization` metadata value of one kind of bad credential."""
    if kind == "other-key":  # a whole secrets directory of its own: same claims, other key
        return f"Bearer {mint_token(ensure_secrets(tmp_path / 'other'), 'admin', 'admin')}"
    token = {
        "garbage": lambda: "not-a-jwt",
        "alg-none": lambda: jwt.encode(_claims(), None, algorithm="none"),
        "tampered": _tampered,
        "unknown-role": lambda: jwt.encode(_claims(role="root"), _signing_key(), "EdDSA"),
        "no-sub": lambda: jwt.encode(_claims(sub=None), _signing_key(), "EdDSA"),
        "other-issuer": lambda: jwt.encode(_claims(iss="evil"), _signing_key(), "EdDSA"),
        "basic-scheme": lambda: "",
        "empty-bearer": lambda: "",
    }[kind]()
    if kind == "basic-scheme":
        return f"Basic {Credentials.load('admin').token}"
    return f"Bearer {token}"


def test_descriptors_hold_every_service_and_their_rpcs():
    services = {s.full_name for s in asyncrl_services()}
    assert {"asyncrl.v1.Scheduler", "asyncrl.v1.Rollout"} <= services
    assert {"asyncrl.v1.Reward", "asyncrl.v1.Trainer"} <= services
    assert "/asyncrl.v1.Scheduler/SubmitExperiment" in METHODS
    assert "/asyncrl.v1.Scheduler/WatchExperiment" in METHODS  # server-streaming too


async def test_every_rpc_without_credentials_unauthenticated(cluster):
    wrong = {}
    for method in RPCS:
        async with channel(cluster.address(method), token=False) as ch:  # TLS, no token
            outcome = await call(ch, method)
        if outcome.code != CODE.UNAUTHENTICATED:
            wrong[path_of(method)] = outcome
    assert wrong == {}


@pytest.mark.parametrize(
    "kind",
    [
        "other-key",
        "garbage",
        "alg-none",
        "tampered",
        "unknown-role",
        "no-sub",
        "other-issuer",
        "basic-scheme",
        "empty-bearer",
    ],
)
async def test_every_rpc_bad_token_unauthenticated_token_never_echoed(
    cluster, kind, tmp_path, capfd
):
    authorization = bad_authorization(kind, tmp_path)
    secret = authorization.partition(" ")[2]
    wrong = {}
    for method in RPCS:
        async with channel(cluster.address(method), token=False) as ch:
            outcome = await call(ch, method, metadata=(("authorization", authorization),))
        if outcome.code != CODE.UNAUTHENTICATED or (secret and secret in outcome.text()):
            wrong[path_of(method)] = outcome
    assert wrong == {}
    if secret:
        out, err = capfd.readouterr()
        assert secret not in out + err


@pytest.mark.parametrize(
    "path",
    ["/asyncrl.v1.Scheduler/SubmitExperiment", "/asyncrl.v1.Scheduler/CancelExperiment"],
)
async def test_viewer_token_cannot_submit_or_cancel_permission_denied(cluster, path, capfd):
    outcome = await call_as(cluster, path, "viewer")
    assert outcome.code == CODE.PERMISSION_DENIED, outcome
    viewer_token = Credentials.load("viewer").token
    assert viewer_token not in outcome.text()
    out, err = capfd.readouterr()
    assert "rpc_permission_denied" in out + err  # the refusal is logged ...
    assert viewer_token not in out + err  # ... without the token


@pytest.mark.parametrize(
    "path",
    [
        "/asyncrl.v1.Scheduler/ListExperiments",
        "/asyncrl.v1.Scheduler/ListWorkers",
        "/asyncrl.v1.Rollout/GetStatus",
        "/asyncrl.v1.Trainer/GetStatus",
        "/asyncrl.v1.Reward/ListRewardFunctions",
    ],
)
async def test_viewer_token_can_list_and_read_status(cluster, path):
    assert (await call_as(cluster, path, "viewer")).code == CODE.OK


@pytest.mark.parametrize("identity", ["rollout", "reward", "trainer"])
async def test_worker_token_cannot_submit_or_cancel(cluster, identity):
    for path in (
        "/asyncrl.v1.Scheduler/SubmitExperiment",
        "/asyncrl.v1.Scheduler/CancelExperiment",
    ):
        outcome = await call_as(cluster, path, identity)
        assert outcome.code == CODE.PERMISSION_DENIED, (path, outcome)


@pytest.mark.parametrize("identity", ["rollout", "trainer", "reward", "admin", "viewer"])
async def test_only_scheduler_drives_rollouts_and_trainers(cluster, identity):
    """GenerateGroup / UpdateWeights / BindExperiment on a rollout and StartExperiment /
    StopExperiment on a trainer are the scheduler's alone."""
    paths = [
        "/asyncrl.v1.Rollout/GenerateGroup",
        "/asyncrl.v1.Rollout/UpdateWeights",
        "/asyncrl.v1.Rollout/BindExperiment",
        "/asyncrl.v1.Trainer/StartExperiment",
        "/asyncrl.v1.Trainer/StopExperiment",
    ]
    outcomes = {path: await call_as(cluster, path, identity) for path in paths}
    assert {p: o.code for p, o in outcomes.items()} == dict.fromkeys(paths, CODE.PERMISSION_DENIED)


async def test_scheduler_token_passes_authorisation_on_rollout(cluster):
    """The counterpart: the scheduler's own token gets through to the handler (which finds the
    empty request wanting, not the caller)."""
    status = await call_as(cluster, "/asyncrl.v1.Rollout/GetStatus", "scheduler")
    assert status.code == CODE.OK
    update = await call_as(cluster, "/asyncrl.v1.Rollout/UpdateWeights", "scheduler")
    assert update.code not in (CODE.UNAUTHENTICATED, CODE.PERMISSION_DENIED), update


async def test_every_role_outside_the_policy_permission_denied(cluster):
    """The interceptor enforces POLICY for every RPC and every role it does not allow."""
    assert set(POLICY) == set(METHODS)
    wrong = {}
    for path, allowed in POLICY.items():
        for role in sorted(set(ROLES) - allowed):
            outcome = await call_as(cluster, path, role)
            if outcome.code != CODE.PERMISSION_DENIED:
                wrong[(path, role)] = outcome
    assert wrong == {}


async def test_plain_connection_to_secure_port_unavailable(cluster):
    health = health_pb2.HealthCheckRequest()
    for address in cluster.addresses.values():
        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(ch).Check(health, timeout=TIMEOUT_S)
            assert err.value.code() == CODE.UNAVAILABLE, address
            outcome = await call(ch, RPCS[0])
            assert outcome.code == CODE.UNAVAILABLE, (address, outcome)


async def test_tls_to_a_server_not_signed_by_a_trusted_ca_unavailable(cluster):
    """A client that trusts only the public roots (not the local CA) refuses the server."""
    for address in cluster.addresses.values():
        async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials()) as ch:
            outcome = await call(ch, RPCS[0])
        assert outcome.code == CODE.UNAVAILABLE, (address, outcome)


async def test_health_open_over_tls_without_token_reflection_needs_one(cluster):
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    for address in cluster.addresses.values():
        assert await check_health(address)
        async with channel(address, token=False) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            # nothing written: the refusal comes on the headers alone (a request written while
            # it comes can fail in grpc's core and end the call INTERNAL on this side)
            call = stub.ServerReflectionInfo(timeout=TIMEOUT_S)
            assert await call.code() == CODE.UNAUTHENTICATED
        async with channel(address, "viewer") as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            answers = [a async for a in stub.ServerReflectionInfo(iter([request]))]
        listed = {s.name for s in answers[0].list_services_response.service}
        assert listed & set(cluster.addresses)


def _get(url: str, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as resp:
        return resp.status, resp.read().decode()


async def test_metrics_https_only_trusting_the_local_ca(cluster):
    port = cluster.metrics_port
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # no plain HTTP
        await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
    https = f"https://127.0.0.1:{port}/metrics"
    with pytest.raises(urllib.error.URLError) as err:  # public roots only: not trusted
        await asyncio.to_thread(_get, https, ssl.create_default_context())
    assert isinstance(err.value.reason, ssl.SSLCertVerificationError)
    status, body = await asyncio.to_thread(
        _get, https, Credentials.load("viewer").client_ssl_context()
    )
    assert status == 200 and "asyncrl_scheduler_workers" in body


async def test_channel_token_reaches_server_streaming_calls(cluster):
    """grpcutil.channel presents the token on streaming calls too (a channel files an
    interceptor under one call type only: WatchExperiment once went out without it)."""
    watch = await call_as(cluster, "/asyncrl.v1.Scheduler/WatchExperiment", "viewer")
    assert watch.code == CODE.NOT_FOUND, watch
