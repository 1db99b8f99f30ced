"""write_version: a version in the weight store with the step's files and the tokenizer's."""

from __future__ import annotations

from pathlib import Path

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
