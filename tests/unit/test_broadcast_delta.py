"""When a `broadcast` version travels as its delta (services/trainer/broadcast.py `use_delta`)
and what it moves (`sent_bytes`), with exact values."""

from __future__ import annotations

import torch

from asyncrl import buckets
from services.trainer.broadcast import Snapshot, sent_bytes, use_delta

BASE = "xxh3/b64:base"


def test_a_delta_goes_only_when_every_rollout_holds_its_base_in_the_same_group():
    assert use_delta([BASE, BASE], BASE, fresh=False, in_row=0, full_every=8)
    assert not use_delta([BASE, ""], BASE, fresh=False, in_row=0, full_every=8)  # one lost it
    assert not use_delta([BASE, "xxh3/b64:other"], BASE, fresh=False, in_row=0, full_every=8)
    assert not use_delta([BASE, BASE], BASE, fresh=True, in_row=0, full_every=8)  # a join
    assert not use_delta(["", ""], "", fresh=False, in_row=0, full_every=8)  # nothing encoded


def test_a_full_version_every_k():
    sent = []
    in_row = 0
    for _ in range(10):
        delta = use_delta([BASE], BASE, fresh=False, in_row=in_row, full_every=4)
        in_row = in_row + 1 if delta else 0
        sent.append("d" if delta else "F")
    assert "".join(sent) == "dddFdddFdd"
    assert not use_delta([BASE], BASE, fresh=False, in_row=0, full_every=1)  # never a delta


def test_sent_bytes_counts_whole_buckets_and_deltas():
    p = buckets.plan([("a", "float32", (16,)), ("b", "float32", (16,))], bucket_bytes=64)
    assert p.sizes == (64, 64)
    snap = Snapshot(p, [torch.zeros(64, dtype=torch.uint8)] * 2, b"{}")
    snap.deltas = [None, torch.zeros(6, dtype=torch.int32)]
    snap.changed = [12, 3]
    assert sent_bytes(snap, delta=False) == 128
    assert sent_bytes(snap, delta=True) == 64 + 24  # bucket 0 whole, bucket 1: 3 x (4 + 4)
