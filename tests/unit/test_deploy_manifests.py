"""The Kubernetes deployment in deploy/, checked offline: every manifest against the Kubernetes
JSON schema of a pinned version (kubernetes-validate, strict: an unknown field fails), then what
a schema cannot see: references that resolve, probes and secrets on every asyncrl container, the
scheduler's ports, Prometheus annotations, no secret material in the files, and the NATS chart's
values (cluster of three, JetStream, TLS, asyncrl's users)."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import bcrypt
import kubernetes_validate
import pytest
import yaml

from asyncrl.nats_tenants import tenant_permissions
from asyncrl.natsutil import NATS_PERMISSIONS, nats_server_binary
from asyncrl.security import NATS_USERS, TENANT_NATS_PREFIX, secrets_dir

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
NATS_VALUES = DEPLOY / "nats-values.yaml"
CHART_DEFAULTS = DEPLOY / "nats-chart" / "values-2.14.2.yaml"
K8S_VERSIONS = ("1.30", "1.37")
"""The oldest Kubernetes the manifests must apply to, and the newest kubernetes-validate 1.37.0
bundles (an API removed or added in between fails one of them)."""
NAMESPACE = "asyncrl"
WORKLOADS = ("Deployment", "StatefulSet")
SERVICES = ("scheduler", "rollout", "reward", "trainer")
WORKERS = ("rollout", "reward", "trainer")


MANIFESTS = sorted(K8S.glob("*.yaml"))


def parse(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def load_documents() -> list[tuple[str, dict]]:
    """Every document of every manifest that parses (one that does not fails
    test_manifest_parses_as_yaml, not the collection of this whole module)."""
    docs = []
    for path in MANIFESTS:
        try:
            docs += [(f"{path.name}#{i}", doc) for i, doc in enumerate(parse(path))]
        except yaml.YAMLError:
            pass
    return docs


DOCS = load_documents()


def of_kind(*kinds: str) -> list[dict]:
    return [doc for _, doc in DOCS if doc["kind"] in kinds]


def one(kind: str, name: str) -> dict:
    (doc,) = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    return doc


def component(workload: dict) -> str:
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def workload_of(service: str) -> dict:
    (doc,) = [d for d in of_kind(*WORKLOADS) if component(d) == service]
    return doc


def container_of(service: str) -> dict:
    (container,) = workload_of(service)["spec"]["template"]["spec"]["containers"]
    return container


def argv(container: dict) -> list[str]:
    """The service's own command line: after the `sh -c '...; exec "$@"'` wrapper, its args."""
    command = container["command"]
    return container["args"] if command[0] == "sh" else command


def flag(container: dict, name: str) -> str:
    args = argv(container)
    return args[args.index(name) + 1]


def port_named(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def health_target(probe: dict) -> str:
    """The address an exec probe's `check_health('host:port')` checks."""
    command = probe["exec"]["command"]
    assert command[:2] == ["python", "-c"], command
    (address,) = re.findall(r"check_health\('([^']+)'\)", command[2])
    return address


# ---- the schema -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_parses_as_yaml(path):
    try:
        docs = parse(path)
    except yaml.YAMLError as e:
        pytest.fail(f"{path.name}: {e}")
    assert docs and all(isinstance(doc, dict) and "kind" in doc for doc in docs), path.name


def test_manifests_directory_holds_every_service():
    assert sorted(component(d) for d in of_kind(*WORKLOADS)) == sorted(SERVICES)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name,doc", DOCS, ids=[name for name, _ in DOCS])
def test_manifest_validates_against_kubernetes_schema_strict(name, doc, version):
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        pytest.fail(f"{name} ({doc['kind']}, Kubernetes {version}): {path}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{name}: {e.message}")


@pytest.mark.parametrize(
    "path,value",
    [
        (("spec", "replica"), 1),  # a misspelt field: strict mode knows no such key
        (("spec", "template", "spec", "containers", 0, "ports", 0, "containerPort"), "grpc"),
        (("spec", "template", "spec", "containers", 0, "readinessProbe", "exec"), ["python"]),
    ],
)
def test_manifest_validation_broken_document_fails(path, value):
    doc = copy.deepcopy(one("Deployment", "asyncrl-scheduler"))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


QUANTITY = re.compile(r"^\d+(\.\d+)?([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
"""A Kubernetes resource quantity (`500Gi`, `0.5`, `100m`); the schema takes any string."""


def quantities(node, path: str = "") -> list[tuple[str, object]]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("requests", "limits") and isinstance(value, dict):
                found += [(f"{path}.{key}.{k}", v) for k, v in value.items()]
            elif key == "sizeLimit":
                found.append((f"{path}.{key}", value))
            else:
                found += quantities(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found += quantities(item, f"{path}[{i}]")
    return found


@pytest.mark.parametrize("name,doc", DOCS, ids=[name for name, _ in DOCS])
def test_manifest_quantities_are_kubernetes_quantities(name, doc):
    for path, value in quantities(doc):
        assert QUANTITY.match(str(value)), f"{name}{path}: {value!r} is not a quantity"


# ---- references a schema does not check --------------------------------------------------------


def test_manifests_namespaced_objects_live_in_the_asyncrl_namespace():
    assert [d["metadata"]["name"] for d in of_kind("Namespace")] == [NAMESPACE]
    for name, doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, name


def test_manifests_references_resolve():
    config_maps = {d["metadata"]["name"] for d in of_kind("ConfigMap")}
    claims = {d["metadata"]["name"] for d in of_kind("PersistentVolumeClaim")}
    services = {d["metadata"]["name"]: d for d in of_kind("Service")}
    for workload in of_kind(*WORKLOADS):
        name, spec = workload["metadata"]["name"], workload["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), name
        pod = spec["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        templates = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, name
        for container in pod["containers"]:
            for mount in container["volumeMounts"]:
                assert mount["name"] in volumes.keys() | templates, (name, mount["name"])
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps, name
        if workload["kind"] == "StatefulSet":
            assert spec["serviceName"] in services, name
    for name, service in services.items():
        selected = [
            w
            for w in of_kind(*WORKLOADS)
            if service["spec"]["selector"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, f"Service {name} selects {len(selected)} workloads"
        ports = {
            p["name"] for p in selected[0]["spec"]["template"]["spec"]["containers"][0]["ports"]
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (name, port)


# ---- the asyncrl containers --------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_container_probes_its_grpc_port_over_tls(service):
    """The kubelet's `grpc:` probe is plaintext only; the servers are TLS-only. Each probe runs
    asyncrl's check_health (TLS, no token) against the port the service binds."""
    container = container_of(service)
    port = int(flag(container, "--port"))
    assert flag(container, "--host") == "0.0.0.0"
    assert port_named(container, "grpc") == port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in container[kind], f"{service} {kind}: plaintext gRPC probe"
        assert health_target(container[kind]) == f"127.0.0.1:{port}", (service, kind)


@pytest.mark.parametrize("service", SERVICES)
def test_container_mounts_its_secrets_directory(service):
    """Each service mounts its own Secret laid out as a secrets directory (asyncrl.security):
    CA, its certificate, the token verification key, its token, its NATS password."""
    container = container_of(service)
    pod = workload_of(service)["spec"]["template"]["spec"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "secrets"]
    assert mount.get("readOnly") is True
    assert env_of(container)["ASYNCRL_SECRETS"]["value"] == mount["mountPath"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "secrets"]
    secret = volume["secret"]
    assert secret["secretName"] == f"asyncrl-{service}"
    assert secret["defaultMode"] == 0o400
    files = {item["path"] for item in secret["items"]}
    expected = {"ca.pem", "server.pem", "server.key", "token.pub", f"tokens/{service}.jwt"}
    if service in NATS_USERS:
        expected.add(f"nats/{service}.password")
    assert files == expected


@pytest.mark.parametrize("service", SERVICES)
def test_pod_carries_prometheus_https_annotations(service):
    template = workload_of(service)["spec"]["template"]
    container = container_of(service)
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/scheme"] == "https"
    assert annotations["prometheus.io/path"] == "/metrics"
    port = annotations["prometheus.io/port"]
    assert flag(container, "--metrics-port") == port
    assert port_named(container, "metrics") == int(port)
    config = one("ConfigMap", "asyncrl")["data"]
    assert config["ASYNCRL_METRICS_HOST"] == "0.0.0.0"  # default 127.0.0.1: unreachable


@pytest.mark.parametrize("service", SERVICES)
def test_pod_disables_service_links(service):
    """With service links on, the Service `asyncrl-scheduler` puts ASYNCRL_SCHEDULER_PORT=
    tcp://IP:50051 into every pod, which asyncrl.settings reads as `scheduler_port` and rejects."""
    assert workload_of(service)["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_scheduler_service_port_matches_its_port_flag():
    container = container_of("scheduler")
    workload = workload_of("scheduler")
    assert workload["spec"]["replicas"] == 1
    assert workload["spec"]["strategy"]["type"] == "Recreate"  # never two schedulers at once
    (port,) = one("Service", "asyncrl-scheduler")["spec"]["ports"]
    assert port["port"] == int(flag(container, "--port"))
    assert port_named(container, port["targetPort"]) == port["port"]
    address = one("ConfigMap", "asyncrl")["data"]["ASYNCRL_SCHEDULER"]
    assert address == f"asyncrl-scheduler:{port['port']}"


@pytest.mark.parametrize("service", WORKERS)
def test_worker_advertises_its_pod_dns_name(service, tmp_path):
    """Run the container's wrapper with the pod IP the downward API gives: the address the
    worker registers is the pod's DNS name, which `*.asyncrl.pod.cluster.local` certifies."""
    container = container_of(service)
    env = env_of(container)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    domain = one("ConfigMap", "asyncrl")["data"]["ASYNCRL_POD_DOMAIN"]
    assert domain == f"{NAMESPACE}.pod.cluster.local"
    out = subprocess.run(
        [*container["command"], "sh", "-c", 'echo "$ASYNCRL_ADVERTISE_HOST"'],
        env={"PATH": "/usr/bin:/bin", "POD_IP": "10.244.3.17", "ASYNCRL_POD_DOMAIN": domain},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "10-244-3-17.asyncrl.pod.cluster.local"


def test_workers_scale_and_the_trainer_runs_under_torchrun():
    for service in ("rollout", "reward"):
        assert workload_of(service)["kind"] == "Deployment"
    trainer = container_of("trainer")
    args = argv(trainer)
    assert args[0] == "torchrun"
    assert args[args.index("-m") + 1] == "services.trainer"
    nproc = int(flag(trainer, "--nproc_per_node"))
    for bound in ("requests", "limits"):
        assert trainer["resources"][bound]["nvidia.com/gpu"] == nproc
    assert container_of("rollout")["resources"]["requests"]["nvidia.com/gpu"] >= 1


# ---- no secret material in deploy/ ------------------------------------------------------------

SECRET_PATTERNS = {
    "PEM block": re.compile(r"-----BEGIN [A-Z ]+-----"),
    "JWT": re.compile(r"eyJ[\w-]{8,}\.[\w-]{8,}\."),
    "bcrypt hash": re.compile(r"\$2[aby]\$\d\d\$"),
}


def deploy_texts() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml"))


@pytest.mark.parametrize("path", deploy_texts(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_deploy_file_holds_no_secret_material(path):
    text = path.read_text()
    for what, pattern in SECRET_PATTERNS.items():
        assert not pattern.search(text), f"{path}: {what}"


def test_manifests_define_no_secret_and_no_literal_credential():
    """Credentials are Secrets made with kubectl from `asyncrl secrets bundle`, never a file in
    the repository; no env var carries a token or password as a literal value."""
    assert of_kind("Secret") == []
    for workload in of_kind(*WORKLOADS):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for name, entry in env_of(container).items():
                if re.search(r"TOKEN|PASSWORD|KEY", name) and not name.endswith("_FILE"):
                    assert "value" not in entry, f"{container['name']}: {name} set inline"
    for key in one("ConfigMap", "asyncrl")["data"]:
        assert not re.search(r"TOKEN$|PASSWORD", key), key


# ---- the NATS chart's values -------------------------------------------------------------------


def nats_values() -> dict:
    return yaml.safe_load(NATS_VALUES.read_text())


FREE_FORM = {"merge", "patch", "env", "topologySpreadConstraints"}
"""Values the chart passes on as they are (NATS config, JSON patches, Kubernetes objects)."""


def unknown_keys(values: dict, defaults: dict, prefix: str = "") -> list[str]:
    unknown = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if key not in defaults:
            unknown.append(path)
        elif key not in FREE_FORM and isinstance(value, dict):
            unknown += unknown_keys(value, defaults[key] or {}, f"{path}.")
    return unknown


def test_nats_values_keys_are_the_charts():
    """helm ignores a misspelt key: each must be one of the pinned chart's own values."""
    defaults = yaml.safe_load(CHART_DEFAULTS.read_text())
    assert unknown_keys(nats_values(), defaults) == []
    assert unknown_keys({"config": {"jetstream": {"enable": True}}}, defaults) == [
        "config.jetstream.enable"
    ]


def test_nats_values_cluster_of_three_with_jetstream_on_file():
    config = nats_values()["config"]
    assert config["cluster"]["enabled"] is True
    assert config["cluster"]["replicas"] == 3
    assert config["cluster"]["noAdvertise"] is True  # pod IPs are in no certificate
    jetstream = config["jetstream"]
    assert jetstream["enabled"] is True
    assert jetstream["fileStore"]["enabled"] is True
    assert jetstream["fileStore"]["pvc"]["enabled"] is True
    assert jetstream["memoryStore"]["enabled"] is False


def test_nats_values_tls_on_clients_and_routes_from_a_secret():
    values = nats_values()
    for block in (values["config"]["nats"]["tls"], values["config"]["cluster"]["tls"]):
        assert block["enabled"] is True
        assert (block["secretName"], block["cert"], block["key"]) == (
            "nats-tls",
            "server.pem",
            "server.key",
        )
    assert values["tlsCA"] == {"enabled": True, "secretName": "nats-tls", "key": "ca.pem"}
    assert values["config"]["nats"]["port"] == 4222
    assert one("ConfigMap", "asyncrl")["data"]["NATS_URL"] == "nats://nats:4222"


def test_nats_values_include_the_users_from_the_auth_secret():
    """The include names a file relative to /etc/nats-config/nats.conf; the patches mount the
    Secret `nats-auth` at that file's directory."""
    values = nats_values()
    include = values["config"]["merge"]["$include"]
    included = (Path("/etc/nats-config") / include).resolve()
    (mount,) = [p["value"] for p in values["container"]["patch"] if p["path"] == "/volumeMounts/-"]
    (volume,) = [
        p["value"] for p in values["podTemplate"]["patch"] if p["path"] == "/spec/volumes/-"
    ]
    assert mount["name"] == volume["name"]
    assert volume["secret"]["secretName"] == "nats-auth"
    assert included == Path(mount["mountPath"]) / "auth.conf"


def load_nats_auth():
    spec = importlib.util.spec_from_file_location("deploy_nats_auth", DEPLOY / "nats_auth.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nats_auth_holds_every_user_with_its_permissions_hashed():
    secrets = secrets_dir()  # made by tests/conftest.py, as `asyncrl secrets init` makes one
    text = load_nats_auth().auth_conf(secrets)
    assert text.startswith("authorization: ")
    users = {u["user"]: u for u in json.loads(text.removeprefix("authorization: "))["users"]}
    # the service users, and a user per tenant a test of the session minted a token for
    tenants = {n: n.removeprefix(TENANT_NATS_PREFIX) for n in users if n not in NATS_PERMISSIONS}
    assert users.keys() - tenants.keys() == NATS_PERMISSIONS.keys()
    assert all(n.startswith(TENANT_NATS_PREFIX) for n in tenants)
    for name, user in users.items():
        perms = tenant_permissions(tenants[name]) if name in tenants else NATS_PERMISSIONS[name]
        assert user["permissions"] == {
            verb: {"allow": subjects} for verb, subjects in perms.items()
        }
        password = (secrets / "nats" / f"{name}.password").read_bytes().strip()
        assert bcrypt.checkpw(password, user["password"].encode()), name
        assert password.decode() not in text


def test_nats_auth_is_accepted_by_nats_server_as_the_chart_includes_it(tmp_path):
    """nats-server -t on a config shaped like the chart's (include from a sibling directory,
    JetStream, a cluster) with the generated users: the file parses as NATS config."""
    (tmp_path / "nats-auth").mkdir()
    (tmp_path / "nats-auth" / "auth.conf").write_text(load_nats_auth().auth_conf(secrets_dir()))
    (tmp_path / "nats-config").mkdir()
    include = nats_values()["config"]["merge"]["$include"]
    conf = tmp_path / "nats-config" / "nats.conf"
    conf.write_text(
        "{\n"
        f"  include {include};\n"
        '  "port": 4222,\n'
        f'  "jetstream": {{"store_dir": "{tmp_path / "js"}"}},\n'
        f'  "max_payload": {nats_values()["config"]["merge"]["max_payload"]},\n'
        '  "cluster": {"name": "nats", "port": 6222, "no_advertise": true,\n'
        '              "routes": ["nats://nats-0.nats-headless:6222"]},\n'
        '  "server_name": "nats-0"\n'
        "}\n"
    )
    result = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr + result.stdout
    (tmp_path / "nats-auth" / "auth.conf").write_text("authorization: {users: [}\n")
    result = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True
    )
    assert result.returncode != 0, "a broken auth.conf passed nats-server -t"


def test_the_chart_takes_messages_as_large_as_make_up_does():
    """A large run's scheduler record is one KV value over nats-server's default 1 MiB: the
    chart raises the limit as `nats_config` does."""
    from asyncrl.natsutil import MAX_PAYLOAD, nats_config

    assert nats_values()["config"]["merge"]["max_payload"] == MAX_PAYLOAD
    assert json.loads(nats_config(4222, Path("/tmp/js"), None))["max_payload"] == MAX_PAYLOAD


def test_weights_reach_the_rollouts_through_nats_not_a_shared_volume():
    """Only the trainer mounts the weight store (ReadWriteOnce is enough); the ConfigMap sends
    versions through the NATS object store, which the rollouts fetch into their own disk."""
    config = one("ConfigMap", "asyncrl")["data"]
    assert config["ASYNCRL_WEIGHTS_TRANSPORT"] == "nats"
    claims = {c["metadata"]["name"]: c for c in of_kind("PersistentVolumeClaim")}
    assert claims["asyncrl-weights"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    for service in ("rollout", "reward", "scheduler"):
        pod = workload_of(service)["spec"]["template"]["spec"]
        names = {v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
        assert "asyncrl-weights" not in names, service
