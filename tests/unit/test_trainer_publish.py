"""write_version: a version in the weight store with the step's files and the tokenizer's."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.weights import version_dir
from services.trainer.publish import write_version


def _tokenizer(tmp_path: Path) -> Path:
    src = tmp_path / "model"
    src.mkdir()
    (src / "tokenizer.json").write_text('{"model": "chars"}')
    (src / "tokenizer_config.json").write_text("{}")
    return src


def test_write_version_links_tokenizer_of_previous_version_else_copies(tmp_path):
    src, root = _tokenizer(tmp_path), tmp_path / "weights"
    for version in (1, 2):
        write_version(root, "e", version, {"config.json": b"{}"}, src, keep=3)
    first, second = version_dir(root, "e", 1), version_dir(root, "e", 2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (second / name).read_bytes() == (src / name).read_bytes()
        assert (second / name).stat().st_ino == (first / name).stat().st_ino
        assert (first / name).stat().st_ino != (src / name).stat().st_ino
    assert not (second / "vocab.json").exists()
    assert (second / "config.json").read_bytes() == b"{}"


def test_write_version_after_previous_pruned_copies_tokenizer(tmp_path):
    src, root = _tokenizer(tmp_path), tmp_path / "weights"
    for version in (1, 2, 3):
        write_version(root, "e", version, {"config.json": b"{}"}, src, keep=1)
    assert not version_dir(root, "e", 2).exists()
    write_version(root, "e", 5, {"config.json": b"{}"}, src, keep=1)  # 4 never written
    assert (version_dir(root, "e", 5) / "tokenizer.json").read_text() == '{"model": "chars"}'


def test_write_version_tokenizer_dir_lacking_files_links_only_those_present(tmp_path):
    src, root = _tokenizer(tmp_path), tmp_path / "weights"
    (src / "merges.txt").write_text("a b")
    for version in (1, 2, 3):
        write_version(root, "e", version, {"config.json": b"{}"}, src, keep=3)
    third = version_dir(root, "e", 3)
    assert sorted(p.name for p in third.iterdir()) == [
        "config.json",
        "fingerprint.json",
        "merges.txt",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (third / "merges.txt").stat().st_ino == (
        version_dir(root, "e", 1) / "merges.txt"
    ).stat().st_ino


def test_write_version_previous_lacks_a_tokenizer_file_copies_it(tmp_path):
    src, root = _tokenizer(tmp_path), tmp_path / "weights"
    write_version(root, "e", 1, {"config.json": b"{}"}, src, keep=3)
    (src / "vocab.json").write_text("{}")  # new since version 1
    write_version(root, "e", 2, {"config.json": b"{}"}, src, keep=3)
    first, second = version_dir(root, "e", 1), version_dir(root, "e", 2)
    assert (second / "vocab.json").read_text() == "{}"
    assert (second / "tokenizer.json").stat().st_ino == (first / "tokenizer.json").stat().st_ino


def test_write_version_first_version_makes_experiment_dir(tmp_path):
    src, root = _tokenizer(tmp_path), tmp_path / "deep" / "weights"
    uri = write_version(root, "e", 1, {"config.json": b"{}"}, src, keep=3)
    assert uri == version_dir(root, "e", 1).absolute().as_uri()
    assert (version_dir(root, "e", 1) / "config.json").read_bytes() == b"{}"


def test_write_version_keeps_newest(tmp_path):
    src, root = _tokenizer(tmp_path), tmp_path / "weights"
    for version in range(1, 8):
        write_version(root, "e", version, {"config.json": b"%d" % version}, src, keep=3)
    assert sorted(p.name for p in (root / "e").iterdir()) == ["v000005", "v000006", "v000007"]
    assert (version_dir(root, "e", 7) / "config.json").read_bytes() == b"7"


def test_write_version_crashed_writers_temp_never_a_version_removed_once_passed(tmp_path):
    src, root = _tokenizer(tmp_path), tmp_path / "weights"
    leftover = root / "e" / ".tmp-v000002-deadbeef"  # a crashed writer's
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_bytes(b"partial")
    write_version(root, "e", 1, {"config.json": b"{}"}, src, keep=1)
    assert sorted(p.name for p in (root / "e").iterdir()) == [".tmp-v000002-deadbeef", "v000001"]
    for version in (2, 3):
        write_version(root, "e", version, {"config.json": b"{}"}, src, keep=1)
    assert sorted(p.name for p in (root / "e").iterdir()) == ["v000003"]
    assert (version_dir(root, "e", 3) / "config.json").read_bytes() == b"{}"


def test_write_version_again_after_rewind_replaces_it(tmp_path):
    src, root = _tokenizer(tmp_path), tmp_path / "weights"
    for version in (1, 2, 3):
        write_version(root, "e", version, {"config.json": b"old"}, src, keep=3)
    write_version(root, "e", 2, {"config.json": b"new"}, src, keep=3)  # resumed at step 1
    second = version_dir(root, "e", 2)
    assert (second / "config.json").read_bytes() == b"new"
    assert (second / "tokenizer.json").read_text() == '{"model": "chars"}'
    assert sorted(p.name for p in (root / "e").iterdir()) == ["v000001", "v000002"]


def test_write_version_deep_rewind_discards_the_abandoned_lineage_keeps_the_new_one(tmp_path):
    """Issue 23 point 9: resumed at v2 after v8 (keep 3), the trainer writes v2 again, then v3
    and v4. By name alone the abandoned v6..v8 are the newest and v2 went as v3 was written."""
    src, root = _tokenizer(tmp_path), tmp_path / "weights"
    for version in range(1, 9):
        write_version(root, "e", version, {"config.json": b"old"}, src, keep=3)
    for version in (2, 3, 4):
        write_version(root, "e", version, {"config.json": b"new"}, src, keep=3)
        kept = sorted(p.name for p in (root / "e").iterdir())
        assert kept == [f"v{v:06d}" for v in range(2, version + 1)]
    assert {(version_dir(root, "e", v) / "config.json").read_bytes() for v in (2, 3, 4)} == {b"new"}


def test_write_version_failure_leaves_no_version_and_no_temp_dir(tmp_path):
    src, root = _tokenizer(tmp_path), tmp_path / "weights"
    write_version(root, "e", 1, {"config.json": b"{}"}, src, keep=3)
    with pytest.raises(FileNotFoundError):
        write_version(root, "e", 2, {"config.json": b"{}", "no/such/dir": b""}, src, keep=3)
    assert sorted(p.name for p in (root / "e").iterdir()) == ["v000001"]


def test_write_version_tokenizer_dir_missing_writes_only_files(tmp_path):
    root = tmp_path / "weights"
    for version in (1, 2):  # a hub name as the tokenizer's path: nothing to list
        write_version(root, "e", version, {"config.json": b"{}"}, tmp_path / "org/model", keep=3)
    names = sorted(p.name for p in version_dir(root, "e", 2).iterdir())
    assert names == ["config.json", "fingerprint.json"]
