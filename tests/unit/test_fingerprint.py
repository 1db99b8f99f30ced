"""The weights fingerprint (asyncrl.fingerprint): one value for the same tensors whether taken
from the files as written, the files as read or the tensors in memory; a changed byte, name,
dtype or shape changes it; samples carry it through the wire format; the trainer's triage
quarantines a sample whose fingerprint of a version is not the trainer's."""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors.torch import save

from asyncrl import fingerprint
from asyncrl.convert import group_from_bytes, group_to_bytes
from asyncrl.types import Sample, TrajectoryGroup
from asyncrl.v1 import trajectory_pb2
from services.trainer.publish import write_version
from services.trainer.validation import Admission, Verdict, fingerprint_tally, triage


def _by_hand(tensors: list[tuple[str, str, list[int], bytes]]) -> str:
    """The defining formula (the module docstring): per tensor in name order, the JSON of
    [name, dtype, shape, byte length], then the bytes, all into one sha256."""
    h = hashlib.sha256()
    for name, dtype, shape, data in sorted(tensors):
        h.update(json.dumps([name, dtype, shape, len(data)]).encode())
        h.update(data)
    return "sha256:" + h.hexdigest()


STATE = {
    "b.weight": torch.tensor([[1.0, -2.0], [0.5, 3.0]]),
    "a.bias": torch.tensor([7, 8, 9], dtype=torch.int64),
}
EXPECTED = _by_hand(
    [
        (
            "a.bias",
            "I64",
            [3],
            (7).to_bytes(8, "little") + (8).to_bytes(8, "little") + (9).to_bytes(8, "little"),
        ),
        (
            "b.weight",
            "F32",
            [2, 2],
            b"".join(struct.pack("<f", x) for x in (1.0, -2.0, 0.5, 3.0)),
        ),
    ]
)


def test_files_state_and_dir_agree_on_the_hand_computed_value(tmp_path):
    files = {"model.safetensors": save(STATE), "config.json": b"{}"}
    assert fingerprint.of_files(files) == EXPECTED
    assert fingerprint.of_state(STATE) == EXPECTED
    assert fingerprint.of_state(dict(reversed(STATE.items()))) == EXPECTED  # order: by name
    # sharded: the same tensors in two files
    shards = {
        "model-00001-of-00002.safetensors": save({"a.bias": STATE["a.bias"]}),
        "model-00002-of-00002.safetensors": save({"b.weight": STATE["b.weight"]}),
    }
    assert fingerprint.of_files(shards) == EXPECTED
    write_version(tmp_path / "w", "e", 1, files, tmp_path, keep=3)
    vdir = tmp_path / "w" / "e" / "v000001"
    assert fingerprint.of_dir(vdir) == EXPECTED
    assert fingerprint.read_manifest(vdir) == EXPECTED
    assert json.loads((vdir / "fingerprint.json").read_text()) == {
        "version": 1,
        "fingerprint": EXPECTED,
    }
    assert fingerprint.of_files({"config.json": b"{}"}) == ""  # no weights: unverified
    assert fingerprint.read_manifest(tmp_path) == ""  # a version from before fingerprints


def test_any_change_changes_it():
    w = STATE["b.weight"]
    changed = [
        {
            **STATE,
            "b.weight": w + torch.tensor([[0.0, 0.0], [0.0, 1e-6]]),
        },  # one value (an ulp of 3.0 is 2.4e-7)
        {"a.bias": STATE["a.bias"], "c.weight": w},  # a name
        {**STATE, "b.weight": w.to(torch.float64)},  # a dtype
        {**STATE, "b.weight": w.reshape(4)},  # a shape, same bytes
    ]
    for state in changed:
        assert fingerprint.of_state(state) != EXPECTED
    assert fingerprint.of_state({**STATE, "b.weight": w.to(torch.bfloat16)}) == _by_hand(
        [
            ("a.bias", "I64", [3], STATE["a.bias"].numpy().tobytes()),
            ("b.weight", "BF16", [2, 2], w.to(torch.bfloat16).view(torch.int16).numpy().tobytes()),
        ]
    )


def test_differs_only_when_both_known():
    assert fingerprint.differs("sha256:a", "sha256:b")
    assert not fingerprint.differs("sha256:a", "sha256:a")
    assert not fingerprint.differs("", "sha256:b")
    assert not fingerprint.differs("sha256:a", "")


def test_stamp_names_each_version_of_a_sample_once():
    known = {1: "sha256:one", 2: "sha256:two"}
    assert fingerprint.stamp([2, 1, 1, 3], known) == {1: "sha256:one", 2: "sha256:two", 3: ""}


def test_group_fingerprints_round_trip_and_old_messages_read_as_none():
    g = _group({2: "sha256:two"})
    wire = group_to_bytes(g)
    assert group_from_bytes(wire).fingerprints == {2: "sha256:two"}
    old = trajectory_pb2.TrajectoryGroup(experiment_id="e", group_id="g")
    assert group_from_bytes(old.SerializeToString()).fingerprints == {}


def _group(fingerprints: dict[int, str]) -> TrajectoryGroup:
    """Sample 0 generated at version 2, sample 1 at versions 1 and 2; one engine's stamp."""
    return TrajectoryGroup(
        experiment_id="e",
        group_id="g",
        prompt_id="p",
        prompt="q",
        answer="a",
        prompt_ids=[1],
        samples=[
            Sample(output_ids=[4], logprobs=[-1.0], versions=[2]),
            Sample(output_ids=[4, 5], logprobs=[-1.0, -1.0], versions=[1, 2]),
        ],
        start_version=1,
        fingerprints=fingerprints,
    )


def test_triage_quarantines_a_group_whose_weights_are_not_the_trainers():
    a = Admission(
        experiment_id="e",
        vocab_size=10,
        trainer_version=2,
        eta=2,
        fingerprints={1: "sha256:one", 2: "sha256:two"},
    )
    assert triage(_group({1: "sha256:one", 2: "sha256:two"}), a, set()) == (Verdict.TRAIN, "")
    assert triage(_group({1: "sha256:old", 2: "sha256:two"}), a, set()) == (
        Verdict.BAD,
        "weights fingerprint sha256:old for version 1 is not the trainer's sha256:one",
    )
    # unverified: no fingerprint from the rollout (an old one), or none recorded by the trainer
    assert triage(_group({}), a, set()) == (Verdict.TRAIN, "")
    assert triage(_group({1: "", 2: "sha256:two"}), a, set()) == (Verdict.TRAIN, "")
    unknown = Admission(experiment_id="e", vocab_size=10, trainer_version=2, eta=2)
    assert triage(_group({1: "sha256:old"}), unknown, set()) == (Verdict.TRAIN, "")


def test_fingerprint_tally_counts_samples_proven_for_every_version():
    known = {1: "sha256:one", 2: "sha256:two"}
    group = _group({1: "sha256:one", 2: "sha256:two"})  # both samples proven
    assert fingerprint_tally(group, known) == {"verified": 2, "unverified": 0}
    group = _group({2: "sha256:two"})  # version 1 (sample 1's first) carries none
    assert fingerprint_tally(group, known) == {"verified": 1, "unverified": 1}
    assert fingerprint_tally(_group({}), {}) == {"verified": 0, "unverified": 2}
