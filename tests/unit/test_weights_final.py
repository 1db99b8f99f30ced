"""What goes with every version (every tokenizer file the base has, not a fixed list) and
what pruning never removes (the run's last version)."""

from __future__ import annotations

from asyncrl.weights import tokenizer_files, version_dir
from services.trainer.publish import write_version

BASE_FILES = {
    "config.json": "{}",
    "model.safetensors": "",
    "model.safetensors.index.json": "{}",
    "pytorch_model.bin": "",
    "tokenizer.model": "sp",
    "tokenizer.json": "{}",
    "tokenizer_config.json": "{}",
    "special_tokens_map.json": "{}",
    "added_tokens.json": "{}",
    "tekken.json": "{}",
    "generation_config.json": "{}",
    "chat_template.jinja": "{{ x }}",
    ".gitattributes": "",
}


def _base(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for name, text in BASE_FILES.items():
        (base / name).write_text(text)
    (base / "original").mkdir()
    return base


def test_tokenizer_files_every_non_weight_file_tokenizer_model_included(tmp_path):
    assert tokenizer_files(_base(tmp_path)) == [
        "added_tokens.json",
        "chat_template.jinja",
        "generation_config.json",
        "special_tokens_map.json",
        "tekken.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    assert tokenizer_files(tmp_path / "missing") == []


def test_write_version_carries_tokenizer_model(tmp_path):
    base, root = _base(tmp_path), tmp_path / "weights"
    for v in (1, 2):
        write_version(root, "e", v, {"config.json": b"{}"}, base, keep=3)
    assert (version_dir(root, "e", 2) / "tokenizer.model").read_text() == "sp"


def test_write_version_last_version_never_pruned(tmp_path):
    """The run ends at total_steps = 3; a stop answered late lets the trainer write more: the
    newest `keep` are kept and v3, the last, too."""
    base, root = _base(tmp_path), tmp_path / "weights"
    for v in range(1, 8):
        write_version(root, "e", v, {"config.json": b"{}"}, base, keep=2, last=3)
    assert sorted(p.name for p in (root / "e").iterdir()) == ["v000003", "v000006", "v000007"]
