"""Which device and dtype a torch engine or trainer runs in, and how a worker names its device.

`device="auto"` (the default of both) is CUDA when this process sees a GPU (the supervisor's
placement sets CUDA_VISIBLE_DEVICES: asyncrl.supervisor.gpus), else the CPU. `dtype="auto"` is
the model's own dtype (config.json `torch_dtype`, e.g. bfloat16) on a GPU and float32 on the
CPU, where bf16 matmuls are slow and the CPU runs compare logprobs to fp32 precision.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def pick_device(name: str = "auto") -> torch.device:
    """`auto`: cuda when a GPU is visible, else cpu; anything else as torch spells it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_dtype(model_dir: str | Path) -> torch.dtype:
    """The floating dtype a HuggingFace model directory declares (config.json `torch_dtype`,
    or `dtype` in newer transformers); float32 when it names none or another."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    return config_dtype(config)


def config_dtype(config: dict) -> torch.dtype:
    """The floating dtype a model's config.json (as a dict) declares; float32 when none."""
    name = config.get("torch_dtype") or config.get("dtype")
    return DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def pick_dtype(name: str, device: torch.device, model_dir: str | Path) -> torch.dtype:
    """`auto`: the model's dtype on a GPU, float32 on the CPU; else one of `DTYPES`."""
    if name == "auto":
        return model_dtype(model_dir) if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} (auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def describe(device: torch.device) -> str:
    """What `asyncrl workers` shows: 'cpu', or 'cuda:0 = GPU 4 (NVIDIA H100 80GB HBM3)' (the
    host's id of that GPU, from CUDA_VISIBLE_DEVICES when it is set)."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else 0
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    host = visible[index] if index < len(visible) else str(index)
    try:
        name = torch.cuda.get_device_name(index)
    except (RuntimeError, AssertionError):
        name = "?"
    return f"cuda:{index} = GPU {host} ({name})"
