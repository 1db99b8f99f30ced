"""An experiment record keeps its tenant across a scheduler restart (the KV record), and a
record saved before tenants existed reads back as the operator's."""

from __future__ import annotations

import json

from services.scheduler.convert import experiment_to_proto
from services.scheduler.core import new_experiment_id
from services.scheduler.records import ExperimentRecord


def test_tenant_survives_the_persisted_record_and_reaches_the_proto():
    record = ExperimentRecord(id="acme.math-1a2b3c", name="math", spec={}, tenant="acme")
    back = ExperimentRecord.from_json(record.to_json())
    assert back.tenant == "acme"
    assert experiment_to_proto(back).tenant == "acme"


def test_record_saved_before_tenants_is_the_operators():
    data = json.loads(ExperimentRecord(id="math-1a2b3c", name="math", spec={}).to_json())
    del data["tenant"]
    back = ExperimentRecord.from_json(json.dumps(data).encode())
    assert back.tenant == ""
    assert experiment_to_proto(back).tenant == ""


def test_a_tenants_experiment_id_starts_with_its_tenant_as_a_subject_token():
    own = new_experiment_id("Math RL #1", "acme")
    tenant, _, rest = own.partition(".")
    assert tenant == "acme" and rest.startswith("math-rl-1-") and len(rest) == len("math-rl-1-") + 6
    operator = new_experiment_id("Math RL #1")
    assert "." not in operator and "-" in operator  # never a tenant's name (no '-' allowed)
