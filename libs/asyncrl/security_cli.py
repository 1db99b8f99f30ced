"""`asyncrl secrets`: make the secrets directory, hand a host its credentials, mint a token.

    asyncrl secrets init                          # what `make up` does: var/secrets, once
    asyncrl secrets bundle 10.0.0.7 --services rollout,reward --out host-b/
    asyncrl secrets token alice --role viewer --out alice.jwt
    asyncrl secrets token bob --role admin --tenant acme --out bob.jwt

A bundle is a secrets directory for another machine: the CA certificate, the token verification
key, a certificate for that host, a token and the NATS password of each service it runs. It
holds neither the CA key nor the token signing key, so that host can serve and call but can
neither issue certificates nor mint tokens. Copy it there (e.g. `scp -r`) and point the
services at it with `ASYNCRL_SECRETS=host-b/`. Nothing here prints a secret.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import bcrypt
import typer
from rich.console import Console

from asyncrl.security import (
    LOOPBACK,
    NATS_ROUTE_USER,
    NATS_USERS,
    ROLES,
    check_tenant,
    ensure_secrets,
    ensure_tenant,
    issue_cert,
    mint_token,
    secrets_dir,
    tenant_nats_user,
    tenants,
    write_private,
)

app = typer.Typer(help="Credentials: the local CA, certificates, tokens, NATS users.")
out = Console(highlight=False)

DirOpt = Annotated[
    Path | None, typer.Option("--dir", help="Secrets directory (default ASYNCRL_SECRETS).")
]


def _source(directory: Path | None) -> Path:
    directory = Path(directory or secrets_dir())
    if not (directory / "ca.key").exists():
        out.print(f"[red]no CA in {directory}[/red]: run `asyncrl secrets init` (or `make up`)")
        raise typer.Exit(2)
    return directory


@app.command()
def init(
    directory: DirOpt = None,
    host: Annotated[
        list[str] | None, typer.Option(help="Extra name/IP for this host's certificate.")
    ] = None,
) -> None:
    """Create the secrets directory (kept as it is where it exists)."""
    made = ensure_secrets(directory, host or ())
    out.print(f"secrets in {made} (files 0600); tokens: {', '.join(ROLES)}")


@app.command()
def bundle(
    host: Annotated[list[str], typer.Argument(help="The host's names/IPs (certificate SAN).")],
    services: Annotated[
        str, typer.Option(help="Comma-separated services it runs (their tokens, NATS users).")
    ],
    out_dir: Annotated[Path, typer.Option("--out", help="Directory to write.")],
    directory: DirOpt = None,
    nats_node: Annotated[
        bool,
        typer.Option(
            "--nats-node", help="It also runs a NATS cluster node: route password, user hashes."
        ),
    ] = False,
) -> None:
    """Write a secrets directory for another host: CA certificate, verification key, its own
    certificate, and a token + NATS password per service (identity `<service>@<host>`). A NATS
    node (`--nats-node`) also gets the cluster's route password and every NATS user's bcrypt
    hash (what its server checks logins against), never the other users' passwords."""
    source = _source(directory)
    wanted = [s.strip() for s in services.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(ROLES))
    if unknown:
        raise typer.BadParameter(f"unknown services {unknown}; choose from {list(ROLES)}")
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in ("ca.pem", "token.pub"):
        write_private(out_dir / name, (source / name).read_bytes())
    issue_cert(source, [*host, *LOOPBACK], out=out_dir)
    for service in wanted:
        token = mint_token(source, f"{service}@{host[0]}", service)
        write_private(out_dir / "tokens" / f"{service}.jwt", token.encode())
        if service in NATS_USERS:
            password = (source / "nats" / f"{service}.password").read_bytes()
            write_private(out_dir / "nats" / f"{service}.password", password)
    if nats_node:
        write_private(
            out_dir / "nats" / f"{NATS_ROUTE_USER}.password",
            (source / "nats" / f"{NATS_ROUTE_USER}.password").read_bytes(),
        )
        for user in (*NATS_USERS, *(tenant_nats_user(t) for t in tenants(source))):
            password = (source / "nats" / f"{user}.password").read_bytes().strip()
            hashed = bcrypt.hashpw(password, bcrypt.gensalt(10, prefix=b"2a"))
            write_private(out_dir / "nats" / f"{user}.bcrypt", hashed)
        wanted.append("a NATS node")
    out.print(f"wrote {out_dir} for {', '.join(host)}: {', '.join(wanted)}")


@app.command()
def token(
    name: Annotated[str, typer.Argument(help="The identity (token subject).")],
    role: Annotated[str, typer.Option(help=f"One of {', '.join(ROLES)}.")],
    out_file: Annotated[Path, typer.Option("--out", help="File to write (0600).")],
    directory: DirOpt = None,
    tenant: Annotated[
        str,
        typer.Option(
            help="The tenant it acts for (admin, viewer): it sees only that tenant's "
            "experiments. Without one the token is the operator's and sees all."
        ),
    ] = "",
) -> None:
    """Mint a token for `name` with `role` into a file (hand it over as ASYNCRL_TOKEN_FILE).
    With `--tenant` also make the tenant's NATS user (password in nats/tenant-<T>.password:
    hand it over as ASYNCRL_NATS_PASSWORD; restart nats-server for a new tenant)."""
    if role not in ROLES:
        raise typer.BadParameter(f"role: {role!r} is not one of {', '.join(ROLES)}")
    try:
        check_tenant(tenant, role)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    source = _source(directory)
    write_private(out_file, mint_token(source, name, role, tenant).encode())
    if not tenant:
        out.print(f"wrote a {role} token for {name} (operator: no tenant) to {out_file}")
        return
    password = ensure_tenant(source, tenant)
    out.print(
        f"wrote a {role} token for {name} of tenant {tenant} to {out_file}; its NATS user "
        f"{tenant_nats_user(tenant)} has its password in {password} (restart nats-server, "
        "e.g. `make up`, if the tenant is new)"
    )
