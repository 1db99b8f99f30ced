"""What every fuzz case must hold, and the cases: for each RPC, a caller (one of the roles the
policy lets call it, a tenant's token where tenants may call it, now and then a role it does
not allow) and a request (a well-formed message with adversarial values, or bytes that are no
valid message).

Properties: never INTERNAL or UNKNOWN; INVALID_ARGUMENT names the field it refuses (its
message starts `<field>: `); every service still SERVING; the operator's and tenant bcorp's
experiments as they were."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re

import grpc
from google.protobuf.descriptor import MethodDescriptor
from hypothesis import strategies as st

import asyncrl.v1
from asyncrl.rpc_policy import POLICY, ROLES, TENANT_METHODS
from asyncrl.spec import ExperimentSpec
from tests.fuzz.cluster import BOUND, FuzzCluster, Outcome, path_of
from tests.fuzz.values import messages, raw_bytes, spec_jsons

CODE = grpc.StatusCode
NEVER = (CODE.INTERNAL, CODE.UNKNOWN, CODE.DATA_LOSS, CODE.UNIMPLEMENTED)
REBINDS = {
    "/asyncrl.v1.Rollout/BindExperiment",
    "/asyncrl.v1.Rollout/UpdateWeights",
    "/asyncrl.v1.Reward/BindExperiment",
}
"""Calls that change what the rollout or reward service serves: BOUND is restored after each."""
FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\[\d+\])?[.:\[ ]")


def methods() -> list[MethodDescriptor]:
    """Every RPC of every asyncrl service, from the compiled protos."""
    out = []
    for info in pkgutil.iter_modules(asyncrl.v1.__path__):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"asyncrl.v1.{info.name}")
            for service in module.DESCRIPTOR.services_by_name.values():
                out.extend(service.methods)
    return out


def callers(method: MethodDescriptor) -> tuple[list[str], list[str]]:
    """(identities the policy lets call `method`, identities it does not)."""
    path = path_of(method)
    allowed = sorted(POLICY[path])
    if path in TENANT_METHODS:
        allowed += [f"acme-{r}" for r in ("admin", "viewer") if r in POLICY[path]]
    return allowed, sorted(set(ROLES) - POLICY[path])


def cases(cluster: FuzzCluster, method: MethodDescriptor) -> st.SearchStrategy[tuple[str, bytes]]:
    """(identity, request bytes) for `method`."""
    allowed, refused = callers(method)
    identity = st.sampled_from(allowed)
    if refused:  # one case in five from a caller the policy refuses
        pick = st.tuples(st.integers(0, 4), identity, st.sampled_from(refused))
        identity = pick.map(lambda t: t[2] if t[0] == 4 else t[1])

    def request(who: str) -> st.SearchStrategy[bytes]:
        ids = cluster.ids()
        if who == "admin":  # the operator's admin may act on anything: not on the victims
            ids = (cluster.experiments["acme"], BOUND)
        valid = messages(method.input_type, ids, overrides=_overrides(cluster, method, ids))
        wellformed = valid.map(lambda m: m.SerializeToString())
        return st.tuples(st.just(who), st.one_of(wellformed, wellformed, raw_bytes(valid)))

    return identity.flatmap(request)


def _overrides(cluster: FuzzCluster, method: MethodDescriptor, ids) -> dict:
    """Fields that mostly carry what a real caller sends, so that the other fields' values
    reach the code behind the checks of these: a rollout's or reward service's own experiment,
    a group id, the reward service's address, a spec with one bad field."""
    out = {"spec_json": spec_jsons(cluster.spec)}
    if method.containing_service.name in ("Rollout", "Reward"):
        generic = st.sampled_from(ids)
        out["experiment_id"] = st.one_of(st.just(BOUND), st.just(BOUND), generic)
        out["group_id"] = st.one_of(st.uuids().map(str), st.sampled_from(["", "g", "x" * 5000]))
        out["reward_addresses"] = st.one_of(
            st.just([cluster.addresses["Reward"]]),
            st.just([cluster.addresses["Reward"]]),
            st.lists(st.sampled_from(["", "127.0.0.1:1", "x" * 3000, "[::"]), max_size=3),
        )
    return out


def names_a_field(method: MethodDescriptor, details: str, data: bytes) -> bool:
    """Whether an INVALID_ARGUMENT's message starts with a field of the request (or of the
    spec it carries, or a key of that spec that is none), or with `request` (bytes that are no
    message)."""
    known = set(method.input_type.fields_by_name) | set(ExperimentSpec.model_fields) | {"request"}
    match = FIELD.match(details)
    if match is not None and match.group(1) in known:
        return True
    keys = [k for k in details.partition(": ")[0].split(".") if k]
    spec = "spec_json" in method.input_type.fields_by_name
    return spec and any(k.encode() in data or json.dumps(k)[1:-1].encode() in data for k in keys)


def check(
    cluster: FuzzCluster, method: MethodDescriptor, identity: str, data: bytes, before: dict
) -> tuple[Outcome, list[str]]:
    """Make the call; the properties it broke (none: [])."""
    outcome = cluster.call_sync(method, identity, data)
    problems = []
    if outcome.code in NEVER:
        problems.append(f"{outcome.code.name}: {outcome.details[:300]}")
    if outcome.code == CODE.INVALID_ARGUMENT and not names_a_field(method, outcome.details, data):
        problems.append(f"INVALID_ARGUMENT names no field: {outcome.details[:300]}")
    if outcome.code == CODE.OK and path_of(method) in REBINDS:
        cluster.rebind()
    health = cluster.health()
    if set(health.values()) != {"SERVING"}:
        problems.append(f"a service stopped serving: {health}")
    after = cluster.victims()
    if after != before:
        problems.append(f"another tenant's experiment changed: {before} -> {after}")
    return outcome, problems
