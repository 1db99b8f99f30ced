"""LoRA adapters in the torch engine: several adapters on one base, applied per request.

A LoRA version (`trainer.lora`, services/trainer/lora.py) is a directory holding
`adapter_model.safetensors` (peft's names: `base_model.model.<module>.lora_A.weight` [r, in],
`.lora_B.weight` [out, r]) and `adapter_config.json` (peft's LoraConfig). `read_adapter` reads
one (and its fingerprint, over the tensors as read: the trainer's manifest is the same hash of
the same file). The `AdapterBank` holds up to `capacity` of them on the engine's base model and
adds, in every forward, each row's own low-rank delta to the output of each adapted linear:

    y[n] = base(x)[n] + scale_k * (x[n] @ A_k^T) @ B_k^T,   k = the adapter of row n

(LoRA, Hu et al. 2021, eq. 3: h = W0 x + (alpha / r) B A x; peft's `Linear.forward`). The base
runs once for the whole batch; the deltas are two batched matmuls over the adapters gathered by
row (`torch.bmm` of A[index] and B[index]), the way punica/S-LoRA batch many adapters. Slot 0 is
the base itself (A = B = 0: a zero delta, exactly), so requests of different adapters and of
none share a batch. Adapters of different ranks are zero-padded to the largest (a zero row of A
and column of B add nothing).

Adapters live in *lanes*: a lane is one experiment's versions ("" the engine's own, when one
experiment is served), and `capacity` (or a lane's own `keep`) bounds each lane apart, so
several LoRA experiments on one base keep eta + 1 versions each and one experiment's new
version never unloads another's (docs/lora.md, "Sharing a fleet").
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl import fingerprint

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}
"""adapter_config.json keys the bank does not implement, with the value it needs."""


def is_adapter_dir(path: str | Path) -> bool:
    """Whether a version directory holds a LoRA adapter (not a full model)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


@dataclass(frozen=True)
class Adapter:
    """One adapter as read: per adapted module (its path in the base model), A [r, in] and
    B [out, r]; `scale` alpha / r (alpha / sqrt(r) with rsLoRA)."""

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float
    rank: int
    fingerprint: str


def read_adapter(model_dir: str | Path) -> Adapter:
    """A LoRA version directory -> `Adapter`; ValueError for a config the bank cannot apply."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    config = json.loads((d / ADAPTER_CONFIG).read_text())
    for key, wanted in UNSUPPORTED.items():
        if config.get(key) and config[key] != wanted:
            raise ValueError(f"{ADAPTER_CONFIG}: {key}={config[key]!r} is not supported")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    state = load_file(str(d / ADAPTER_WEIGHTS))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in state:
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b_name = name.replace(".lora_A.weight", ".lora_B.weight")
        if b_name not in state:
            raise ValueError(f"{ADAPTER_WEIGHTS}: {name} has no {b_name}")
        weights[module] = (state[name].float(), state[b_name].float())
    if not weights or 2 * len(weights) != len(state):
        raise ValueError(f"{ADAPTER_WEIGHTS}: not a LoRA adapter ({len(state)} tensors)")
    return Adapter(weights, scale, rank, fingerprint.of_state(state))


class AdapterBank:
    """Up to `capacity` adapters per lane, keyed by (lane, version), on one base model;
    `rows(slots)` sets which adapter each row of the next forwards uses (slot 0: none)."""

    def __init__(self, model: torch.nn.Module, capacity: int):
        self.model = model
        self.capacity = capacity
        self.loaded: dict[tuple[str, int], Adapter] = {}  # (lane, version), oldest first
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks: list = []
        self._index: torch.Tensor | None = None
        self.device = next(model.parameters()).device

    # -- what is loaded ---------------------------------------------------------------------
    def add(
        self, version: int, adapter: Adapter, lane: str = "", keep: int | None = None
    ) -> list[int]:
        """Load `adapter` as `version` of `lane`; that lane's oldest beyond `keep` (default
        `capacity`) are unloaded, no other lane's. Returns the versions unloaded. ValueError
        when a module it adapts is not a linear of the base."""
        modules = dict(self.model.named_modules())
        for name, (a, b) in adapter.weights.items():
            layer = modules.get(name)
            if not isinstance(layer, torch.nn.Linear):
                raise ValueError(f"adapter module {name!r} is not a linear layer of the model")
            if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
                raise ValueError(f"adapter module {name!r}: shapes {a.shape}, {b.shape}")
        self.loaded.pop((lane, version), None)
        self.loaded[(lane, version)] = adapter
        own = [key for key in self.loaded if key[0] == lane]
        evicted = own[: max(0, len(own) - (keep or self.capacity))]
        for key in evicted:
            del self.loaded[key]
        self._restack(modules)
        return [v for _, v in evicted]

    def clear(self) -> None:
        self.loaded.clear()
        self._restack({})

    def slot(self, version: int, lane: str = "") -> int:
        """The slot of `lane`'s `version` in the stacks (1..), 0 when it is not loaded."""
        for i, key in enumerate(self.loaded, start=1):
            if key == (lane, version):
                return i
        return 0

    def _restack(self, modules: dict[str, torch.nn.Module]) -> None:
        """Stack every loaded adapter per module, slot 0 zero, ranks padded to the largest;
        scale folded into B. Hooks on exactly the modules some adapter adapts."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._stacks = [], {}
        names = sorted({m for a in self.loaded.values() for m in a.weights})
        rank = max((a.rank for a in self.loaded.values()), default=0)
        for name in names:
            layer = modules[name]
            n = len(self.loaded) + 1
            a_all = torch.zeros(n, rank, layer.in_features, device=self.device)
            b_all = torch.zeros(n, layer.out_features, rank, device=self.device)
            for i, adapter in enumerate(self.loaded.values(), start=1):
                if name in adapter.weights:
                    a, b = adapter.weights[name]
                    a_all[i, : a.shape[0]] = a.to(self.device)
                    b_all[i, :, : b.shape[1]] = b.to(self.device) * adapter.scale
            self._stacks[name] = (a_all, b_all)
            self._hooks.append(layer.register_forward_hook(self._hook(name)))

    # -- applying them ----------------------------------------------------------------------
    @contextlib.contextmanager
    def rows(self, slots: list[int]) -> Iterator[None]:
        """The forwards inside run row n under the adapter in slot `slots[n]` (0: the base).
        All zeros skips the deltas altogether."""
        if any(slots):
            self._index = torch.tensor(slots, device=self.device)
        try:
            yield
        finally:
            self._index = None

    def _hook(self, name: str):
        def add_delta(_module, inputs, output):
            if self._index is None:
                return output
            a_all, b_all = self._stacks[name]
            x = inputs[0]
            flat = x.dim() == 2  # [N, in] (a head on last positions)
            if flat:
                x = x[:, None]
            a, b = a_all[self._index], b_all[self._index]  # [N, r, in], [N, out, r]
            delta = torch.bmm(torch.bmm(x.to(a.dtype), a.transpose(1, 2)), b.transpose(1, 2))
            if flat:
                delta = delta[:, 0]
            return output + delta.to(output.dtype)

        return add_delta
