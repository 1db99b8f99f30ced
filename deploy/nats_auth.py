"""Write the `authorization` block of the Kubernetes NATS cluster (deploy/nats-values.yaml
includes it from the Secret `nats-auth`): one user per `asyncrl.natsutil.NATS_PERMISSIONS`
entry with exactly those permissions, its password read from `<secrets>/nats/<user>.password`
and stored as a bcrypt hash. It is the block `make up`'s own nats-server runs with.

    .venv/bin/python deploy/nats_auth.py var/secrets > auth.conf
    kubectl -n asyncrl create secret generic nats-auth --from-file=auth.conf
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncrl.natsutil import nats_config


def auth_conf(secrets: Path) -> str:
    """The `authorization` block for the NATS users, from the secrets directory `secrets` (the
    full one `asyncrl secrets init` made: it holds every user's password)."""
    config = json.loads(nats_config(4222, Path("/data"), secrets))
    return "authorization: " + json.dumps(config["authorization"], indent=2) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python deploy/nats_auth.py SECRETS_DIR > auth.conf")
    sys.stdout.write(auth_conf(Path(sys.argv[1])))
