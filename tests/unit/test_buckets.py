"""`asyncrl.buckets`: the bucket plan's layout and the streamed fingerprint, against values
computed here by hand and by xxhash directly."""

from __future__ import annotations

import json

import pytest
import torch
import xxhash

from asyncrl import buckets, fingerprint


def test_plan_lays_tensors_out_in_name_order_aligned_and_split_at_the_bucket_size():
    metas = [
        ("b", "float32", (3,)),  # 12 bytes
        ("a", "bfloat16", (3,)),  # 6 bytes
        ("c", "float32", (4, 2)),  # 32 bytes
        ("d", "int64", (10,)),  # 80 bytes: larger than a bucket, a bucket of its own
    ]
    p = buckets.plan(metas, bucket_bytes=48)
    got = [(s.name, s.bucket, s.offset, s.nbytes) for s in p.slots]
    # a at 0 (6 bytes), b at 8 (aligned; ends at 20), c at 24 would end at 56 > 48: bucket 1
    assert got == [("a", 0, 0, 6), ("b", 0, 8, 12), ("c", 1, 0, 32), ("d", 2, 0, 80)]
    assert p.sizes == (20, 32, 80)
    assert p.nbytes == 6 + 12 + 32 + 80
    assert buckets.Plan.from_json(p.to_json()) == p


def test_plan_refuses_what_it_cannot_lay_out():
    with pytest.raises(ValueError, match="complex64"):
        buckets.plan([("x", "complex64", (2,))], 64)
    with pytest.raises(ValueError, match="at least 8"):
        buckets.plan([("x", "float32", (2,))], 4)


def test_fingerprint_of_state_is_xxh3_per_bucket_over_the_plan():
    state = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1.5, -2.0], dtype=torch.float32),
        "e": torch.ones(20, dtype=torch.float32),
    }
    fp = buckets.fingerprint_of_state(state, bucket_bytes=40)
    p = buckets.plan_of_state(state, 40)
    assert [s.name for s in p.slots] == ["b", "e", "w"]
    assert [s.bucket for s in p.slots] == [0, 1, 2]  # 8, 80 and 24 bytes
    raw = {k: v.numpy().tobytes() for k, v in state.items()}
    sums = [xxhash.xxh3_64_intdigest(raw[k]) for k in ("b", "e", "w")]
    h = xxhash.xxh3_128(p.to_json().encode())
    h.update(json.dumps(sums).encode())
    assert fp == f"xxh3/b40:{h.hexdigest()}"
    assert buckets.bucket_bytes_of(fp) == 40
    assert buckets.bucket_bytes_of("sha256:00") is None


def test_one_flipped_bit_changes_the_fingerprint_and_only_its_bucket_checksum():
    state = {"a": torch.zeros(4), "b": torch.zeros(4)}
    p = buckets.plan_of_state(state, 16)
    before = [buckets.checksum([buckets.raw(state[s.name])]) for s in p.slots]
    state["b"].view(torch.int32)[2] ^= 1 << 7
    after = [buckets.checksum([buckets.raw(state[s.name])]) for s in p.slots]
    assert before[0] == after[0] and before[1] != after[1]
    assert buckets.fingerprint(p, before) != buckets.fingerprint(p, after)


def test_fingerprint_of_state_like_a_bucket_fingerprint_takes_its_kind():
    state = {"x": torch.randn(5)}
    fp = buckets.fingerprint_of_state(state, 64)
    assert fingerprint.of_state(state, like=fp) == fp
    assert fingerprint.of_state(state).startswith("sha256:")
