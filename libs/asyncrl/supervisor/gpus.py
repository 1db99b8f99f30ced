"""GPU placement for `make up`: which GPUs each supervised process sees.

    ASYNCRL_GPUS="rollout=0-3 trainer=4-7"      # explicit: ranges and lists (0,2,5-6)
    ASYNCRL_GPUS="rollout=0-7/2 trainer=0-7"    # /W: W GPUs per replica (see below)

Each process gets `CUDA_VISIBLE_DEVICES` naming its GPUs in the ids of the host (the ids
nvidia-smi shows, or the entries of the supervisor's own CUDA_VISIBLE_DEVICES when that is
set: then only those may be placed). The rules:

- **Default** (ASYNCRL_GPUS unset): the visible GPUs split in two, the first half to rollout,
  the rest to the trainer; one GPU is shared by both; no GPU (a CPU machine): no placement at
  all, every environment as before.
- **Replicas**: a service's GPUs are dealt out `W` at a time, replica i taking the
  (i mod n/W)-th slice. `W` is 1 for the torch engine's rollouts (one GPU each, round-robin:
  `make scale rollout 4` on rollout=0-3 puts one engine per GPU), every GPU of the service
  otherwise (SGLang's own tensor/data parallelism spans them; the trainer's torchrun ranks take
  one each). `rollout=0-7/2`: two GPUs per replica.
- **Services not named** (the scheduler, the reward workers, and rollout or trainer when
  ASYNCRL_GPUS leaves them out) get `CUDA_VISIBLE_DEVICES=""`: no CUDA context of theirs lands
  on a GPU another service was given. A reward plugin that wants a GPU names it:
  `reward=7`.
- **Refused** (`make up` fails, naming the problem): an unknown service, a malformed range, a
  GPU that is not visible, two services whose GPUs overlap without being the same set
  (`rollout=0-3 trainer=3-7` is a typo; `rollout=0 trainer=0` is a deliberate share), a width
  that does not divide the service's GPUs, a torchrun trainer with more ranks than GPUs.

Pure: `parse`, `default_placement`, `check` and `devices_for` take what they need; `visible_gpus`
is the one function that looks at the machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PLACEABLE = ("scheduler", "reward", "rollout", "trainer")


class PlacementError(ValueError):
    """A placement `make up` refuses; the message names the problem."""


@dataclass(frozen=True)
class Slot:
    """One service's GPUs and how many each replica takes (None: all of them)."""

    gpus: tuple[str, ...]
    width: int | None = None


def parse_ids(text: str) -> tuple[str, ...]:
    """'0-3' -> ('0','1','2','3'); '0,2,5-6' -> ('0','2','5','6'). Order kept, no repeats."""
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise PlacementError(f"empty GPU id in {text!r}")
        if "-" in part:
            lo, _, hi = part.partition("-")
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise PlacementError(f"bad GPU range {part!r} (want like 0-3)")
            ids = [str(i) for i in range(int(lo), int(hi) + 1)]
        elif part.isdigit():
            ids = [str(int(part))]
        else:
            raise PlacementError(f"bad GPU id {part!r} (want an index, a range 0-3 or a list)")
        for i in ids:
            if i in out:
                raise PlacementError(f"GPU {i} named twice in {text!r}")
            out.append(i)
    return tuple(out)


def parse(text: str) -> dict[str, Slot]:
    """`ASYNCRL_GPUS`: whitespace-separated `service=ids[/width]` entries."""
    placement: dict[str, Slot] = {}
    for entry in text.split():
        service, eq, value = entry.partition("=")
        if not eq or not value:
            raise PlacementError(f"bad entry {entry!r} (want service=ids, e.g. rollout=0-3)")
        if service not in PLACEABLE:
            raise PlacementError(f"unknown service {service!r} in {entry!r}; one of {PLACEABLE}")
        if service in placement:
            raise PlacementError(f"{service} placed twice")
        ids, slash, width = value.partition("/")
        if slash and not (width.isdigit() and int(width) > 0):
            raise PlacementError(f"bad width {width!r} in {entry!r} (GPUs per replica, >= 1)")
        placement[service] = Slot(parse_ids(ids), int(width) if slash else None)
    return placement


def default_placement(visible: list[str]) -> dict[str, Slot]:
    """No ASYNCRL_GPUS: half the visible GPUs to rollout, the rest to the trainer; one GPU
    shared; none: no placement."""
    if not visible:
        return {}
    if len(visible) == 1:
        return {"rollout": Slot(tuple(visible)), "trainer": Slot(tuple(visible))}
    half = len(visible) // 2
    return {"rollout": Slot(tuple(visible[:half])), "trainer": Slot(tuple(visible[half:]))}


def check(
    placement: dict[str, Slot], visible: list[str] | None, engine: str, trainer_nproc: int
) -> None:
    """Raise PlacementError on a placement `make up` must refuse. `visible`: the GPUs this
    host shows (None: unknown, nothing to check the ids against)."""
    for service, slot in placement.items():
        if visible is not None:
            missing = [g for g in slot.gpus if g not in visible]
            if missing:
                shown = ",".join(visible) or "none"
                raise PlacementError(
                    f"{service}: GPU {','.join(missing)} not visible (visible: {shown})"
                )
        width = replica_width(service, slot, engine)
        if len(slot.gpus) % width:
            raise PlacementError(
                f"{service}: {len(slot.gpus)} GPUs do not split into replicas of {width}"
            )
    services = sorted(placement)
    for i, a in enumerate(services):
        for b in services[i + 1 :]:
            ga, gb = set(placement[a].gpus), set(placement[b].gpus)
            if ga & gb and ga != gb:
                shared = ",".join(sorted(ga & gb, key=int))
                raise PlacementError(
                    f"{a} and {b} overlap on GPU {shared}: give them disjoint GPUs or the"
                    " same ones (a deliberate share)"
                )
    trainer = placement.get("trainer")
    if trainer is not None and trainer_nproc > 1:
        width = replica_width("trainer", trainer, engine)
        if trainer_nproc > width:
            raise PlacementError(
                f"trainer: {trainer_nproc} torchrun ranks (ASYNCRL_TRAINER_NPROC) but"
                f" {width} GPUs per trainer"
            )


def replica_width(service: str, slot: Slot, engine: str) -> int:
    """GPUs per replica: the slot's `/W`, else 1 for torch-engine rollouts, else all."""
    if slot.width is not None:
        return slot.width
    if service == "rollout" and engine == "torch":
        return 1
    return len(slot.gpus)


def devices_for(placement: dict[str, Slot], service: str, index: int, engine: str) -> str | None:
    """CUDA_VISIBLE_DEVICES of replica `index` of `service`; None: leave the environment as
    it is (no placement: a CPU machine); "": no GPU."""
    if not placement:
        return None
    slot = placement.get(service)
    if slot is None or not slot.gpus:
        return ""
    width = replica_width(service, slot, engine)
    start = (index % (len(slot.gpus) // width)) * width
    return ",".join(slot.gpus[start : start + width])


def visible_gpus() -> list[str] | None:
    """The GPUs this process may place, in host ids: the entries of CUDA_VISIBLE_DEVICES when
    it is set; else, where an NVIDIA driver is loaded, 0..n-1 (n from torch). None where no
    driver is seen (a CPU machine: torch is not even imported) or torch cannot count: nothing
    to check an explicit placement against."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    if not Path("/proc/driver/nvidia").exists():
        return None
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken driver install: the user's ids are taken as they are
        return None


def resolve(
    text: str, visible: list[str] | None, engine: str, trainer_nproc: int
) -> dict[str, Slot]:
    """The placement of `ASYNCRL_GPUS` (`text`; "" for the default), checked against
    `visible` (`visible_gpus`; None: an explicit placement is taken as given, e.g. on a CPU
    machine where a test states one)."""
    if not text.strip():
        return default_placement(visible or [])
    placement = parse(text)
    check(placement, visible, engine, trainer_nproc)
    return placement


def describe(placement: dict[str, Slot]) -> str:
    """One line for the logs and `make up`: 'rollout=0,1 trainer=2,3' (or 'none')."""
    return " ".join(f"{s}={','.join(v.gpus)}" for s, v in placement.items()) or "none"
