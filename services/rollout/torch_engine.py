"""The embedded engine: a HuggingFace causal LM in fp32 with continuous batching.

Concurrent `generate()` calls join one batch loop (a background task). Each step samples one
token for every active request, then feeds all new tokens through the model in one batched
forward. Forward passes run in a worker thread so the event loop stays responsive.

Behaviour logprobs: the logprob recorded for a token is the log-softmax of the *unscaled*
logits (temperature 1, no top-k/top-p truncation) at the sampled token. That is exactly what
the trainer recomputes for the same prefix under the same weights, so the decoupled PPO
importance weight pi_prox / pi_behav compares like with like. Temperature, top-k and top-p only
shape the sampling distribution.

Interruption: `update_weights` is applied by the loop between two steps (a token boundary).
The new weights are copied into the live model (a state-dict load, no re-instantiation), the
version is bumped, every in-flight request's KV cache is dropped, and the next step recomputes
prompt + partial output under the new weights. Per-token `versions` record the switch.
`last_update` times it: reading the files (generation goes on), the pause until the loop reaches
the boundary (the step in progress ends), the copy, and the resume (dropping the caches; their
recomputation is part of the next step).

Stop strings (`params.stop`) are matched on the decoded tail of the output after every token,
with the tokenizer's decode that the service passes in the request.

Determinism: each request samples from its own `torch.Generator`, seeded from the engine seed
and the request id, so a request's samples do not depend on what else is in the batch.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field

import torch

from asyncrl.logging import get_logger
from asyncrl.spec import SamplingParams
from asyncrl.weights import load_state_dict_files
from services.rollout.engine import Engine, GenOutput, GenRequest, UpdatePhases

log = get_logger(component="torch_engine")

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), [1, heads, len, dim]


@dataclass
class _Slot:
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
    cache: KV | None = None  # covers all tokens but the last one (not yet fed)

    @property
    def tokens(self) -> list[int]:
        return self.req.input_ids + self.output_ids


@dataclass
class _Op:
    """A model change the loop applies between two steps."""

    kind: str  # load | update
    model_dir: str
    version: int
    future: asyncio.Future
    state: dict[str, torch.Tensor] | None = None
    read_s: float = 0.0
    submitted: float = field(default_factory=time.perf_counter)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[int, float]:
    """Pick the next token from fp32 logits [vocab]; return (token, behaviour logprob).

    The logprob is taken from the unscaled logits (see the module docstring)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs[before >= params.top_p] = 0.0  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    token = int(torch.multinomial(probs, 1, generator=gen))
    return token, float(logprobs[token])


class TorchEngine(Engine):
    """Continuous-batching generation with a transformers causal LM (fp32, CPU by default).

    `kv_cache=False` recomputes the full forward of every sequence each step (right-padded,
    no cache): slower, but works for any architecture; the default keeps a per-request KV
    cache and runs one batched single-token forward per step."""

    name = "torch"

    def __init__(
        self, device: str = "cpu", seed: int = 0, kv_cache: bool = True, max_batch: int = 256
    ):
        self.device = torch.device(device)
        self.seed = seed
        self.kv_cache = kv_cache
        self.max_batch = max_batch
        self.model = None
        self.model_dir: str | None = None
        self.max_positions: int | None = None
        self._version = 0
        self._slots: dict[str, _Slot] = {}
        self._waiting: list[_Slot] = []
        self._ops: list[_Op] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.tokens_generated = 0
        self.steps = 0

    # ---------------------------------------------------------------- contract
    @property
    def version(self) -> int:
        return self._version

    @property
    def running(self) -> int:
        return len(self._slots) + len(self._waiting)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="torch-engine-loop")

    async def stop(self) -> None:
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
        await self._submit_op(_Op("load", str(model_dir), version, self._new_future()))

    async def update_weights(self, model_dir: str, version: int) -> int:
        """Swap in the weights of `model_dir` at the next token boundary; in-flight requests
        continue under `version`. Returns how many were interrupted."""
        if self.model is None:
            raise RuntimeError("update_weights before load")
        t0 = time.perf_counter()
        state = await asyncio.to_thread(load_state_dict_files, model_dir)
        read_s = time.perf_counter() - t0
        return await self._submit_op(
            _Op("update", str(model_dir), version, self._new_future(), state, read_s)
        )

    async def generate(self, req: GenRequest) -> GenOutput:
        if self.model is None:
            raise RuntimeError("no model loaded")
        if self._task is None:
            raise RuntimeError("engine not started")
        if not req.input_ids:
            raise ValueError("input_ids: empty prompt")
        if any(req.params.stop) and req.decode is None:
            raise ValueError("params.stop: stop strings need GenRequest.decode (a tokenizer)")
        if self.max_positions and len(req.input_ids) >= self.max_positions:
            raise ValueError(
                f"input_ids: prompt of {len(req.input_ids)} tokens does not fit the "
                f"model's {self.max_positions} positions"
            )
        seed = (self.seed * 1_000_003 + zlib.crc32(req.rid.encode())) % (2**63)
        slot = _Slot(
            req=req,
            future=self._new_future(),
            gen=torch.Generator().manual_seed(seed),
            stop_ids=frozenset(req.stop_token_ids) | frozenset(req.params.stop_token_ids),
            stop_strings=tuple(s for s in req.params.stop if s),
        )
        self._waiting.append(slot)
        self._wake.set()
        try:
            return await slot.future
        except asyncio.CancelledError:
            self._discard(slot)
            raise

    # ---------------------------------------------------------------- the loop
    def _new_future(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    async def _submit_op(self, op: _Op):
        if self._task is None:
            raise RuntimeError("engine not started")
        self._ops.append(op)
        self._wake.set()
        return await op.future

    def _discard(self, slot: _Slot) -> None:
        self._slots.pop(slot.req.rid, None)
        if slot in self._waiting:
            self._waiting.remove(slot)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            while self._ops:  # token boundary: apply model changes first
                await self._apply(self._ops.pop(0))
            while self._waiting and len(self._slots) < self.max_batch:
                slot = self._waiting.pop(0)
                self._slots[slot.req.rid] = slot
            if not self._slots:
                if not self._ops and not self._waiting:
                    self._wake.clear()
                continue
            batch = list(self._slots.values())
            version = self._version
            try:
                finished = await asyncio.to_thread(self._step, batch, version)
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests
                log.exception("step_failed", n=len(batch))
                for slot in batch:
                    self._discard(slot)
                    if not slot.future.done():
                        slot.future.set_exception(exc)
                continue
            self.steps += 1
            self.tokens_generated += len(batch)
            for slot, reason in finished:
                self._discard(slot)
                if not slot.future.done():
                    slot.future.set_result(
                        GenOutput(
                            output_ids=slot.output_ids,
                            logprobs=slot.logprobs,
                            versions=slot.versions,
                            finish_reason=reason,
                            interruptions=slot.interruptions,
                        )
                    )

    async def _apply(self, op: _Op) -> None:
        try:
            if op.kind == "load":
                for slot in [*self._slots.values(), *self._waiting]:
                    if not slot.future.done():
                        slot.future.set_exception(RuntimeError("model replaced by load()"))
                self._slots.clear()
                self._waiting.clear()
                await asyncio.to_thread(self._load_model, op.model_dir)
                result = 0
            else:
                paused = time.perf_counter()
                await asyncio.to_thread(self._swap_weights, op.state)
                loaded = time.perf_counter()
                result = len(self._slots)
                for slot in self._slots.values():
                    slot.cache = None  # recompute the prefix under the new weights
                    slot.interruptions += 1
                self.last_update = UpdatePhases(
                    read_s=op.read_s,
                    pause_s=paused - op.submitted,
                    load_s=loaded - paused,
                    resume_s=time.perf_counter() - loaded,
                )
            self._version = op.version
            self.model_dir = op.model_dir
            log.info("weights_applied", kind=op.kind, version=op.version, interrupted=result)
            op.future.set_result(result)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            op.future.set_exception(exc)

    # ---------------------------------------------------------------- model work (thread)
    def _load_model(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.to(self.device).eval()
        self.model = model
        self.max_positions = getattr(model.config, "max_position_embeddings", None)

    @torch.no_grad()
    def _swap_weights(self, state: dict[str, torch.Tensor]) -> None:
        model_keys = set(self.model.state_dict())
        unexpected = sorted(set(state) - model_keys)
        if unexpected:
            raise ValueError(f"weights do not match the model: unexpected {unexpected[:5]}")
        missing = model_keys - set(state)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if missing - tied:
            raise ValueError(f"weights do not match the model: missing {sorted(missing)[:5]}")
        self.model.load_state_dict(state, strict=False)  # in-place copies keep tied weights tied

    @torch.no_grad()
    def _step(self, batch: list[_Slot], version: int) -> list[tuple[_Slot, str]]:
        """One token for every slot. Returns the slots that finished, with the reason."""
        logits = self._next_logits(batch)
        finished = []
        for slot, row in zip(batch, logits, strict=True):
            token, logprob = sample_token(row.float(), slot.req.params, slot.gen)
            slot.output_ids.append(token)
            slot.logprobs.append(logprob)
            slot.versions.append(version)
            if token in slot.stop_ids or self._hits_stop_string(slot):
                finished.append((slot, "stop"))
            elif len(slot.output_ids) >= slot.req.params.max_new_tokens or (
                self.max_positions and len(slot.tokens) >= self.max_positions
            ):
                finished.append((slot, "length"))
        return finished

    @staticmethod
    def _hits_stop_string(slot: _Slot) -> bool:
        """Did the newest token complete one of the stop strings? Only a tail of the output is
        decoded (enough tokens to hold the longest string): an earlier match would already
        have ended the sample, so any match in the tail is new. Like SGLang, the tokens up to
        and including the one that completed the string stay in the output."""
        if not slot.stop_strings:
            return False
        window = max(len(s) for s in slot.stop_strings) + 2
        tail = slot.req.decode(slot.output_ids[-window:])
        return any(s in tail for s in slot.stop_strings)

    def _next_logits(self, batch: list[_Slot]) -> torch.Tensor:
        if not self.kv_cache:
            return self._full_forward(batch)
        rows: dict[int, torch.Tensor] = {}
        self._prefill_prefixes([s for s in batch if s.cache is None and len(s.tokens) > 1])
        decode = [i for i, s in enumerate(batch) if s.cache is not None]
        for i, slot in enumerate(batch):
            if slot.cache is None:
                rows[i] = self._prefill(slot)
        if decode:
            for i, row in zip(decode, self._decode([batch[i] for i in decode]), strict=True):
                rows[i] = row
        return torch.stack([rows[i] for i in range(len(batch))])

    def _prefill_prefixes(self, slots: list[_Slot]) -> None:
        """Cache all but the last token of new or interrupted requests in one batched forward
        (right-padded: under causal attention real tokens never see the padding); the last
        token then goes through the batched decode with everyone else."""
        if not slots:
            return
        lens = [len(s.tokens) - 1 for s in slots]
        ids = torch.zeros(len(slots), max(lens), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, (s, n) in enumerate(zip(slots, lens, strict=True)):
            ids[i, :n] = torch.tensor(s.tokens[:-1])
            mask[i, :n] = 1
        out = self.model(input_ids=ids, attention_mask=mask, use_cache=True)
        layers = out.past_key_values.layers
        for i, (s, n) in enumerate(zip(slots, lens, strict=True)):
            s.cache = [(lay.keys[i : i + 1, :, :n], lay.values[i : i + 1, :, :n]) for lay in layers]

    def _prefill(self, slot: _Slot) -> torch.Tensor:
        """Run prompt + partial output alone; keep the cache of all but the last token."""
        ids = torch.tensor([slot.tokens], device=self.device)
        if ids.shape[1] > 1:
            out = self.model(input_ids=ids[:, :-1], use_cache=True)
            slot.cache = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
            return self._decode([slot])[0]
        out = self.model(input_ids=ids, use_cache=True)
        slot.cache = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return out.logits[0, -1]

    def _decode(self, batch: list[_Slot]) -> torch.Tensor:
        """Feed each slot's last token through the model in one batch; caches left-padded."""
        from transformers import DynamicCache

        lens = [s.cache[0][0].shape[2] for s in batch]
        width = max(lens)
        layers = []
        for layer in range(len(batch[0].cache)):
            ks, vs = [], []
            for s, n in zip(batch, lens, strict=True):
                k, v = s.cache[layer]
                pad = (0, 0, width - n, 0)  # left-pad the sequence dim
                ks.append(torch.nn.functional.pad(k, pad))
                vs.append(torch.nn.functional.pad(v, pad))
            layers.append((torch.cat(ks), torch.cat(vs)))
        mask = torch.zeros(len(batch), width + 1, dtype=torch.long, device=self.device)
        for i, n in enumerate(lens):
            mask[i, width - n :] = 1
        out = self.model(
            input_ids=torch.tensor([[s.tokens[-1]] for s in batch], device=self.device),
            attention_mask=mask,
            position_ids=torch.tensor([[n] for n in lens], device=self.device),
            cache_position=torch.tensor([width], device=self.device),
            past_key_values=DynamicCache(ddp_cache_data=layers),
            use_cache=True,
        )
        new = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        for i, (s, n) in enumerate(zip(batch, lens, strict=True)):
            s.cache = [(k[i : i + 1, :, width - n :], v[i : i + 1, :, width - n :]) for k, v in new]
        return out.logits[:, -1]

    def _full_forward(self, batch: list[_Slot]) -> torch.Tensor:
        """No cache: right-pad every sequence and read the logits at its last position.
        Causal attention means real tokens never see the padding, so no mask is needed."""
        seqs = [s.tokens for s in batch]
        width = max(len(t) for t in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=self.device)
        for i, t in enumerate(seqs):
            ids[i, : len(t)] = torch.tensor(t)
        hidden = self.model.get_decoder()(input_ids=ids).last_hidden_state
        last = hidden[torch.arange(len(seqs)), torch.tensor([len(t) - 1 for t in seqs])]
        return self.model.get_output_embeddings()(last)
