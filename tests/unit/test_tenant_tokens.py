"""Tokens with a tenant (docs/tenants.md): minted, verified, refused where malformed, and the
`asyncrl secrets token --tenant` command that makes the tenant's NATS user too."""

from __future__ import annotations

import json

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from typer.testing import CliRunner

from asyncrl.natsutil import NATS_PERMISSIONS, nats_config
from asyncrl.rpc_policy import POLICY, TENANT_METHODS
from asyncrl.security import (
    ISSUER,
    AuthError,
    Credentials,
    Principal,
    TokenVerifier,
    ensure_secrets,
    mint_token,
    tenants,
)
from asyncrl.security_cli import app


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    return ensure_secrets(tmp_path_factory.mktemp("tn") / "secrets")


def _verify(secrets, token: str) -> Principal:
    return TokenVerifier((secrets / "token.pub").read_bytes()).verify(token)


def _sign(secrets, claims: dict) -> str:
    key = serialization.load_pem_private_key((secrets / "token.key").read_bytes(), None)
    return jwt.encode(claims, key, algorithm="EdDSA")


def test_token_with_a_tenant_verifies_to_a_principal_of_that_tenant(secrets):
    got = _verify(secrets, mint_token(secrets, "alice", "viewer", tenant="acme"))
    assert got == Principal(subject="alice", role="viewer", tenant="acme")
    assert got.sees("acme") and not got.sees("bcorp") and not got.sees("")


def test_token_without_a_tenant_is_the_operator_who_sees_every_tenant(secrets):
    """Tokens minted before tenants existed carry no claim: they keep working, as operators."""
    got = _verify(secrets, (secrets / "tokens" / "admin.jwt").read_text().strip())
    assert got == Principal(subject="admin", role="admin", tenant="")
    assert got.sees("") and got.sees("acme") and got.sees("bcorp")


@pytest.mark.parametrize(
    ("tenant", "role", "why"),
    [
        ("Acme", "admin", "must match"),
        ("ac-me", "admin", "must match"),  # '-': would look like an operator's experiment id
        ("ac.me", "admin", "must match"),  # a NATS subject token
        ("a" * 33, "admin", "must match"),
        ("acme", "rollout", "only admin and viewer"),
        ("acme", "scheduler", "only admin and viewer"),
    ],
)
def test_mint_token_refuses_a_bad_tenant_naming_the_field(secrets, tenant, role, why):
    with pytest.raises(ValueError, match=f"^tenant: .*{why}"):
        mint_token(secrets, "x", role, tenant=tenant)


@pytest.mark.parametrize(
    "claims",
    [
        {"sub": "w", "role": "trainer", "iss": ISSUER, "tenant": "acme"},
        {"sub": "x", "role": "admin", "iss": ISSUER, "tenant": "a.>"},
        {"sub": "x", "role": "admin", "iss": ISSUER, "tenant": ["acme"]},
    ],
    ids=["worker-with-tenant", "subject-wildcards", "not-a-string"],
)
def test_signed_token_with_a_bad_tenant_claim_is_unauthenticated(secrets, claims):
    with pytest.raises(AuthError, match="invalid token: tenant"):
        _verify(secrets, _sign(secrets, claims))


def test_tenant_methods_are_scheduler_experiment_methods_a_viewer_or_admin_may_call():
    assert TENANT_METHODS <= set(POLICY)
    for method in TENANT_METHODS:
        assert POLICY[method] & {"admin", "viewer"}, method
    assert "/asyncrl.v1.Trainer/CheckpointNow" not in TENANT_METHODS
    assert "/asyncrl.v1.Trainer/GetStatus" not in TENANT_METHODS
    assert "/asyncrl.v1.Rollout/GetStatus" not in TENANT_METHODS


def test_cli_token_with_tenant_writes_the_token_and_the_tenants_nats_user(tmp_path):
    source = ensure_secrets(tmp_path / "secrets")
    out = tmp_path / "bob.jwt"
    args = ["token", "bob", "--role", "admin", "--tenant", "acme", "--out", str(out)]
    done = CliRunner().invoke(app, [*args, "--dir", str(source)])
    assert done.exit_code == 0, done.output
    assert _verify(source, out.read_text()) == Principal("bob", "admin", "acme")
    assert tenants(source) == ["acme"]
    password = source / "nats" / "tenant-acme.password"
    assert password.stat().st_mode & 0o777 == 0o600
    config = json.loads(nats_config(4222, tmp_path / "js", source))
    users = {u["user"] for u in config["authorization"]["users"]}
    assert users == {*NATS_PERMISSIONS, "tenant-acme"}
    again = CliRunner().invoke(
        app, [*args[:-2], "--out", str(tmp_path / "x"), "--dir", str(source)]
    )
    assert again.exit_code == 0  # same tenant again: its password is kept
    assert (source / "nats" / "tenant-acme.password").read_bytes() == password.read_bytes()
    refused = CliRunner().invoke(
        app, ["token", "w", "--role", "rollout", "--tenant", "acme", "--out", str(tmp_path / "w")]
    )
    assert refused.exit_code == 2 and "only admin and viewer" in refused.output


def test_credentials_of_a_tenant_token_use_the_tenants_nats_user(tmp_path, monkeypatch):
    source = ensure_secrets(tmp_path / "secrets")
    token = tmp_path / "alice.jwt"
    token.write_text(mint_token(source, "alice", "viewer", tenant="acme"))
    monkeypatch.setenv("ASYNCRL_TOKEN_FILE", str(token))
    assert Credentials("viewer", source).nats_user == "tenant-acme"
    monkeypatch.delenv("ASYNCRL_TOKEN_FILE")
    assert Credentials("viewer", source).nats_user == "viewer"
