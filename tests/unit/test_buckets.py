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
    assert p.sizes == (24, 32, 80)  # each rounded up to ALIGN
    assert p.nbytes == 6 + 12 + 32 + 80
    assert buckets.Plan.from_json(p.to_json()) == p


def test_packed_plan_is_back_to_back_and_starts_a_bucket_where_a_tensor_would_misalign():
    metas = [
        ("a", "bfloat16", (3,)),  # 6 bytes
        ("b", "bfloat16", (1,)),  # 2 bytes: at 6, aligned for its itemsize 2
        ("c", "int8", (3,)),  # 3 bytes: at 8
        ("d", "float32", (2,)),  # 8 bytes: at 11 it would misalign: a new bucket
        ("e", "float32", (4,)),  # 16 bytes: at 8 it would end at 24 > 16: a new bucket
    ]
    p = buckets.plan(metas, bucket_bytes=16, packed=True)
    got = [(s.name, s.bucket, s.offset) for s in p.slots]
    assert got == [("a", 0, 0), ("b", 0, 6), ("c", 0, 8), ("d", 1, 0), ("e", 2, 0)]
    assert p.sizes == (11, 8, 16)  # exactly the tensors' bytes: no padding
    assert buckets.Plan.from_json(p.to_json()) == p
    padded = buckets.plan(metas, bucket_bytes=16)
    assert "packed" not in padded.to_json()  # a padded plan's fingerprint is unchanged


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


def _words(*values: int) -> torch.Tensor:
    """A bucket buffer (uint8) holding these int32 words."""
    return torch.tensor(values, dtype=torch.int32).view(torch.uint8)


def test_a_delta_is_the_changed_words_indices_then_values():
    old = _words(10, 20, 30, 40, 50, 60)
    new = _words(10, 21, 30, 40, 50, -7)
    k, delta = buckets.encode_delta(new, old)
    assert k == 2
    assert delta.dtype == torch.int32 and delta.tolist() == [1, 5, 21, -7]
    assert buckets.delta_nbytes(k) == 16  # against 24 bytes whole
    base = old.clone()
    buckets.apply_delta(base, delta)
    assert base.tolist() == new.tolist()


def test_a_delta_no_smaller_than_the_bucket_is_none_and_an_unchanged_bucket_is_empty():
    old = _words(1, 2, 3, 4)
    k, delta = buckets.encode_delta(_words(9, 9, 3, 4), old)  # 2 of 4 words: 16 bytes, not < 16
    assert (k, delta) == (2, None)
    k, delta = buckets.encode_delta(_words(9, 2, 3, 4), old)
    assert k == 1 and delta.tolist() == [0, 9]
    k, delta = buckets.encode_delta(old.clone(), old)
    assert k == 0 and delta.numel() == 0
    same = old.clone()
    buckets.apply_delta(same, delta)
    assert same.tolist() == old.tolist()


def test_a_delta_compares_whole_words_of_any_dtype():
    old = torch.zeros(8, dtype=torch.bfloat16)
    new = old.clone()
    new[5] = 1.0  # bf16 0x3f80 in the high half of word 2 (little-endian)
    k, delta = buckets.encode_delta(new.view(torch.uint8), old.view(torch.uint8))
    assert k == 1 and delta.tolist() == [2, 0x3F80 << 16]
    got = old.clone()
    buckets.apply_delta(got.view(torch.uint8), delta)
    assert torch.equal(got, new)


def test_a_delta_onto_another_base_fails_the_checksum():
    state = {"w": torch.arange(8, dtype=torch.float32)}
    p = buckets.plan_of_state(state, 64)
    old = torch.zeros(p.sizes[0], dtype=torch.uint8)
    old[:32] = state["w"].view(torch.uint8)
    new = old.clone()
    new.view(torch.float32)[3] = 99.0
    want = buckets.checksum([memoryview(new[:32].numpy())])
    _, delta = buckets.encode_delta(new, old)
    right, wrong = old.clone(), old.clone()
    wrong.view(torch.float32)[6] = -1.0  # a base that differs where the delta does not reach
    for base in (right, wrong):
        buckets.apply_delta(base, delta)
    assert buckets.checksum([memoryview(right[:32].numpy())]) == want
    assert buckets.checksum([memoryview(wrong[:32].numpy())]) != want


def test_bucket_buffers_are_whole_words():
    p = buckets.plan([("a", "bfloat16", (3,)), ("b", "int8", (5,))], bucket_bytes=64)
    assert p.sizes == (16,)  # a: 6 bytes, b at 8: 5 bytes, ends at 13 -> 16
    assert all(n % buckets.WORD == 0 for n in p.sizes)


def test_a_dense_change_in_a_large_bucket_goes_whole_on_the_probe():
    n = buckets.PROBE_STRIDE * buckets.PROBE_MIN
    old = torch.zeros(n, dtype=torch.int32)
    new = old + 1  # every word
    k, delta = buckets.encode_delta(new.view(torch.uint8), old.view(torch.uint8))
    assert delta is None and k == n
    sparse = old.clone()
    sparse[1::100] = 7  # 1 % of the words, so about 1 % of the probe's
    k, delta = buckets.encode_delta(sparse.view(torch.uint8), old.view(torch.uint8))
    assert k == len(range(1, n, 100)) and delta is not None
