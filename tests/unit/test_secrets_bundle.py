"""`asyncrl secrets bundle`: what another host gets, and what it must never get."""

from __future__ import annotations

import json
import stat

import bcrypt
import pytest
from typer.testing import CliRunner

from asyncrl.natsutil import NATS_PERMISSIONS, ClusterNode, nats_config
from asyncrl.security import NATS_USERS, ensure_secrets, is_bundle
from asyncrl.security_cli import app


def bundle(tmp_path, *args: str):
    source = ensure_secrets(tmp_path / "a")
    out = tmp_path / "b"
    done = CliRunner().invoke(
        app, ["bundle", "10.0.0.2", *args, "--out", str(out), "--dir", str(source)]
    )
    assert done.exit_code == 0, done.output
    return source, out


def names(directory) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def test_bundle_holds_its_services_credentials_and_no_signing_key(tmp_path):
    _, out = bundle(tmp_path, "--services", "rollout,reward")
    assert names(out) == {
        "ca.pem", "token.pub", "server.pem", "server.key",
        "tokens/rollout.jwt", "tokens/reward.jwt", "nats/rollout.password",
        "nats/reward.password",
    }  # fmt: skip
    assert is_bundle(out)
    for path in out.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_nats_node_bundle_carries_route_password_and_user_hashes_not_passwords(tmp_path):
    source, out = bundle(tmp_path, "--services", "rollout", "--nats-node")
    got = names(out)
    assert "nats/route.password" in got and "ca.key" not in got and "token.key" not in got
    assert {p for p in got if p.endswith(".password")} == {
        "nats/rollout.password",
        "nats/route.password",
    }
    for user in NATS_USERS:
        password = (source / "nats" / f"{user}.password").read_bytes().strip()
        assert bcrypt.checkpw(password, (out / "nats" / f"{user}.bcrypt").read_bytes())
    # the node's server configuration comes from the bundle alone: every user, the routes
    node = ClusterNode("nats-b", "10.0.0.2", 6222, ("10.0.0.1:6222", "10.0.0.3:6222"))
    config = json.loads(nats_config(4222, tmp_path / "js", out, "0.0.0.0", node))
    users = {u["user"]: u for u in config["authorization"]["users"]}
    assert set(users) == set(NATS_PERMISSIONS)
    route = (source / "nats" / "route.password").read_text().strip()
    assert config["cluster"]["routes"] == [
        f"nats-route://route:{route}@10.0.0.1:6222",
        f"nats-route://route:{route}@10.0.0.3:6222",
    ]
    assert config["cluster"]["tls"]["verify"] is True
    assert config["server_name"] == "nats-b" and config["client_advertise"] == "10.0.0.2:4222"


def test_a_bundle_without_nats_node_cannot_configure_a_server(tmp_path):
    _, out = bundle(tmp_path, "--services", "rollout")
    with pytest.raises(FileNotFoundError, match="'scheduler'"):
        nats_config(4222, tmp_path / "js", out)
