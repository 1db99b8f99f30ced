"""The torch engine's KV pool: prefill and attention buckets, rows freed and compacted, buffers
grown in place."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from services.rollout.kv_pool import POSITION_QUANTUM, KVPool, prefill_buckets, width_buckets

CONFIG = SimpleNamespace(
    num_hidden_layers=2,
    num_key_value_heads=1,
    num_attention_heads=2,
    head_dim=2,
    hidden_size=4,
    max_position_embeddings=200,
)


@dataclass(eq=False)
class Req:
    name: str
    row: int = -1
    cached: int = 0


def _fill(pool: KVPool, req: Req, n: int) -> None:
    """Store n positions for req whose keys/values encode (name, position)."""
    code = float(ord(req.name))
    keys = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 1, n, 2) + 1000 * code
    layer = SimpleNamespace(keys=keys, values=-keys)
    pool.store([req.row], [n], [layer] * CONFIG.num_hidden_layers)
    req.cached = n


def _held(pool: KVPool, req: Req) -> torch.Tensor:
    return pool.keys[1][req.row, 0, : req.cached, 0]


def test_prefill_buckets_group_similar_lengths_within_budget():
    lengths = [100, 10, 90, 12, 80, 600, 11]
    groups = prefill_buckets(lengths, budget=400)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert groups[0] == [5]  # longer than the others, and alone over the budget
    assert groups[1] == [0, 2, 4]  # within 3/4 of 100
    assert groups[2] == [3, 6, 1]
    for g in groups[1:]:
        assert len(g) * max(lengths[i] for i in g) <= 400
    assert prefill_buckets([50] * 10, budget=200) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_width_buckets_split_only_where_the_padding_saved_exceeds_the_overhead():
    widths = [100] * 47 + [1000]
    assert width_buckets(widths, overhead=4096) == [[47], list(range(47))]
    assert width_buckets(widths, overhead=10**6) == [[47, *range(47)]]
    assert width_buckets([120, 100, 110], overhead=4096) == [[0, 2, 1]]


def test_assign_frees_rows_and_moves_the_last_ones_into_the_holes():
    pool = KVPool(CONFIG, torch.float32, torch.device("cpu"))
    reqs = [Req(c) for c in "abcde"]
    assert pool.assign(reqs, 10) == reqs and [r.row for r in reqs] == [0, 1, 2, 3, 4]
    for r, n in zip(reqs, [3, 5, 7, 2, 4], strict=True):
        _fill(pool, r, n)
    before = {r.name: _held(pool, r).clone() for r in reqs}
    a, b, c, d, e = reqs
    f = Req("f")
    ordered = pool.assign([c, e, d, f], 10)  # a and b left; e and d move into rows 0 and 1
    assert [r.row for r in ordered] == [0, 1, 2, 3] and set(ordered) == {c, d, e, f}
    assert c.row == 2 and {d.row, e.row} == {0, 1} and f.row == 3 and f.cached == 0
    for r in (c, d, e):
        assert torch.equal(_held(pool, r), before[r.name])


def test_assign_grows_buffers_keeping_what_they_hold():
    pool = KVPool(CONFIG, torch.float32, torch.device("cpu"))
    first = [Req("a"), Req("b")]
    pool.assign(first, 10)
    assert pool.shape == (2, POSITION_QUANTUM)
    for r in first:
        _fill(pool, r, 9)
    more = [*first, *(Req(c) for c in "cde")]
    pool.assign(more, 150)
    assert pool.shape == (5, 192)  # 2 x 64, then rounded up past 150
    pool.assign(more, 199)
    assert pool.shape == (5, 200)  # capped at the model's positions
    for r in first:
        assert torch.equal(_held(pool, r), torch.arange(9.0) + 1000 * ord(r.name))


def test_decode_writes_each_row_at_its_position_and_returns_the_batch_view():
    pool = KVPool(CONFIG, torch.float32, torch.device("cpu"))
    reqs = [Req("a"), Req("b")]
    pool.assign(reqs, 20)
    _fill(pool, reqs[0], 3)
    _fill(pool, reqs[1], 7)
    new = torch.full((2, 1, 1, 2), 5.0)
    with pool.decoding([3, 7]):
        keys, values = pool.update(new, -new, 0)
    assert keys.shape == (2, 1, 8, 2) and keys.data_ptr() == pool.keys[0].data_ptr()
    assert keys[0, 0, 3, 0] == 5.0 and keys[1, 0, 7, 0] == 5.0 and values[1, 0, 7, 0] == -5.0
    assert keys[0, 0, 2, 0] == 2.0 + 1000 * ord("a")  # the row's own positions untouched
