"""The torch engine's bookkeeping: one in-flight request (`Slot`), one model change the batch
loop applies between two steps (`Op`), and the loop's cumulative counters."""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field

import torch

from services.rollout.adapters import Adapter
from services.rollout.engine import GenRequest


@dataclass
class EngineCounters:
    """Cumulative work of the batch loop, for fitting its cost: a step samples one token for
    each of its active streams (`tokens_generated` sums them over steps)."""

    step_seconds: float = 0.0
    """Time in steps, prefills included."""
    context_tokens: int = 0
    """Sum over decode steps of the active streams' own context lengths (attended tokens)."""
    prefill_seconds: float = 0.0
    """Prefilling new requests' prompts and re-prefilling interrupted requests."""
    prefill_tokens: int = 0
    """Tokens (re)computed by prefills."""
    prefill_forwards: int = 0
    """Prefill forwards (one per length bucket)."""


@dataclass(eq=False)
class Slot:
    """One in-flight request."""

    req: GenRequest
    future: asyncio.Future
    gen: torch.Generator
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    interruptions: int = 0
    version: int = 0  # the version (a LoRA one: its adapter) that samples its next token
    row: int = -1  # in the KV pool
    cached: int = 0  # tokens in the pool: all but the last one once up to date, 0 to recompute

    @classmethod
    def create(
        cls,
        req: GenRequest,
        future: asyncio.Future,
        seed: int,
        device: torch.device,
        max_positions: int | None,
    ) -> Slot:
        """A checked request's slot, sampling from its own generator (seeded from the engine
        `seed` and the request id); ValueError naming what is wrong."""
        if not req.input_ids:
            raise ValueError("input_ids: empty prompt")
        if any(req.params.stop) and req.decode is None:
            raise ValueError("params.stop: stop strings need GenRequest.decode (a tokenizer)")
        if max_positions and len(req.input_ids) >= max_positions:
            raise ValueError(
                f"input_ids: prompt of {len(req.input_ids)} tokens does not fit the "
                f"model's {max_positions} positions"
            )
        seed = (seed * 1_000_003 + zlib.crc32(req.rid.encode())) % (2**63)
        return cls(
            req=req,
            future=future,
            gen=torch.Generator(device=device).manual_seed(seed),  # on the logits' device
            stop_ids=frozenset(req.stop_token_ids) | frozenset(req.params.stop_token_ids),
            stop_strings=tuple(s for s in req.params.stop if s),
        )

    @property
    def tokens(self) -> list[int]:
        return self.req.input_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.req.input_ids) + len(self.output_ids)

    @property
    def last(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.req.input_ids[-1]


@dataclass
class Op:
    """A model change the loop applies between two steps."""

    kind: str  # load | update | adopt (an update taking its tensors) | adapter | base (a lane)
    model_dir: str
    version: int
    future: asyncio.Future
    state: dict[str, torch.Tensor] | Adapter | None = None
    read_s: float = 0.0
    fingerprint: str = ""
    """Of `state` (an update) as read; a load computes it over the files it loads."""
    submitted: float = field(default_factory=time.perf_counter)
    lane: str = ""
    """The adapter lane it changes ("" the engine's own version)."""
    keep: int | None = None
    """Adapter versions the lane keeps loaded (None: `adapter_keep`)."""
