"""The embedded engine: a HuggingFace causal LM with continuous batching.

Device and dtype (`asyncrl.devices`): `device="auto"` (default) is CUDA when the process sees a
GPU, else the CPU; `dtype="auto"` is the model's own (config.json `torch_dtype`, e.g. bf16) on
a GPU and fp32 on the CPU. Logprobs are always taken in fp32 from the logits.

Concurrent `generate()` calls join one batch loop (a background task). Each step samples one
token for every active request, then feeds all new tokens through the model in one batched
forward. Steps run in a worker thread so the event loop stays responsive, several per hop
while no request arrives, leaves or finishes and no model change is due.

Behaviour logprobs: the logprob recorded for a token is the log-softmax of the logits divided
by the sampling temperature (1 for greedy), before any top-k/top-p truncation, at the sampled
token: SGLang's default. That is exactly what the trainer recomputes for the same prefix under
the same weights (`trainer` divides by `rollout.gconfig.temperature`), so the decoupled PPO
importance weight pi_prox / pi_behav compares like with like and the policy trained is the one
sampled. Top-k and top-p only shape the sampling distribution.

Interruption: `update_weights` is applied by the loop between two steps (a token boundary).
The new weights are copied into the live model (a state-dict load, no re-instantiation), the
version is bumped, every in-flight request's KV cache is dropped, and the next step recomputes
prompt + partial output under the new weights, in forwards of similar lengths
(`kv_pool.prefill_buckets`) rather than one batch padded to the longest. Per-token `versions`
record the switch. With `keep_kv_on_update` the caches are kept instead (PipelineRL's in-flight
update): the rest of the output is sampled by the new weights on top of the old weights' KV, no
prefix is recomputed, and the recorded logprobs stay those of the distribution actually sampled
from (what the importance weight needs); it trades that mix for the re-prefill after every
update (bench `system`'s replay: ~33 ms at 38 streams, against an 8 ms update; its async runs
moved within their noise either way).
`last_update` times it: reading the files (generation goes on), the pause until the loop reaches
the boundary (the step in progress ends), the copy, and the resume (dropping the caches; their
recomputation is part of the next step).

LoRA versions (`trainer.lora`) go into an `adapters.AdapterBank` on the base: the newest
`adapter_keep` (eta + 1) stay loaded, each request samples under its own `Slot.version`'s
adapter, one batch mixing them. `adapter_update="interrupt"` (default) moves every in-flight
request to the new adapter as a full update does; `"finish"` lets each finish under its
version unless that adapter is unloaded (then it is interrupted, resumed under the newest).
Several LoRA experiments on the base share the engine in *lanes* (`update_weights(...,
lane=experiment)`, `GenRequest.lane`): each lane has its own version, fingerprint and
`keep` adapters, and a lane's update moves only that lane's requests; the others' go on.

Stop strings (`params.stop`) are matched on the decoded tail of the output after every token,
with the tokenizer's decode that the service passes in the request.

Cost: every request's KV cache lives in one preallocated pool (`kv_pool.KVPool`), written in
place; a decode step attends each stream to its own positions (rows bucketed by context
length), so nothing is re-padded or copied per step and a long straggler costs its own context,
not every stream's. The pool holds rows x the longest context, as the padded batch it replaced
did. `counters` (and `stats()`, also logged with every weight update) accumulate the steps' and
prefills' time and work, for fitting the loop's cost from a real run.

Determinism: each request samples from its own `torch.Generator`, seeded from the engine seed
and the request id, so a request's samples do not depend on what else is in the batch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import DynamicCache

from asyncrl import devices, fingerprint
from asyncrl.logging import get_logger, keep_running
from asyncrl.spec import SamplingParams
from asyncrl.types import Completion
from asyncrl.weights import load_state_dict_files
from services.rollout.adapters import AdapterBank, is_adapter_dir, read_adapter
from services.rollout.engine import Engine, GenRequest, UpdatePhases
from services.rollout.kv_pool import ATTENTION, KVPool, prefill_buckets
from services.rollout.torch_slots import EngineCounters, Op, Slot

log = get_logger(component="torch_engine")
LOOP_RETRY_S = 0.1
"""Pause before the loop's next pass after one that raised (`keep_running`)."""

PREFILL_TOKENS = 8192
"""Padded tokens per prefill forward (a longer request is prefilled alone)."""
MAX_RUN = 64
"""Steps one hop to the worker thread may run while nothing changes."""
POOLED_LAYERS = {"full_attention", "sliding_attention"}
"""Layer types the KV pool serves; a model with others decodes without a cache."""


def _read_state(model_dir: str) -> tuple[dict[str, torch.Tensor], str]:
    """A version's tensors as read, and their fingerprint (before the pause: one hash pass, of
    the kind the version's manifest records)."""
    state = load_state_dict_files(model_dir)
    return state, fingerprint.of_state(state, like=fingerprint.read_manifest(Path(model_dir)))


def sample_tokens(
    logits: torch.Tensor, rows: list[tuple[SamplingParams, torch.Generator]]
) -> tuple[list[int], list[float]]:
    """Pick each row's next token from fp32 logits [rows, vocab]; return the tokens and their
    behaviour logprobs.

    Row i samples with its parameters `rows[i][0]` from one uniform draw of its own generator
    (inverse CDF over its probabilities), so a request's tokens depend on its seed and its
    logits only, never on the rows beside it; the softmaxes run once for the whole batch. The
    logprob is that of logits / temperature, before top-k/top-p (see the module docstring);
    greedy's is that of the unscaled logits."""
    params = [p for p, _ in rows]
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    for i, p in enumerate(params):
        if p.temperature and (0 < p.top_k < scaled.shape[-1] or p.top_p < 1.0):
            scaled[i] = truncated(scaled[i], p)
    cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
    if not bool(torch.isfinite(cdf[:, -1]).all()):  # what torch.multinomial refuses too
        raise ValueError("probability tensor contains either inf, nan or element < 0")
    u = torch.cat([torch.rand(1, generator=g, device=g.device) for _, g in rows]) * cdf[:, -1]
    # the first token whose cumulative probability passes u: never one of probability 0
    sampled = torch.searchsorted(cdf, u[:, None], right=True)[:, 0].clamp(max=cdf.shape[-1] - 1)
    greedy = torch.tensor([not p.temperature for p in params], device=logits.device)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens.tolist(), logprobs.gather(1, tokens[:, None])[:, 0].tolist()


def truncated(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's scaled logits with what top-k and top-p leave out set to -inf."""
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[order[before >= params.top_p]] = True  # keep the smallest prefix reaching top_p
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


@torch.no_grad()
def swap_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], adopt=False) -> None:
    """`state` into `model`'s parameters: copied in, or (`adopt`) a tensor of the parameter's
    dtype, device and shape taken as its storage (a broadcast's staging buffers, which the
    receiver does not write while they are the newest: no copy); any other copied in."""
    model_keys = set(model.state_dict())
    unexpected = sorted(set(state) - model_keys)
    if unexpected:
        raise ValueError(f"weights do not match the model: unexpected {unexpected[:5]}")
    missing = model_keys - set(state)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if missing - tied:
        raise ValueError(f"weights do not match the model: missing {sorted(missing)[:5]}")
    if adopt:  # a tied pair is one Parameter: both names take the same storage
        params, state = dict(model.named_parameters(remove_duplicate=False)), dict(state)
        for name, t in list(state.items()):
            p = params.get(name)
            if p is not None and (p.dtype, p.device, p.shape) == (t.dtype, t.device, t.shape):
                p.data = state.pop(name)
    model.load_state_dict(state, strict=False)  # in-place copies keep tied weights tied


def hits_stop_string(slot: Slot) -> bool:
    """Did the newest token complete one of the stop strings? Only a tail of the output is
    decoded (enough tokens to hold the longest string): an earlier match would already
    have ended the sample, so any match in the tail is new. Like SGLang, the tokens up to
    and including the one that completed the string stay in the output."""
    if not slot.stop_strings:
        return False
    window = max(len(s) for s in slot.stop_strings) + 2
    tail = slot.req.decode(slot.output_ids[-window:])
    return any(s in tail for s in slot.stop_strings)


class TorchEngine(Engine):
    """Continuous-batching generation with a transformers causal LM (the model's dtype on a
    GPU when there is one, fp32 on the CPU: `device`, `dtype`).

    `kv_cache=False` recomputes the full forward of every sequence each step (right-padded,
    no cache): slower, but works for any architecture; the default keeps every request's KV
    cache in a preallocated pool (`kv_pool.KVPool`, written in place) and runs one batched
    single-token forward per step, each row attending to its own context only.
    `keep_kv_on_update=True` keeps in-flight requests' caches across a weight update (see the
    module docstring); the default recomputes them under the new weights."""

    name = "torch"
    shares_adapters = True

    def __init__(
        self,
        device: str = "auto",
        seed: int = 0,
        kv_cache: bool = True,
        max_batch: int = 256,
        keep_kv_on_update: bool = False,
        adapter_update: str = "interrupt",
        dtype: str = "auto",
    ):
        if adapter_update not in ("interrupt", "finish"):
            raise ValueError(f"adapter_update: {adapter_update!r} (interrupt or finish)")
        self.adapter_update, self.adapter_keep = adapter_update, 2  # LoRA versions kept loaded
        self.adapters: AdapterBank | None = None
        self.device = devices.pick_device(device)
        self.dtype_option = dtype
        self.device_name = devices.describe(self.device)
        devices.pick_dtype(dtype, self.device, "")  # an unknown name fails at start
        self.keep_kv_on_update, self.seed = keep_kv_on_update, seed
        self.kv_cache, self.max_batch = kv_cache, max_batch
        self.model = None
        self.model_dir: str | None = None
        self.model_dir_base = ""
        """Where the model was loaded from (`load`): what a lane on the base names."""
        self.max_positions: int | None = None
        self._version = 0
        self._lanes: dict[str, tuple[int, str]] = {}
        """Lane -> (version, fingerprint) it serves (LoRA experiments sharing the base)."""
        self._base_fp = ""
        """The fingerprint of the base as loaded (what a lane on the base serves)."""
        self._slots: dict[str, Slot] = {}
        self._waiting: list[Slot] = []
        self._ops: list[Op] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.tokens_generated = 0
        self.steps = 0
        self.counters = EngineCounters()
        self._pool: KVPool | None = None
        self._sliding_window: int | None = None
        self._pooled = kv_cache
        self._news = False  # set by the loop's thread, read between steps by the worker's

    # ---------------------------------------------------------------- contract
    @property
    def version(self) -> int:
        return self._version

    def version_of(self, lane: str) -> int:
        return self._lanes[lane][0] if lane in self._lanes else self._version

    def fingerprint_of(self, lane: str) -> str:
        return self._lanes[lane][1] if lane in self._lanes else self.fingerprint

    @property
    def running(self) -> int:
        return len(self._slots) + len(self._waiting)

    def stats(self) -> dict[str, float]:
        return {"steps": self.steps, "stream_steps": self.tokens_generated, **asdict(self.counters)}

    async def start(self) -> None:
        if self._task is None:
            # an error a pass did not handle is logged, and the next pass runs (never silent)
            loop = keep_running("torch_engine", self._pass, log, retry_s=LOOP_RETRY_S)
            self._task = asyncio.create_task(loop, name="torch-engine-loop")

    async def stop(self) -> None:
        self._news = True  # a run in the worker thread ends at its next token boundary
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for slot in [*self._slots.values(), *self._waiting]:
            if not slot.future.done():
                slot.future.set_exception(RuntimeError("engine stopped"))
        for op in self._ops:
            if not op.future.done():
                op.future.set_exception(RuntimeError("engine stopped"))
        self._slots.clear()
        self._waiting.clear()
        self._ops.clear()

    async def load(self, model_dir: str, version: int) -> None:
        """Load a model from scratch (first load or experiment switch) at a token boundary.
        Requests still in flight fail: the caller cancels them first."""
        await self._submit_op(Op("load", str(model_dir), version, self._new_future()))

    async def update_weights(
        self, model_dir: str, version: int, lane: str = "", keep: int | None = None
    ) -> int:
        """Swap in the weights of `model_dir` at the next token boundary; in-flight requests
        (of `lane`, when given) continue under `version`. In a lane, `model_dir` is an adapter
        (`keep` of the lane's stay loaded) or the base itself. Returns how many moved."""
        if self.model is None:
            raise RuntimeError("update_weights before load")
        t0 = time.perf_counter()
        if is_adapter_dir(model_dir):
            kind, state = "adapter", await asyncio.to_thread(read_adapter, model_dir)
            fp = state.fingerprint
        elif lane:
            if Path(model_dir).resolve() != Path(self.model_dir_base).resolve():
                raise ValueError(f"model_dir: {model_dir} is neither an adapter nor the base")
            kind, state, fp = "base", None, self._base_fp
        else:
            kind, (state, fp) = "update", await asyncio.to_thread(_read_state, model_dir)
        read_s = time.perf_counter() - t0
        op = Op(kind, str(model_dir), version, self._new_future(), state, read_s, fp, lane=lane)
        op.keep = keep
        return await self._submit_op(op)

    async def apply_state(self, model_dir: str, version: int, state: dict, fp: str, read_s: float):
        """`update_weights` with weights received elsewhere (a broadcast's staging buffers, of
        fingerprint `fp`); `model_dir`: where the version is stored. Returns how many moved."""
        op = Op("adopt", str(model_dir), version, self._new_future(), state, read_s, fp)
        return await self._submit_op(op)

    async def generate(self, req: GenRequest) -> Completion:
        [slot] = self._queue([req])
        try:
            return await slot.future
        except asyncio.CancelledError:
            self._discard(slot)
            raise

    async def generate_many(self, reqs: list[GenRequest]) -> list[Completion]:
        """A group's requests queued together: one call, no task per request."""
        slots = self._queue(reqs)
        try:
            return list(await asyncio.gather(*(slot.future for slot in slots)))
        except BaseException:  # cancelled, or one failed: the others are aborted
            for slot in slots:
                self._discard(slot)
            raise

    def _queue(self, reqs: list[GenRequest]) -> list[Slot]:
        """Check every request (ValueError: none is queued), then queue them all."""
        if self.model is None:
            raise RuntimeError("no model loaded")
        if self._task is None:
            raise RuntimeError("engine not started")
        slots = [
            Slot.create(req, self._new_future(), self.seed, self.device, self.max_positions)
            for req in reqs
        ]
        self._waiting.extend(slots)
        self._news = True
        self._wake.set()
        return slots

    # ---------------------------------------------------------------- the loop
    def _new_future(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    async def _submit_op(self, op: Op):
        if self._task is None:
            raise RuntimeError("engine not started")
        self._ops.append(op)
        self._news = True
        self._wake.set()
        return await op.future

    def _discard(self, slot: Slot) -> None:
        self._news = True
        self._slots.pop(slot.req.rid, None)
        if slot in self._waiting:
            self._waiting.remove(slot)

    async def _pass(self) -> None:
        """One pass of the engine's loop (`start`): model changes, admissions, a run of steps."""
        await self._wake.wait()
        while self._ops:  # token boundary: apply model changes first
            await self._apply(self._ops.pop(0))
        while self._waiting and len(self._slots) < self.max_batch:
            slot = self._waiting.pop(0)
            slot.version = self.version_of(slot.req.lane)
            self._slots[slot.req.rid] = slot
        if not self._slots:
            if not self._ops and not self._waiting:
                self._wake.clear()
            return
        batch = list(self._slots.values())
        self._news = False
        try:
            finished = await asyncio.to_thread(self._run, batch)
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests
            log.exception("step_failed", n=len(batch))
            for slot in batch:
                self._discard(slot)
                if not slot.future.done():
                    slot.future.set_exception(exc)
            return
        for slot, reason in finished:
            self._discard(slot)
            if not slot.future.done():
                slot.future.set_result(
                    Completion(
                        output_ids=slot.output_ids,
                        logprobs=slot.logprobs,
                        versions=slot.versions,
                        finish_reason=reason,
                        interruptions=slot.interruptions,
                    )
                )

    async def _apply(self, op: Op) -> None:
        try:
            if op.kind == "load":
                for slot in [*self._slots.values(), *self._waiting]:
                    if not slot.future.done():
                        slot.future.set_exception(RuntimeError("model replaced by load()"))
                self._slots.clear()
                self._waiting.clear()
                await asyncio.to_thread(self._load_model, op.model_dir)
                op.fingerprint = await asyncio.to_thread(fingerprint.of_dir, op.model_dir)
                self._base_fp, self.model_dir_base = op.fingerprint, op.model_dir
                self._lanes.clear()
                result = 0
            else:
                result = await self._update(op)
            if op.lane:
                self._lanes[op.lane] = (op.version, op.fingerprint)
            else:
                self._version = op.version
                self.model_dir = op.model_dir
                self.fingerprint = op.fingerprint  # what was applied just now
            log.info(  # with the loop's counters so far: a run's logs can fit its cost
                "weights_applied",
                kind=op.kind,
                version=op.version,
                interrupted=result,
                **{k: round(v, 4) for k, v in self.stats().items()},
            )
            op.future.set_result(result)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            op.future.set_exception(exc)

    async def _update(self, op: Op) -> int:
        """A full update (every in-flight request moves to `op.version`) or a LoRA one (into
        the bank; which requests move: the module docstring). Returns how many moved."""
        paused = time.perf_counter()
        lane = [s for s in self._slots.values() if s.req.lane == op.lane]  # no other lane moves
        every = self.adapter_update == "interrupt"
        if op.kind == "adapter":
            self.adapters.capacity = self.adapter_keep
            evicted = self.adapters.add(op.version, op.state, op.lane, op.keep)
            moving = [s for s in lane if every or s.version in evicted]
        elif op.kind == "base":  # the lane samples the base: nothing to load
            moving = lane if every else []
        else:
            await asyncio.to_thread(swap_weights, self.model, op.state, op.kind == "adopt")
            self.adapters.clear()  # adapters of another base
            self._lanes.clear()
            moving = list(self._slots.values())
        loaded = time.perf_counter()
        for slot in moving:
            if not self.keep_kv_on_update:
                slot.cached = 0  # recompute the prefix under the new weights
            slot.interruptions += 1
            slot.version = op.version
        self.last_update = UpdatePhases(
            read_s=op.read_s,
            pause_s=paused - op.submitted,
            load_s=loaded - paused,
            resume_s=time.perf_counter() - loaded,
        )
        return len(moving)

    def _rows(self, batch: list[Slot]):
        """The adapters of `batch`'s rows for the forwards inside (none without LoRA)."""
        return self.adapters.rows([self.adapters.slot(s.version, s.req.lane) for s in batch])

    # ---------------------------------------------------------------- model work (thread)
    def _load_model(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        dtype = devices.pick_dtype(self.dtype_option, self.device, model_dir)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=ATTENTION
        )
        model.to(self.device).eval()
        self.model = model
        self._pool = None
        self.adapters = AdapterBank(model, self.adapter_keep)
        config = model.config
        self.max_positions = getattr(config, "max_position_embeddings", None)
        types = set(getattr(config, "layer_types", None) or ["full_attention"])
        self._pooled = self.kv_cache and types <= POOLED_LAYERS
        if self.kv_cache and not self._pooled:
            log.warning("no_kv_cache", layer_types=sorted(types - POOLED_LAYERS))
        sliding = "sliding_attention" in types
        self._sliding_window = getattr(config, "sliding_window", None) if sliding else None

    def _run(self, batch: list[Slot]) -> list[tuple[Slot, str]]:
        """Steps of `batch` in the worker thread until one finishes a request, the loop has
        news (a request arrived or left, a model change is due) or `MAX_RUN` steps: one
        thread hop for many tokens when nothing changes. Returns the finished slots."""
        for _ in range(MAX_RUN):
            finished = self._step(batch)
            self.steps += 1
            self.tokens_generated += len(batch)
            if finished or self._news:
                return finished
        return []

    @torch.no_grad()
    def _step(self, batch: list[Slot]) -> list[tuple[Slot, str]]:
        """One token for every slot. Returns the slots that finished, with the reason."""
        t0 = time.perf_counter()
        drawn = sample_tokens(
            self._next_logits(batch).float(), [(s.req.params, s.gen) for s in batch]
        )
        finished = []
        for slot, token, logprob in zip(batch, *drawn, strict=True):
            slot.output_ids.append(token)
            slot.logprobs.append(logprob)
            slot.versions.append(slot.version)
            if token in slot.stop_ids or hits_stop_string(slot):
                finished.append((slot, "stop"))
            elif len(slot.output_ids) >= slot.req.params.max_new_tokens or (
                self.max_positions and slot.length >= self.max_positions
            ):
                finished.append((slot, "length"))
        self.counters.step_seconds += time.perf_counter() - t0
        return finished

    def _next_logits(self, batch: list[Slot]) -> torch.Tensor:
        if not self._pooled:
            return self._full_forward(batch)
        if self._pool is None:
            self._pool = KVPool(self.model.config, self.model.dtype, self.device)
        ordered = self._pool.assign(batch, max(s.length for s in batch))
        self._prefill([s for s in ordered if s.cached < s.length - 1])
        logits = self._decode(ordered)
        order = torch.tensor([s.row for s in batch], device=self.device)
        return logits[order]

    def _prefill(self, slots: list[Slot]) -> None:
        """Cache all but the last token of new or interrupted requests (the last one goes
        through the batched decode with everyone else): forwards of similar lengths, each
        right-padded (under causal attention real tokens never see the padding)."""
        if not slots:
            return
        t0 = time.perf_counter()
        lengths = [s.length - 1 for s in slots]
        for group in prefill_buckets(lengths, PREFILL_TOKENS):
            lens = [lengths[i] for i in group]
            ids = torch.zeros(len(group), max(lens), dtype=torch.long, device=self.device)
            for row, (i, n) in enumerate(zip(group, lens, strict=True)):
                ids[row, :n] = torch.tensor(slots[i].tokens[:n])
            # a plain cache keeps every position, sliding-window layers' too (masks window them)
            cache = DynamicCache()
            with self._rows([slots[i] for i in group]):
                self.model.get_decoder()(input_ids=ids, past_key_values=cache, use_cache=True)
            self._pool.store([slots[i].row for i in group], lens, cache.layers)
            for i, n in zip(group, lens, strict=True):
                slots[i].cached = n
            self.counters.prefill_forwards += 1
        self.counters.prefill_tokens += sum(lengths)
        self.counters.prefill_seconds += time.perf_counter() - t0

    def _decode(self, batch: list[Slot]) -> torch.Tensor:
        """Feed each slot's last token, batch in row order: keys written in place at the
        slot's own position, attention over its own positions (a per-row mask)."""
        cached = [s.cached for s in batch]
        with self._pool.decoding(cached) as positions, self._rows(batch):
            width = max(cached) + 1
            seen = torch.arange(width, device=self.device)[None, :] <= positions[:, None]
            out = self.model(
                input_ids=torch.tensor([[s.last] for s in batch], device=self.device),
                attention_mask=attention_masks(seen, positions, self._sliding_window),
                position_ids=positions[:, None],
                past_key_values=self._pool,
                use_cache=True,
            )
        for slot in batch:
            slot.cached += 1
        self.counters.context_tokens += sum(cached) + len(batch)
        return out.logits[:, -1]

    def _full_forward(self, batch: list[Slot]) -> torch.Tensor:
        with self._rows(batch):
            return full_forward(self.model, [s.tokens for s in batch], self.device)


def attention_masks(seen: torch.Tensor, positions: torch.Tensor, sliding_window: int | None):
    """The 4D boolean mask [a, 1, 1, width] (sdpa: True attends); a dict by layer type when the
    model has sliding-window layers, which see only the window's last tokens."""
    mask = seen[:, None, None, :]
    if sliding_window is None:
        return mask
    width = seen.shape[1]
    recent = torch.arange(width, device=seen.device)[None, :] > (
        positions[:, None] - sliding_window
    )
    return {"full_attention": mask, "sliding_attention": (seen & recent)[:, None, None, :]}


def full_forward(model, seqs: list[list[int]], device: torch.device) -> torch.Tensor:
    """No cache: right-pad every sequence and read the logits at its last position. Causal
    attention means real tokens never see the padding, so no mask is needed."""
    width = max(len(t) for t in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    for i, t in enumerate(seqs):
        ids[i, : len(t)] = torch.tensor(t)
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    last = hidden[torch.arange(len(seqs)), torch.tensor([len(t) - 1 for t in seqs])]
    return model.get_output_embeddings()(last)
