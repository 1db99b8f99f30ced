"""The weight routes of the SGLang HTTP fake (tests/fakes/sglang_server.py): updates from
disk, the collective update group and, from 0.5.21, the weight-update session around
distributed updates."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import torch
from aiohttp import web

from services.trainer.weight_sync import init_custom_group  # SGLang's recipe, as the trainer's
from tests.fakes.sglang_rules import HttpError, json_body


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes: equal digests mean equal tensors."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def flattened_layout(names, dtypes, shapes) -> tuple[list[tuple], int]:
    """SGLang's `FlattenedTensorBucket.empty` layout (sglang/srt/weight_sync/tensor_bucket.py):
    per tensor (name, dtype, shape, start, end) back to back with no padding, and the total
    bytes; ValueError as SGLang words it for a negative dimension, an offset that is not a
    multiple of the dtype's itemsize, or no tensor (tests/unit/test_sglang_contract.py checks
    this against the installed class)."""
    layout, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, dtype)
        shape = torch.Size(shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
        if offset % dtype.itemsize:
            raise ValueError(
                f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}"
            )
        size = shape.numel() * dtype.itemsize
        layout.append((name, dtype, shape, offset, offset + size))
        offset += size
    if not layout:
        raise ValueError("Cannot create empty tensor bucket")
    return layout, offset


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def failure(message: str, **extra) -> HttpError:
    """A control route's 400: {"success": false, "message"}."""
    return HttpError(400, message, {"success": False, "message": message, **extra})


class WeightRoutes:
    """FakeSGLang's weight routes (a mixin: the state lives on FakeSGLang)."""

    async def fake_weights(self, request: web.Request) -> web.Response:
        state = self.model.state_dict()
        return web.json_response({name: tensor_digest(t) for name, t in state.items()})

    def _set_version(self, body: dict) -> str:
        if self.api >= (0, 5, 1) and body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
            return f" Weight version updated to {self.weight_version}."
        return ""

    async def _exclusive(self, body: dict, swap) -> None:
        """Block new requests, wait for the running ones (SGLang's writer lock), run swap."""
        if body.get("abort_all_requests"):
            self._abort("", abort_all=True)
        self.updating = True
        try:
            await self._wait_for(lambda: not self._started())
            await swap()
        finally:
            self.updating = False
            await self._changed()

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await json_body(request, required=("model_path",))
        path = body["model_path"] or ""
        if not (Path(path) / "config.json").is_file():
            raise failure(
                f"Failed to update weights: {path!r} is not a model directory (no config.json)",
                num_paused_requests=0,
            )
        try:
            new = await asyncio.to_thread(load_model, path)
        except Exception as e:  # noqa: BLE001 - reported like SGLang does
            raise failure(
                f"Failed to update weights: {type(e).__name__}: {e}", num_paused_requests=0
            ) from None
        old_shapes = {k: v.shape for k, v in self.model.state_dict().items()}
        new_shapes = {k: v.shape for k, v in new.state_dict().items()}
        if old_shapes != new_shapes:
            raise failure(
                f"Failed to update weights: the model at {path!r} has other parameters "
                "or shapes than the served one",
                num_paused_requests=0,
            )

        async def swap():
            self.model, self.model_path = new, path
            self.base_swapped()  # LoRA adapters go onto the new base

        await self._exclusive(body, swap)
        self.stats["updates"] += 1
        message = "Succeeded to update model weights." + self._set_version(body)
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        b = await json_body(
            request, required=("master_address", "master_port", "rank_offset", "world_size")
        )
        name = b.get("group_name", "weight_update_group")
        try:
            self.groups[name] = await asyncio.to_thread(
                init_custom_group,
                b.get("backend", "nccl"),
                b["master_address"],
                int(b["master_port"]),
                int(b["rank_offset"]),
                int(b["world_size"]),
                name,
            )
        except Exception as e:  # noqa: BLE001
            raise failure(str(e)) from None
        return web.json_response({"success": True, "message": "Succeeded to initialize group."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await json_body(request)
        if self.update_session:
            raise failure("a weight-update session is already open; call end_weight_update() first")
        self.update_session = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await json_body(request)
        if not self.update_session:
            raise failure("no weight-update session is open; call begin_weight_update() first")
        self.update_session = False
        return web.json_response({"success": True, "message": "Success"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        b = await json_body(request, required=("names", "dtypes", "shapes"))
        if self.api >= (0, 5, 21) and not self.update_session:
            raise failure(
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()"
            )
        group = self.groups.get(b.get("group_name", "weight_update_group"))
        if group is None:
            raise failure(f"no weights update group {b.get('group_name')!r}: init it first")

        bucket = b.get("load_format") == "flattened_bucket" and self.api >= (0, 5, 6)
        if bucket:
            try:
                layout, total = flattened_layout(b["names"], b["dtypes"], b["shapes"])
            except ValueError as e:
                raise failure(f"Failed to receive weights: {e}") from None

        def receive():
            import torch.distributed as dist

            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
            if bucket:
                flat = torch.empty(total, dtype=torch.uint8, device=device)
                dist.broadcast(flat, src=0, group=group)
                self.stats["broadcasts"] += 1
                got = [(n, flat[a:z].view(dt).reshape(sh)) for n, dt, sh, a, z in layout]
            else:
                got = []
                for name, dtype, shape in zip(b["names"], b["dtypes"], b["shapes"], strict=True):
                    t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                    dist.broadcast(t, src=0, group=group)
                    self.stats["broadcasts"] += 1
                    got.append((name, t))
            state = self.model.state_dict(keep_vars=True)
            with torch.no_grad():
                for name, t in got:
                    state[name].copy_(t.to("cpu", state[name].dtype))

        async def swap():
            await asyncio.to_thread(receive)

        await self._exclusive(b, swap)
        message = "Succeeded to update parameter online." + self._set_version(b)
        return web.json_response({"success": True, "message": message})
