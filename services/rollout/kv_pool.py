"""The torch engine's KV cache: one preallocated buffer per layer for every request in flight.

Row r of a layer's buffer, `[rows, kv_heads, positions, head_dim]`, holds one request's keys
(values alike) at that request's own positions 0..n-1: nothing is padded, re-padded or
concatenated per step. The requests of the batch occupy rows 0..a-1 (a request that leaves
frees its row; the last row moves into the hole, a copy of that request's own tokens), so a
decode step writes each new key in place at (row, its position) and hands the model the view
`[:a, :, :width]` of the buffer with a per-row mask (a row sees its own positions only), width
the batch's longest context. The attention (`ATTENTION`, sdpa underneath) groups the rows by
context length (`width_buckets`): every row attends over the narrowest group's width on that
view, and each wider group's rows again over their own width (gathered), so a long straggler
costs its own context, not every stream's.

Buffers grow by doubling (rows up to the batch, positions up to the model's maximum) and are
kept between steps. The pool is a transformers `Cache`: the model calls `update` with each
layer's new keys and values.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
from transformers import AttentionInterface, Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

POSITION_QUANTUM = 64
"""Buffers grow their positions in multiples of this."""
BUCKET_OVERHEAD = 4096
"""A decode bucket's fixed cost in (row, key position) pairs of attention: a new bucket is
opened where it saves more than that many pairs of padding."""
ATTENTION = "asyncrl_kv_pool"
"""The attention implementation to load a model with: sdpa, with bucketed decode steps."""

_plan: ContextVar[tuple[int, list[tuple[torch.Tensor, int]]] | None] = ContextVar(
    "kv_pool_plan", default=None
)
"""During a pool decode step: (the base width every row attends over, the wider buckets)."""


class Cached(Protocol):
    """What the pool knows of a request: its row and how many of its tokens are cached."""

    row: int
    cached: int


def prefill_buckets(lengths: list[int], budget: int, spread: float = 0.75) -> list[list[int]]:
    """Indices of `lengths` grouped for batched, right-padded prefill forwards: longest first,
    a group keeps lengths at least `spread` x its longest (padding stays under 1 - spread of
    each row) and at most `budget` padded tokens (a longer sequence goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            top = lengths[group[0]]
            if lengths[i] >= spread * top and (len(group) + 1) * top <= budget:
                group.append(i)
                continue
        groups.append([i])
    return groups


def width_buckets(widths: list[int], overhead: int = BUCKET_OVERHEAD) -> list[list[int]]:
    """Row indices grouped for attention, widest first; a bucket attends over its widest
    row's width. Going down the widths, a new bucket opens where the padding it saves (at most
    the width difference times the rows left) exceeds `overhead`."""
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    buckets = [[order[0]]]
    for left, i in enumerate(order[1:], start=1):
        top = widths[buckets[-1][0]]
        if (top - widths[i]) * (len(order) - left) > overhead:
            buckets.append([i])
        else:
            buckets[-1].append(i)
    return buckets


def pool_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa. In a pool decode step, every row first attends over the narrowest bucket's width
    (a view of the buffers: right for every row of that bucket, which a row's mask keeps to its
    own positions), then the rows of each wider bucket again over their bucket's width (their
    keys gathered: a copy of those rows only)."""
    plan = _plan.get()
    if plan is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    base, wide = plan
    out, _ = sdpa_attention_forward(
        module, query, key[:, :, :base], value[:, :, :base], attention_mask[..., :base], **kwargs
    )
    for rows, width in wide:
        part, _ = sdpa_attention_forward(
            module,
            query[rows],
            key[rows, :, :width],
            value[rows, :, :width],
            attention_mask[rows, :, :, :width],
            **kwargs,
        )
        out[rows] = part
    return out, None


AttentionInterface.register(ATTENTION, pool_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def _grown(size: int, need: int, limit: int | None, quantum: int = 1) -> int:
    """A new capacity for `need`: at least double the old one, rounded up to `quantum`, capped
    at `limit` (never below `need`)."""
    new = max(need, 2 * size)
    new = -(-new // quantum) * quantum
    return max(need, min(new, limit)) if limit else new


class KVPool(Cache):
    """Every in-flight request's keys and values, one row each (see the module docstring)."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device):
        super().__init__(layers=[])
        self.n_layers = config.num_hidden_layers
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.owners: list[Cached] = []
        """Row i holds owners[i]'s cache."""
        self._write: tuple[torch.Tensor, torch.Tensor, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, positions) allocated."""
        return (self.keys[0].shape[0], self.keys[0].shape[2]) if self.keys else (0, 0)

    # ------------------------------------------------------------------ rows
    def assign(self, batch: list[Cached], positions: int) -> list[Cached]:
        """Rows 0..len(batch)-1 for exactly the requests of `batch`, each able to hold
        `positions` tokens. Requests no longer in the batch free their rows; a newcomer gets a
        row with nothing cached. Returns the batch in row order."""
        live = {id(s) for s in batch}
        kept = sum(id(s) in live for s in self.owners)
        owners = self.owners[:kept]
        holes = [r for r, s in enumerate(owners) if id(s) not in live]
        movers = [s for s in self.owners[kept:] if id(s) in live]
        for hole, slot in zip(holes, movers, strict=True):
            self._move(slot, hole)
            owners[hole] = slot
        for slot in batch:
            if slot.row < 0 or slot.row >= kept or owners[slot.row] is not slot:
                slot.row, slot.cached = len(owners), 0
                owners.append(slot)
        self.owners = owners
        self._reserve(len(owners), positions)
        return list(owners)

    def _move(self, slot: Cached, row: int) -> None:
        n = slot.cached
        if n:
            for buf in (*self.keys, *self.values):
                buf[row, :, :n] = buf[slot.row, :, :n]
        slot.row = row

    def _reserve(self, rows: int, positions: int) -> None:
        have_rows, have_pos = self.shape
        if rows <= have_rows and positions <= have_pos:
            return
        new_rows = have_rows if rows <= have_rows else _grown(have_rows, rows, None)
        new_pos = (
            have_pos
            if positions <= have_pos
            else _grown(have_pos, positions, self.max_positions, POSITION_QUANTUM)
        )
        shape = (new_rows, self.kv_heads, new_pos, self.head_dim)
        for bufs in (self.keys, self.values):
            old = list(bufs) or [None] * self.n_layers
            bufs.clear()
            for was in old:
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if was is not None:
                    new[: was.shape[0], :, : was.shape[2]] = was
                bufs.append(new)

    # ------------------------------------------------------------------ writes
    def store(self, rows: list[int], lengths: list[int], layers) -> None:
        """Copy a prefill's keys and values (per layer `.keys`/`.values`, [b, heads, len,
        dim], right-padded) into `rows` at positions 0..len-1 (the padding's garbage lands
        past each row's length, where no mask ever looks before it is overwritten)."""
        index = torch.tensor(rows, device=self.device)
        width = max(lengths)
        for i, layer in enumerate(layers):
            self.keys[i][index, :, :width] = layer.keys[:, :, :width]
            self.values[i][index, :, :width] = layer.values[:, :, :width]

    @contextmanager
    def decoding(self, positions: list[int]) -> Iterator[torch.Tensor]:
        """Within: forwards feed one token for each of rows 0..a-1, at `positions`, and attend
        by width buckets. Yields the positions as a tensor."""
        at = torch.tensor(positions, device=self.device)
        rows = torch.arange(len(positions), device=self.device)
        self._write = (rows, at, max(positions) + 1)
        widths = [p + 1 for p in positions]
        *wide, narrowest = width_buckets(widths, BUCKET_OVERHEAD)
        plan = (
            widths[narrowest[0]],
            [(torch.tensor(b, device=self.device), widths[b[0]]) for b in wide],
        )
        token = _plan.set(plan)
        try:
            yield at
        finally:
            _plan.reset(token)
            self._write = None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write this layer's new keys/values [a, heads, 1, dim] at each row's position and
        return the batch's view of the buffers, [a, heads, width, dim]."""
        rows, positions, width = self._write
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[rows, :, positions] = key_states[:, :, 0]
        values[rows, :, positions] = value_states[:, :, 0]
        a = rows.shape[0]
        return keys[:a, :, :width], values[:a, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly

    @property
    def is_compileable(self) -> bool:
        return False
