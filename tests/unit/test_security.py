"""asyncrl.security without a server: the secrets directory, certificates, tokens and the role
policy checked against the compiled protos."""

from __future__ import annotations

import importlib
import ipaddress
import os
import pkgutil
import stat

import jwt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

import asyncrl.v1
from asyncrl.security import (
    IDENTITIES,
    ISSUER,
    POLICY,
    ROLES,
    AuthError,
    Principal,
    TokenVerifier,
    ensure_secrets,
    mint_token,
)


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    return ensure_secrets(tmp_path_factory.mktemp("secrets") / "s")


@pytest.fixture(scope="module")
def other_secrets(tmp_path_factory):
    """A second, unrelated secrets directory: its own CA and signing key."""
    return ensure_secrets(tmp_path_factory.mktemp("other") / "s")


def _snapshot(directory) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def _verifier(directory) -> TokenVerifier:
    return TokenVerifier((directory / "token.pub").read_bytes())


def _sign(directory, claims: dict) -> str:
    key = serialization.load_pem_private_key((directory / "token.key").read_bytes(), None)
    return jwt.encode(claims, key, algorithm="EdDSA")


def test_ensure_secrets_files_0600_dirs_0700_even_with_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        directory = ensure_secrets(tmp_path / "secrets")
    finally:
        os.umask(old)
    files = [p for p in directory.rglob("*") if p.is_file()]
    dirs = [directory, *(p for p in directory.rglob("*") if p.is_dir())]
    names = {str(p.relative_to(directory)) for p in files}
    assert {"ca.pem", "ca.key", "server.pem", "server.key", "token.key", "token.pub"} <= names
    assert {f"tokens/{name}.jwt" for name in IDENTITIES} <= names
    assert any(name.startswith("nats/") for name in names)
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {
        str(p): oct(0o600) for p in files
    }
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in dirs} == {
        str(p): oct(0o700) for p in dirs
    }


def test_ensure_secrets_second_call_keeps_every_file(tmp_path):
    directory = ensure_secrets(tmp_path / "secrets")
    before = _snapshot(directory)
    ensure_secrets(directory, hosts=["10.9.8.7"])
    assert _snapshot(directory) == before  # same CA, keys, tokens and passwords


def test_ensure_secrets_fills_in_only_what_is_missing(tmp_path):
    directory = ensure_secrets(tmp_path / "secrets")
    ca = (directory / "ca.pem").read_bytes()
    (directory / "tokens" / "viewer.jwt").unlink()
    ensure_secrets(directory)
    assert (directory / "ca.pem").read_bytes() == ca
    principal = _verifier(directory).verify((directory / "tokens" / "viewer.jwt").read_text())
    assert principal == Principal("viewer", "viewer")


def test_server_certificate_san_has_loopback_and_extra_hosts_signed_by_the_ca(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("ASYNCRL_TLS_HOSTS", "gpu-node-1, 10.0.0.5")
    directory = ensure_secrets(tmp_path / "secrets", hosts=["trainer.example", "192.168.1.20"])
    cert = x509.load_pem_x509_certificate((directory / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = set(san.get_values_for_type(x509.IPAddress))
    dns = set(san.get_values_for_type(x509.DNSName))
    assert {ipaddress.ip_address(h) for h in ("127.0.0.1", "10.0.0.5", "192.168.1.20")} <= ips
    assert {"localhost", "gpu-node-1", "trainer.example"} <= dns
    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)  # raises if another key signed it


def test_token_for_each_identity_verifies_with_its_role(secrets):
    verifier = _verifier(secrets)
    for name, role in IDENTITIES.items():
        token = (secrets / "tokens" / f"{name}.jwt").read_text().strip()
        assert verifier.verify(token) == Principal(name, role)
    minted = mint_token(secrets, "rollout-3", "rollout")
    assert verifier.verify(minted) == Principal("rollout-3", "rollout")


def test_token_signed_with_another_key_fails_without_echoing_it(secrets, other_secrets):
    token = mint_token(other_secrets, "admin", "admin")
    with pytest.raises(AuthError) as err:
        _verifier(secrets).verify(token)
    assert token not in str(err.value)
    assert token.split(".")[2] not in str(err.value)


@pytest.mark.parametrize(
    "claims",
    [
        {"sub": "x", "role": "root", "iss": ISSUER},  # unknown role
        {"sub": "x", "iss": ISSUER},  # no role
        {"role": "admin", "iss": ISSUER},  # no subject
        {"sub": "x", "role": "admin"},  # no issuer
        {"sub": "x", "role": "admin", "iss": "someone-else"},
    ],
    ids=["unknown-role", "no-role", "no-sub", "no-iss", "other-issuer"],
)
def test_token_with_bad_claims_fails_even_when_correctly_signed(secrets, claims):
    with pytest.raises(AuthError):
        _verifier(secrets).verify(_sign(secrets, claims))


def test_token_unsigned_or_tampered_fails(secrets):
    verifier = _verifier(secrets)
    unsigned = jwt.encode({"sub": "x", "role": "admin", "iss": ISSUER}, None, algorithm="none")
    with pytest.raises(AuthError):
        verifier.verify(unsigned)
    header, _, signature = mint_token(secrets, "viewer", "viewer").split(".")
    payload = _sign(secrets, {"sub": "viewer", "role": "admin", "iss": ISSUER}).split(".")[1]
    with pytest.raises(AuthError):
        verifier.verify(f"{header}.{payload}.{signature}")


def test_mint_token_refuses_an_unknown_role(secrets):
    with pytest.raises(ValueError, match="root"):
        mint_token(secrets, "x", "root")


def _proto_rpcs() -> set[str]:
    rpcs = set()
    for info in pkgutil.iter_modules(asyncrl.v1.__path__):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"asyncrl.v1.{info.name}")
            for service in module.DESCRIPTOR.services_by_name.values():
                rpcs |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return rpcs


def test_policy_covers_exactly_the_rpcs_in_the_protos_with_known_roles():
    rpcs = _proto_rpcs()
    assert "/asyncrl.v1.Scheduler/SubmitExperiment" in rpcs  # the descriptors were found
    assert sorted(rpcs - set(POLICY)) == []  # no RPC falls back to "any valid token"
    assert sorted(set(POLICY) - rpcs) == []  # no entry for an RPC that does not exist
    unknown = {path: set(roles) - set(ROLES) for path, roles in POLICY.items()}
    assert {path: roles for path, roles in unknown.items() if roles} == {}
    assert all(POLICY.values())  # every RPC has somebody who may call it


def test_policy_roles_as_the_issue_asks():
    assert POLICY["/asyncrl.v1.Scheduler/SubmitExperiment"] == {"admin"}
    assert POLICY["/asyncrl.v1.Scheduler/CancelExperiment"] == {"admin"}
    assert POLICY["/asyncrl.v1.Scheduler/CommitWeights"] == {"trainer"}
    assert POLICY["/asyncrl.v1.Scheduler/ReportDropped"] == {"trainer"}
    assert POLICY["/asyncrl.v1.Rollout/GenerateGroup"] == {"scheduler"}
    assert POLICY["/asyncrl.v1.Rollout/UpdateWeights"] == {"scheduler"}
    for method in ("GetExperiment", "ListExperiments", "WatchExperiment", "ListWorkers"):
        assert "viewer" in POLICY[f"/asyncrl.v1.Scheduler/{method}"]
