"""The machine a figure came from, in one line: CPU model, cores, load average, GPU.

    from asyncrl.machine import machine_info, machine_line
    machine_line()   # 'AMD EPYC 7B13 · 2 cores · load 1.52 1.20 0.98 · no GPU'

A time measured on one machine says little about another (the same commit's demo took 1.68x
longer on a shared machine, issue 24): every report that prints a time prints this line too
(the bench table, `make gpu-check`, the demo's summary). Linux: the CPU model from
/proc/cpuinfo; elsewhere what `platform` says.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
_MODEL_KEYS = ("model name", "Hardware", "Processor", "cpu model")
"""/proc/cpuinfo keys naming the CPU, first found wins (x86; ARM; older ARM; MIPS)."""


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (`cpuinfo`: its text, for tests), else what
    `platform` knows (the architecture at least)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            fields.setdefault(key.strip(), value.strip())
    for key in _MODEL_KEYS:
        if key in fields:
            return " ".join(fields[key].split())
    return platform.processor() or platform.machine() or "unknown CPU"


def gpu_name() -> str | None:
    """The first CUDA device's name: through torch when this process imported it already (the
    benchmarks, gpu-check), else nvidia-smi when it is on PATH; None without a GPU."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
        except Exception:  # noqa: BLE001 - a broken CUDA install reads as no GPU
            return None
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        got = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = [n.strip() for n in got.stdout.splitlines() if n.strip()]
    return f"{names[0]} x{len(names)}" if got.returncode == 0 and names else None


def machine_info() -> dict:
    """CPU model, cores (all, and those this process may run on), 1/5/15-minute load average,
    GPU (None without one), hostname."""
    cores = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = cores
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {
        "cpu": cpu_model(),
        "cores": cores,
        "usable_cores": usable,
        "load": load,
        "gpu": gpu_name(),
        "host": platform.node(),
    }


def machine_line(info: dict | None = None) -> str:
    """`machine_info()` (or `info`) as one line, e.g.
    'AMD EPYC 7B13 · 2 cores · load 1.52 1.20 0.98 · no GPU'."""
    m = machine_info() if info is None else info
    cores = f"{m['cores']} cores"
    if m.get("usable_cores") and m["usable_cores"] != m["cores"]:
        cores = f"{m['usable_cores']} of {m['cores']} cores usable"
    load = " ".join(f"{x:.2f}" for x in m.get("load") or []) or "unknown"
    return f"{m['cpu']} · {cores} · load {load} · {m.get('gpu') or 'no GPU'}"
