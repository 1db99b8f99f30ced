"""The machine line every timed figure carries (asyncrl.machine, issue 24)."""

from __future__ import annotations

import os

from asyncrl.machine import cpu_model, machine_info, machine_line

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13  64-Core Processor
cpu cores\t: 1

processor\t: 1
model name\t: AMD EPYC 7B13  64-Core Processor
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
CPU part\t: 0xd0c

Hardware\t: BCM2835
"""


def test_cpu_model_x86_first_model_name_spaces_collapsed():
    assert cpu_model(X86) == "AMD EPYC 7B13 64-Core Processor"


def test_cpu_model_arm_hardware_line():
    assert cpu_model(ARM) == "BCM2835"


def test_cpu_model_nothing_known_falls_back_to_platform():
    assert cpu_model("processor\t: 0\n") != ""


def test_machine_line_exact_format():
    info = {
        "cpu": "AMD EPYC 7B13",
        "cores": 2,
        "usable_cores": 2,
        "load": [1.5, 1.25, 0.987],
        "gpu": None,
    }
    assert machine_line(info) == "AMD EPYC 7B13 · 2 cores · load 1.50 1.25 0.99 · no GPU"


def test_machine_line_names_usable_cores_and_gpu():
    info = {
        "cpu": "Intel Xeon",
        "cores": 16,
        "usable_cores": 4,
        "load": [],
        "gpu": "NVIDIA H100 80GB HBM3 x1",
    }
    assert machine_line(info) == (
        "Intel Xeon · 4 of 16 cores usable · load unknown · NVIDIA H100 80GB HBM3 x1"
    )


def test_machine_info_this_host():
    m = machine_info()
    assert m["cores"] == os.cpu_count()
    assert 1 <= m["usable_cores"] <= m["cores"]
    assert len(m["load"]) == 3 and all(x >= 0 for x in m["load"])
    assert machine_line(m).startswith(f"{m['cpu']} · ")


def test_bench_table_carries_the_machine_line_and_command():
    """Every bench figure names the machine it came from: the table's caption."""
    from rich.console import Console

    from bench.report import Result, build_report, render_table

    report = build_report(
        [Result("x", "m", 2.0, "s", "p", 1.0)], [], quick=True, command=["python", "-m", "bench"]
    )
    assert report["machine"]["line"] == machine_line(report["machine"])
    console = Console(record=True, width=300)
    console.print(render_table(report))
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    assert f"machine (load before the run): {report['machine']['line']}" in text
    assert "command: python -m bench" in text


def test_gpu_check_report_prints_the_machine_line():
    from bench.gpu.__main__ import machine
    from bench.gpu.report import markdown

    m = machine(dry_run=True)
    report = {"machine": m, "dry_run": True, "device": "cpu", "command": "x", "parts": []}
    assert f"machine: {m['line']}" in markdown(report).splitlines()
