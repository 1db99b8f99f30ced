"""`trainer.weight_sync` in the spec and the broadcaster the trainer builds from it (no group is
joined here; the broadcast itself: tests/integration/test_trainer_weight_sync.py)."""

from __future__ import annotations

import pytest

from asyncrl.errors import SpecError
from asyncrl.spec import spec_from_json, spec_to_json, validate_spec
from asyncrl.spec_rules import chosen_weight_sync
from services.trainer.weight_sync import GROUP_NAME, WeightBroadcaster, collective_backend

MINIMAL = {"model": {"path": "m"}, "dataset": {"path": "d.jsonl"}}


def _trainer(**fields):
    return validate_spec(MINIMAL | {"trainer": fields}).trainer


def test_weight_sync_default_auto_builds_no_broadcaster():
    trainer = _trainer()
    assert (trainer.weight_sync, trainer.nccl_master, trainer.nccl_world_size) == (
        "auto",
        None,
        None,
    )
    assert WeightBroadcaster.from_spec(trainer) is None
    assert WeightBroadcaster.from_spec(_trainer(weight_sync="disk")) is None


TORCH_ENGINE = {"rollout": {"engine": "torch"}}
SGLANG = {"rollout": {"engine": "sglang"}}


@pytest.mark.parametrize(
    ("patch", "transport", "chosen"),
    [
        (TORCH_ENGINE, "file", "broadcast"),  # the default backend (megatron) streams
        (TORCH_ENGINE | {"trainer": {"backend": "torch"}}, "file", "broadcast"),
        (SGLANG, "file", "disk"),  # nccl needs the engines' group: only the user knows it
        (TORCH_ENGINE | {"trainer": {"backend": "torch", "lora": {}}}, "file", "disk"),
        (TORCH_ENGINE, "nats", "nats"),  # the deprecated deployment-wide alias: no shared disk
        (SGLANG, "nats", "nats"),
        (TORCH_ENGINE | {"trainer": {"weight_sync": "disk"}}, "file", "disk"),  # the user's
        (TORCH_ENGINE | {"trainer": {"weight_sync": "broadcast"}}, "nats", "broadcast"),
        (SGLANG | {"trainer": {"weight_sync": "nats"}}, "file", "nats"),
    ],
)
def test_auto_chooses_broadcast_where_it_streams_and_keeps_an_explicit_choice(
    patch, transport, chosen
):
    assert chosen_weight_sync(validate_spec(MINIMAL | patch), transport) == chosen


def test_auto_is_chosen_on_the_wire_by_the_deployments_setting(monkeypatch):
    wire = spec_to_json(validate_spec(MINIMAL | TORCH_ENGINE))
    assert spec_from_json(wire).trainer.weight_sync == "broadcast"
    monkeypatch.setenv("ASYNCRL_WEIGHTS_TRANSPORT", "nats")
    assert spec_from_json(wire).trainer.weight_sync == "nats"


def test_weight_sync_nccl_builds_rank_0_broadcaster_of_the_group():
    b = WeightBroadcaster.from_spec(
        _trainer(weight_sync="nccl", nccl_master="10.0.0.7:29500", nccl_world_size=3)
    )
    assert (b.master_address, b.master_port, b.world_size) == ("10.0.0.7", 29500, 3)
    assert b.group_name == GROUP_NAME == "asyncrl-weights"  # the SGLang engine's default
    assert b.backend == collective_backend()  # nccl with CUDA, gloo without
    assert b.group is None and b.tcp is None  # hosts and joins at first use, not before
    assert b.bucket_bytes == 64 << 20  # trainer.broadcast_bucket_mb sizes the buckets


@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        ({"weight_sync": "nccl"}, "trainer", "needs nccl_master and nccl_world_size"),
        (
            {"weight_sync": "nccl", "nccl_master": "h:1"},
            "trainer",
            "needs nccl_master and nccl_world_size",
        ),
        ({"nccl_master": "no-port"}, "trainer.nccl_master", "should match pattern"),
        ({"nccl_world_size": 1}, "trainer.nccl_world_size", "greater than 1"),
        ({"weight_sync": "shm"}, "trainer.weight_sync", "'disk', 'nats', 'nccl' or 'broadcast'"),
        ({"broadcast_bucket_mb": 0}, "trainer.broadcast_bucket_mb", "greater than 0"),
    ],
)
def test_weight_sync_invalid_fields_raise_spec_error_naming_them(fields, field, reason):
    with pytest.raises(SpecError) as exc:
        _trainer(**fields)
    assert exc.value.field == field
    assert reason in exc.value.reason


def test_weight_sync_broadcast_without_nccl_master_is_accepted_the_port_left_to_the_os():
    trainer = _trainer(weight_sync="broadcast")
    assert (trainer.weight_sync, trainer.nccl_master) == ("broadcast", None)
    assert _trainer(weight_sync="broadcast", nccl_master="h:1").nccl_master == "h:1"


def test_weight_sync_broadcast_is_for_the_torch_engine_and_full_models():
    fields = {"weight_sync": "broadcast"}
    assert _trainer(**fields).broadcast_bucket_mb == 64
    with pytest.raises(SpecError) as exc:
        validate_spec(MINIMAL | {"trainer": fields, "rollout": {"engine": "sglang"}})
    assert exc.value.field == "trainer.weight_sync" and "nccl for SGLang" in exc.value.reason
    with pytest.raises(SpecError) as exc:
        validate_spec(MINIMAL | {"trainer": fields | {"backend": "torch", "lora": {}}})
    assert exc.value.field == "trainer.lora" and "'broadcast'" in exc.value.reason
