"""Device and dtype choice of the torch engine and trainer (asyncrl.devices): CUDA and the
model's own dtype on a GPU, fp32 on the CPU; how a worker names its device."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl import devices


def _model_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "config, dtype",
    [
        ({"torch_dtype": "bfloat16"}, torch.bfloat16),
        ({"dtype": "float16"}, torch.float16),
        ({"dtype": "float32"}, torch.float32),
        ({}, torch.float32),
        ({"torch_dtype": "int8"}, torch.float32),
    ],
)
def test_model_dtype_config_names_it(tmp_path, config, dtype):
    assert devices.model_dtype(_model_dir(tmp_path, **config)) == dtype


def test_pick_dtype_auto_model_dtype_on_gpu_fp32_on_cpu(tmp_path):
    d = _model_dir(tmp_path, torch_dtype="bfloat16")
    assert devices.pick_dtype("auto", torch.device("cuda"), d) == torch.bfloat16
    assert devices.pick_dtype("auto", torch.device("cpu"), d) == torch.float32
    assert devices.pick_dtype("float16", torch.device("cpu"), d) == torch.float16
    with pytest.raises(ValueError, match="dtype: 'fp8'"):
        devices.pick_dtype("fp8", torch.device("cpu"), d)


def test_pick_device_auto_cpu_without_gpu():
    assert devices.pick_device("auto") == torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    assert devices.pick_device("cpu") == torch.device("cpu")
    assert devices.describe(torch.device("cpu")) == "cpu"


def test_torch_engine_default_device_auto(monkeypatch):
    from services.rollout.torch_engine import TorchEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = TorchEngine()
    assert engine.device == torch.device("cpu") and engine.device_name == "cpu"
    with pytest.raises(ValueError, match="dtype"):
        TorchEngine(dtype="half-ish")
