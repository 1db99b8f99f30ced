"""Engine factory: `make_engine("torch" | "sglang", **opts)`, over the names in
`asyncrl.registry.ENGINES`. Engines are imported only when chosen, so a torch-only machine
never imports the SGLang adapter (and vice versa)."""

from __future__ import annotations

from asyncrl.registry import ENGINES
from services.rollout.engine import Engine


def make_engine(kind: str, **opts) -> Engine:
    """Build an engine of `kind` from flat options (`--engine-opt key=value`).
    torch: TorchEngine(device, seed, kv_cache, max_batch); sglang: the fields of SGLangConfig
    and of its LaunchConfig (`SGLangEngine.from_options`: ValueError names an unknown one)."""
    return ENGINES.load(kind)(**opts)
