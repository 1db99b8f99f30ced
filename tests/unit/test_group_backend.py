"""`asyncrl.collective.group_backend`: a weight group runs on NCCL only where every rank has a
GPU of its own. NCCL refuses two ranks on one device ("Duplicate GPU detected"), and a trainer
and a torch engine sharing one GPU is the one-GPU box's default placement
(`asyncrl.supervisor.gpus.default_placement`): such a group meets over gloo."""

from __future__ import annotations

import pytest

from asyncrl.collective import device_id, group_backend

A, B = "cuda:GPU-0a1b", "cuda:GPU-9f8e"


@pytest.mark.parametrize(
    ("mine", "devices", "backend"),
    [
        ("nccl", [A, B], "nccl"),  # trainer and engine on GPUs of their own
        ("nccl", [A, B, "cuda:GPU-77"], "nccl"),
        ("nccl", [A, A], "gloo"),  # one GPU shared by trainer and engine
        ("nccl", [A, B, B], "gloo"),  # two engines on one GPU
        ("nccl", [A, "cpu"], "gloo"),  # an engine on the CPU
        ("nccl", [A, ""], "gloo"),  # an engine that did not say (an older rollout)
        ("gloo", ["cpu", "cpu", "cpu"], "gloo"),  # the CPU: trainer without CUDA
        ("gloo", [A, B], "gloo"),
    ],
)
def test_nccl_only_where_every_rank_has_a_gpu_of_its_own(mine, devices, backend):
    assert group_backend(mine, devices) == backend


def test_a_cpu_device_is_named_cpu():
    assert device_id("cpu") == "cpu"
