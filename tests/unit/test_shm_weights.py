"""The same-host hand-over of a broadcast version (`asyncrl.shm`), a rollout's two staging
sets (services/rollout/broadcast_receiver.py `Staging`) and an engine taking their tensors as
its weights (`swap_weights(adopt=True)`)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl import buckets, shm
from services.rollout.broadcast_receiver import Staging
from services.rollout.torch_engine import swap_weights


def test_a_region_buffer_is_a_shared_file_another_mapping_reads(tmp_path):
    region = shm.Region(root=tmp_path)
    buf = region.alloc(4096)
    assert buf.dtype == torch.uint8 and buf.numel() == 4096 and int(buf.sum()) == 0
    path = region.path(buf)
    assert path.startswith(str(tmp_path / shm.owned_by(os.getpid())))
    ns = os.readlink("/proc/self/ns/pid").split("[")[1].rstrip("]")
    assert shm.owned_by(os.getpid()) == f"{shm.PREFIX}{ns}-{os.getpid()}-"
    buf[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    maps = shm.Maps()
    seen = maps.view(path, 4096)
    assert seen[:5].tolist() == [1, 2, 3, 4, 0]
    buf[0] = 9  # one set of pages: a later write is seen through the other mapping
    assert int(seen[0]) == 9
    with pytest.raises(ValueError, match="holds 4096 bytes, the plan says 8192"):
        shm.Maps().view(path, 8192)
    assert region.path(torch.zeros(8, dtype=torch.uint8)) is None  # not one of its files
    region.free(buf)
    assert not os.path.exists(path)
    with pytest.raises(OSError):
        shm.Maps().view(path, 4096)


def test_no_room_is_an_ordinary_buffer_not_a_sigbus(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    region = shm.Region(root=tmp_path)
    monkeypatch.setattr(os, "posix_fallocate", full)
    assert region.alloc(1 << 20) is None
    assert list(tmp_path.iterdir()) == []  # the reserved file is gone again
    sets = buckets.BufferSets(region.alloc, region.free)
    p = buckets.plan([("w", "float32", (4,))], 64)
    [buf] = sets.next(p, torch.device("cpu"))
    assert buf.numel() == 16 and region.path(buf) is None  # an ordinary one instead


def test_buffer_sets_alternate_two_shared_sets_and_free_one_when_the_plan_changes(tmp_path):
    region = shm.Region(root=tmp_path)
    sets = buckets.BufferSets(region.alloc, region.free)
    cpu = torch.device("cpu")
    small = buckets.plan([("w", "float32", (4,))], 64)
    a, b, a2 = sets.next(small, cpu), sets.next(small, cpu), sets.next(small, cpu)
    assert a2[0] is a[0] and b[0] is not a[0]
    assert len(list(tmp_path.iterdir())) == 2
    big = buckets.plan([("w", "float32", (8,))], 64)
    sets.next(big, cpu)  # the set of b goes: its file with it
    assert not os.path.exists(region.path(b[0]) or "") and len(list(tmp_path.iterdir())) == 2
    region.close()
    assert list(tmp_path.iterdir()) == []


def test_a_rollout_sees_the_region_only_where_the_probe_holds_the_token(tmp_path):
    region = shm.Region(root=tmp_path)
    advert = region.advert()
    assert shm.sees(advert)
    assert not shm.sees(advert | {"token": "another"})  # another host's /dev/shm
    assert not shm.sees(advert | {"probe": str(tmp_path / "absent")})
    assert not shm.sees({})


def test_sweep_removes_the_files_of_trainers_that_are_gone(tmp_path):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    dead = int(gone.stdout)
    (tmp_path / f"{shm.owned_by(dead)}ab12cd34-1").write_bytes(b"x")
    (tmp_path / f"{shm.owned_by(dead)}ab12cd34-probe").write_text("t")
    (tmp_path / f"{shm.owned_by(1)}ab12cd34-1").write_bytes(b"x")  # pid 1 runs
    other_ns = f"{shm.PREFIX}1-{dead}-ab12cd34-1"  # another PID namespace: its pid means nothing
    (tmp_path / other_ns).write_bytes(b"x")
    (tmp_path / "other-file").write_bytes(b"x")
    mine = shm.Region(root=tmp_path)
    kept = mine.alloc(64)
    removed = shm.sweep(tmp_path)
    assert sorted(removed) == [
        f"{shm.owned_by(dead)}ab12cd34-1",
        f"{shm.owned_by(dead)}ab12cd34-probe",
    ]
    assert os.path.exists(mine.path(kept))
    left = {p.name for p in tmp_path.iterdir()}
    assert left >= {f"{shm.owned_by(1)}ab12cd34-1", other_ns, "other-file"}


def test_maps_keep_the_files_of_the_last_two_plans(tmp_path):
    region = shm.Region(root=tmp_path)
    bufs = [region.alloc(64) for _ in range(3)]
    a, b, c = (region.path(x) for x in bufs)
    maps = shm.Maps()
    for path in (a, b):  # a version's plan names its files: mapped, then kept
        maps.view(path, 64)
        maps.keep([path])
    assert set(maps._maps) == {a, b}  # the trainer packs into a's again next
    maps.view(c, 64)
    maps.keep([c])
    assert set(maps._maps) == {b, c}  # a's set was reallocated: unmapped


PLAN = buckets.plan([("a", "float32", (2,)), ("b", "float32", (3,))], 16)


def test_staging_receives_into_the_set_the_newest_version_is_not_in():
    staging = Staging(torch.device("cpu"))
    first = staging.target(PLAN)
    assert staging.held == "" and staging.newest == []
    staging.took("fp1")
    assert staging.held == "fp1" and staging.newest is first
    second = staging.target(PLAN)
    assert second is not first  # the engine may serve from the first
    assert staging.held == "fp1"  # the newest set is untouched while the next comes in
    staging.forget()  # that one failed: the engine loads from the store into the first set
    assert staging.held == ""
    assert staging.target(PLAN) is second  # still not the first
    staging.took("fp2")
    assert staging.target(PLAN) is first


def test_a_delta_base_is_the_newest_set_copied_into_the_target():
    staging = Staging(torch.device("cpu"))
    first = staging.target(PLAN)
    for i, buf in enumerate(first):
        buf.fill_(i + 1)
    staging.took("fp1")
    second = staging.target(PLAN)
    for buf in second:
        buf.fill_(0)
    staging.base("fp-other")  # not what it holds: left as it is (the delta's checks fail)
    assert all(int(buf.sum()) == 0 for buf in second)
    staging.base("fp1")
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _llama(tie: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).eval()


def test_adopting_takes_the_tensors_as_storage_and_keeps_tied_weights_tied():
    model = _llama(tie=True)
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    swap_weights(model, state, adopt=True)
    emb = model.get_input_embeddings().weight
    assert emb.data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # no copy
    assert model.lm_head.weight is emb  # still one parameter
    state["model.embed_tokens.weight"][0, 0] = 7.0
    assert float(model.lm_head.weight[0, 0]) == 7.0


def test_a_tensor_of_another_dtype_is_copied_in_and_without_adopt_every_one_is():
    model = _llama(tie=False)
    names = list(model.state_dict())
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    state[names[0]] = state[names[0]].double()
    swap_weights(model, state, adopt=True)
    params = dict(model.named_parameters())
    assert params[names[0]].dtype == torch.float32  # copied in, converted
    assert torch.equal(params[names[0]], state[names[0]].float())
    assert params[names[1]].data_ptr() == state[names[1]].data_ptr()
    fresh = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    swap_weights(model, fresh)
    assert all(params[k].data_ptr() != fresh[k].data_ptr() for k in params)
    assert all(torch.equal(params[k], fresh[k]) for k in params)


def test_the_trainer_waits_2_s_and_the_copy_at_100_mb_per_s():
    assert shm.wait_s(0) == 2.0
    assert shm.wait_s(500_000_000) == 7.0  # 2 s + 500 MB at 100 MB/s
