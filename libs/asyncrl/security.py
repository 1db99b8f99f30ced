"""Who may call what: TLS on every port, a signed token on every gRPC call, NATS users.

The files live in one secrets directory (`ASYNCRL_SECRETS`, default `var/secrets/`; `make up`
creates it once with `ensure_secrets` and reuses it; every file 0600):

    ca.pem, ca.key              the local certificate authority (`cryptography`)
    server.pem, server.key      this host's certificate (SAN: loopback + ASYNCRL_TLS_HOSTS),
                                also valid as a client certificate for mutual TLS
    token.key, token.pub        Ed25519 pair that signs / verifies the bearer tokens (JWT)
    tokens/<name>.jwt           one token per identity: admin, viewer, scheduler, trainer,
                                rollout, reward (the supervisor mints one per replica too)
    nats/<user>.password        NATS passwords; the server config holds only bcrypt hashes

A token's claims are `sub` (the identity, e.g. `rollout-1`) and `role`: `admin` (submit,
cancel), `viewer` (read), `scheduler` (the scheduler's own calls to rollouts and trainers), or
a worker kind `trainer` | `rollout` | `reward`. An `admin` or `viewer` token may also carry a
`tenant`: it then sees only the experiments its tenant submitted (docs/tenants.md); a token
without one (every token minted before tenants existed) is the operator's and sees everything. Verifying needs only `token.pub`, so a host that
runs rollouts holds its own tokens and cannot mint others. `ASYNCRL_INSECURE=1` turns all of it
off (plain gRPC, no tokens, anonymous NATS): for the benchmark's same-run comparison only.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import ipaddress
import os
import re
import secrets as pysecrets
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import grpc
import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from asyncrl.logging import get_logger
from asyncrl.rpc_policy import POLICY, ROLES, TENANT_METHODS, WORKER_ROLES  # noqa: F401 (re-exported)
from asyncrl.settings import settings

log = get_logger()

ISSUER = "asyncrl"
IDENTITIES = {name: name for name in ROLES}
"""The identities `ensure_secrets` makes a token for, each with the role of the same name."""
NATS_USERS = ("scheduler", "trainer", "rollout", "reward", "admin", "viewer")
"""NATS users (the reward service's publishes its heartbeats only)."""
TENANT_NATS_PREFIX = "tenant-"
"""A tenant's NATS user is `tenant-<tenant>` (one per tenant, shared by its admins and viewers;
its password is nats/tenant-<tenant>.password, its permissions asyncrl.natsutil's)."""
NATS_ROUTE_USER = "route"
"""What the nodes of a NATS cluster authenticate their routes with (asyncrl.natsutil)."""
TENANT_ROLES = ("admin", "viewer")
"""The roles a token with a tenant may have (workers and the scheduler serve every tenant)."""
TENANT_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,31}")
"""A tenant's name: it is a NATS subject token and the prefix of its experiments' ids
(`<tenant>.<slug>-<hex>`); no `-`, so that no tenant is named like an operator's experiment id
(those always hold one) and no `.`, `*` or `>` (NATS subject syntax)."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")
CERT_DAYS = 3650


class AuthError(Exception):
    """A credential is missing, malformed, forged or of the wrong kind (UNAUTHENTICATED)."""


# ---- the secrets directory -------------------------------------------------------------------


def secrets_dir() -> Path:
    return settings().secrets_dir


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by its owner only (created 0600, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "asyncrl"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_ca(directory: Path) -> None:
    """A new local CA: ca.key + ca.pem (self-signed, ECDSA P-256)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("asyncrl local CA"))
        .issuer_name(_name("asyncrl local CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    write_private(directory / "ca.key", _pem_key(key))
    write_private(directory / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))


def issue_cert(
    directory: Path, hosts: Iterable[str], out: Path | None = None, name: str = "server"
) -> tuple[Path, Path]:
    """Sign a certificate for `hosts` (IPs or DNS names) with the CA in `directory`; written to
    `out`/<name>.pem and <name>.key (default: `directory`). Valid for TLS servers and clients."""
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    hosts = list(hosts)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    out = out or directory
    cert_path, key_path = out / f"{name}.pem", out / f"{name}.key"
    write_private(key_path, _pem_key(key))
    write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def check_tenant(tenant: str, role: str) -> None:
    """ValueError naming the field unless `tenant` ("" for the operator) may go with `role`."""
    if not tenant:
        return
    if not TENANT_PATTERN.fullmatch(tenant):
        raise ValueError(
            f"tenant: {tenant!r} must match {TENANT_PATTERN.pattern} (a lower-case letter, then "
            "at most 31 lower-case letters, digits or '_')"
        )
    if role not in TENANT_ROLES:
        raise ValueError(f"tenant: only {' and '.join(TENANT_ROLES)} tokens have one, not {role}")


def mint_token(directory: Path, subject: str, role: str, tenant: str = "") -> str:
    """A bearer token for identity `subject` with `role` (and `tenant`, "" for the operator),
    signed with `directory`/token.key."""
    if role not in ROLES:
        raise ValueError(f"role: {role!r} is not one of {', '.join(ROLES)}")
    check_tenant(tenant, role)
    key = serialization.load_pem_private_key((directory / "token.key").read_bytes(), None)
    claims = {
        "sub": subject,
        "role": role,
        "iss": ISSUER,
        "iat": int(dt.datetime.now().timestamp()),
    }
    if tenant:
        claims["tenant"] = tenant
    return jwt.encode(claims, key, algorithm="EdDSA")


def write_token(directory: Path, subject: str, role: str) -> Path:
    """Mint a token for `subject` and store it as tokens/<subject>.jwt (kept if it exists)."""
    path = directory / "tokens" / f"{subject}.jwt"
    if not path.exists():
        write_private(path, mint_token(directory, subject, role).encode())
    return path


def tenant_nats_user(tenant: str) -> str:
    return f"{TENANT_NATS_PREFIX}{tenant}"


def ensure_tenant(directory: Path, tenant: str) -> Path:
    """Make tenant `tenant`'s NATS password (kept if it exists); returns its path. nats-server
    learns of a new tenant when its configuration is written again (a restart: `make up`)."""
    check_tenant(tenant, "admin")
    path = directory / "nats" / f"{tenant_nats_user(tenant)}.password"
    if not path.exists():
        write_private(path, pysecrets.token_urlsafe(24).encode())
    return path


def tenants(directory: Path) -> list[str]:
    """The tenants with a NATS user in `directory` (a password, or a NATS node's bcrypt hash)."""
    found = set()
    for path in (directory / "nats").glob(f"{TENANT_NATS_PREFIX}*"):
        if path.suffix in (".password", ".bcrypt"):
            found.add(path.stem.removeprefix(TENANT_NATS_PREFIX))
    return sorted(t for t in found if TENANT_PATTERN.fullmatch(t))


def is_bundle(directory: Path) -> bool:
    """A directory with a CA certificate but not its key: a host's bundle, which can verify
    and present credentials but not issue them."""
    return (directory / "ca.pem").exists() and not (directory / "ca.key").exists()


def ensure_secrets(directory: Path | None = None, hosts: Iterable[str] = ()) -> Path:
    """Create whatever of the secrets directory is missing (CA, this host's certificate, the
    token key pair, a token per identity, NATS passwords); existing files are kept."""
    directory = Path(directory or secrets_dir())
    if is_bundle(directory):
        return directory  # another host's credentials (`asyncrl secrets bundle`): used as is
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    if not (directory / "ca.pem").exists():
        make_ca(directory)
        log.info("secrets_created", what="ca", directory=str(directory))
    if not (directory / "server.pem").exists():
        issue_cert(directory, [*LOOPBACK, *settings().tls_host_list, *hosts])
    if not (directory / "token.key").exists():
        key = ed25519.Ed25519PrivateKey.generate()
        write_private(directory / "token.key", _pem_key(key))
        pub = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        write_private(directory / "token.pub", pub)
    for subject, role in IDENTITIES.items():
        write_token(directory, subject, role)
    for user in (*NATS_USERS, NATS_ROUTE_USER):
        path = directory / "nats" / f"{user}.password"
        if not path.exists():
            write_private(path, pysecrets.token_urlsafe(24).encode())
    return directory


# ---- one process's view: who am I, whom do I trust ---------------------------------------------


def insecure() -> bool:
    return settings().insecure


@dataclass(frozen=True)
class Credentials:
    """What one identity presents and trusts, read from the secrets directory (or the
    ASYNCRL_TOKEN_FILE / ASYNCRL_TLS_* / ASYNCRL_NATS_* overrides).

    `Credentials.load("rollout")` is the rollout's: its token, the CA it trusts, this host's
    certificate (to serve and, under mutual TLS, to present) and its NATS user."""

    identity: str
    directory: Path

    @classmethod
    def load(cls, identity: str) -> Credentials:
        return cls(identity, Path(secrets_dir()))

    def _read(self, override: Path | None, default: Path, what: str) -> bytes:
        path = override or default
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise AuthError(
                f"no {what} for {self.identity!r} at {path}: run `make up` (it creates "
                f"{self.directory}) or set ASYNCRL_SECRETS / the ASYNCRL_TOKEN_FILE, "
                "ASYNCRL_TLS_* and ASYNCRL_NATS_* variables"
            ) from None

    @cached_property
    def token(self) -> str:
        s = settings()
        if s.token:
            return s.token.get_secret_value()
        default = self.directory / "tokens" / f"{self.identity}.jwt"
        return self._read(s.token_file, default, "token").decode().strip()

    @cached_property
    def ca(self) -> bytes:
        return self._read(settings().tls_ca, self.directory / "ca.pem", "CA certificate")

    @cached_property
    def cert(self) -> bytes:
        return self._read(settings().tls_cert, self.directory / "server.pem", "certificate")

    @cached_property
    def key(self) -> bytes:
        return self._read(settings().tls_key, self.directory / "server.key", "private key")

    @cached_property
    def tenant(self) -> str:
        """The tenant this identity's token carries ("": the operator's, or no token). Read
        without verifying: it only picks this process's own NATS user."""
        try:
            claims = jwt.decode(self.token, options={"verify_signature": False})
        except (AuthError, jwt.PyJWTError):
            return ""
        tenant = claims.get("tenant", "")
        return tenant if isinstance(tenant, str) else ""

    @cached_property
    def nats_user(self) -> str:
        """ASYNCRL_NATS_USER, else the token's tenant's user, else the identity's kind."""
        if settings().nats_user:
            return settings().nats_user
        return tenant_nats_user(self.tenant) if self.tenant else self.identity.split("-")[0]

    @cached_property
    def nats_password(self) -> str:
        s = settings()
        if s.nats_password:
            return s.nats_password.get_secret_value()
        path = self.directory / "nats" / f"{self.nats_user}.password"
        return self._read(None, path, "NATS password").decode().strip()

    # -- gRPC

    def server_credentials(self) -> grpc.ServerCredentials:
        mtls = settings().mtls
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca if mtls else None,
            require_client_auth=mtls,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS trusting our CA (and presenting our certificate under mTLS). The token goes on
        each call as metadata, added by `grpcutil.bearer_interceptors`."""
        mtls = settings().mtls
        return grpc.ssl_channel_credentials(
            self.ca, self.key if mtls else None, self.cert if mtls else None
        )

    # -- NATS and HTTPS

    def client_ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=self.ca.decode())
        if settings().mtls:
            _load_chain(ctx, self.cert, self.key)
        return ctx

    def server_ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        _load_chain(ctx, self.cert, self.key)
        return ctx

    def nats_options(self) -> dict:
        """Keyword arguments for `nats.connect`: user, password and TLS."""
        return {
            "user": self.nats_user,
            "password": self.nats_password,
            "tls": self.client_ssl_context(),
        }


def _load_chain(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """`ssl` loads certificates from files only: write them to a private temp dir."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = Path(tmp) / "c.pem", Path(tmp) / "c.key"
        write_private(cert_path, cert)
        write_private(key_path, key)
        ctx.load_cert_chain(cert_path, key_path)


def credentials(identity: str) -> Credentials | None:
    """`identity`'s credentials, or None when ASYNCRL_INSECURE is set."""
    return None if insecure() else Credentials.load(identity)


# ---- checking a call ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Principal:
    """Who made the call being served: the token's subject, role and tenant ("": the
    operator, who sees every tenant's experiments)."""

    subject: str
    role: str
    tenant: str = ""

    def sees(self, tenant: str) -> bool:
        """Whether this caller may see an experiment of `tenant` (the operator sees all)."""
        return not self.tenant or self.tenant == tenant


_caller: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "asyncrl_caller", default=None
)


def caller() -> Principal | None:
    """The principal of the RPC being served (None when security is off)."""
    return _caller.get()


class TokenVerifier:
    """Checks bearer tokens against token.pub; a verified token is remembered (bounded)."""

    def __init__(self, public_key_pem: bytes, cache_size: int = 4096):
        self._key = serialization.load_pem_public_key(public_key_pem)
        self._cache: dict[str, Principal] = {}
        self._cache_size = cache_size

    @classmethod
    def load(cls) -> TokenVerifier:
        path = settings().token_pubkey or secrets_dir() / "token.pub"
        try:
            return cls(path.read_bytes())
        except FileNotFoundError:
            raise AuthError(f"no token verification key at {path}: run `make up`") from None

    def verify(self, token: str) -> Principal:
        principal = self._cache.get(token)
        if principal is not None:
            return principal
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=["EdDSA"],
                issuer=ISSUER,
                options={"require": ["sub", "iss"]},
            )
        except jwt.PyJWTError as e:
            raise AuthError(f"invalid token: {e}") from None
        role = claims.get("role")
        if role not in ROLES:
            raise AuthError(f"invalid token: unknown role {role!r}")
        tenant = claims.get("tenant", "")
        try:
            check_tenant(tenant if isinstance(tenant, str) else repr(tenant), role)
        except ValueError as e:
            raise AuthError(f"invalid token: {e}") from None
        principal = Principal(subject=str(claims["sub"]), role=role, tenant=tenant)
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[token] = principal
        return principal


OPEN_METHODS = frozenset(["/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"])
"""Health answers without a token (over TLS) so that probes (`make up`, Kubernetes) need no
secret; it says SERVING or not and nothing else."""
ANY_ROLE = frozenset(ROLES)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """One check per call: a valid bearer token (else UNAUTHENTICATED) whose role the method's
    `policy` entry allows (else PERMISSION_DENIED). Methods not in `policy` (reflection) need
    any valid token. The caller is available to the handler as `caller()`."""

    def __init__(self, policy: Mapping[str, Iterable[str]], verifier: TokenVerifier):
        self.policy = {method: frozenset(roles) for method, roles in policy.items()}
        self.verifier = verifier

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        try:
            principal = self.verifier.verify(_bearer(details.invocation_metadata))
        except AuthError as e:
            return _denied(handler, grpc.StatusCode.UNAUTHENTICATED, str(e))
        allowed = self.policy.get(details.method, ANY_ROLE)
        if principal.tenant and details.method not in TENANT_METHODS:
            message = (
                f"{principal.subject} (tenant {principal.tenant}) may not call {details.method}: "
                "a tenant's token calls only the scheduler's experiment methods, ListWorkers "
                "and ListRewardFunctions"
            )
            return _denied(handler, grpc.StatusCode.PERMISSION_DENIED, message)
        if principal.role not in allowed:
            log.warning(
                "rpc_permission_denied",
                method=details.method,
                caller=principal.subject,
                role=principal.role,
            )
            message = (
                f"{principal.subject} (role {principal.role}) may not call {details.method}; "
                f"allowed: {', '.join(sorted(allowed))}"
            )
            return _denied(handler, grpc.StatusCode.PERMISSION_DENIED, message)
        return _as(principal, handler)


def _bearer(metadata) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
            raise AuthError("authorization metadata must be 'Bearer <token>'")
    raise AuthError("no credentials: send 'authorization: Bearer <token>'")


def _denied(handler, code: grpc.StatusCode, message: str):
    if handler.unary_unary is not None:

        async def unary(request, context):
            await context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    make = (  # reflection is the one bidirectional stream
        grpc.stream_stream_rpc_method_handler
        if handler.stream_stream is not None
        else grpc.unary_stream_rpc_method_handler
    )
    return make(stream, handler.request_deserializer, handler.response_serializer)


def _as(principal: Principal, handler):
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(request, context):
            _caller.set(principal)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream(request, context):
            _caller.set(principal)
            async for item in inner_stream(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )
    return handler


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The authentication interceptor for this process's servers (none when insecure)."""
    return [] if insecure() else [AuthInterceptor(POLICY, TokenVerifier.load())]
