"""Engine factory: `make_engine("torch" | "sglang", **opts)`.

Backends are imported lazily, so a torch-only machine never imports the SGLang adapter (and
vice versa).
"""

from __future__ import annotations

from services.rollout.engine import Engine

ENGINES = ("torch", "sglang")


def make_engine(kind: str, **opts) -> Engine:
    """Build an engine of `kind` from flat options (`--engine-opt key=value`).
    torch: TorchEngine(device, seed, kv_cache, max_batch); sglang: the fields of SGLangConfig
    and of its LaunchConfig (`SGLangConfig.from_options`: ValueError names an unknown one)."""
    if kind == "torch":
        from services.rollout.torch_engine import TorchEngine

        return TorchEngine(**opts)
    if kind == "sglang":
        from services.rollout.sglang_config import SGLangConfig
        from services.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(SGLangConfig.from_options(**opts))
    raise ValueError(f"engine: unknown engine {kind!r} (expected one of {', '.join(ENGINES)})")
