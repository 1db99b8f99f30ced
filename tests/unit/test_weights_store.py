"""The weight store's directory operations: publish_version (a temporary directory renamed into
place) and prune (the newest versions kept, a protected one never removed)."""

from __future__ import annotations

from pathlib import Path

from asyncrl.weights import prune, publish_version, version_dir


def _version(root: Path, version: int, exp: str = "e") -> Path:
    d = version_dir(root, exp, version)
    d.mkdir(parents=True)
    (d / "config.json").write_text(str(version))
    return d


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_prune_keeps_newest_versions(tmp_path):
    for v in range(1, 6):
        _version(tmp_path, v)
    prune(tmp_path, "e", keep=2)
    assert _names(tmp_path / "e") == ["v000004", "v000005"]


def test_prune_protected_older_version_kept(tmp_path):
    for v in range(1, 6):
        _version(tmp_path, v)
    prune(tmp_path, "e", keep=2, protect=version_dir(tmp_path, "e", 2))
    assert _names(tmp_path / "e") == ["v000002", "v000004", "v000005"]


def test_prune_newest_removes_versions_above_it_keeps_newest_below(tmp_path):
    for v in (1, 2, 5, 6, 7):
        _version(tmp_path, v)
    prune(tmp_path, "e", keep=2, newest=2)  # v5..v7: an abandoned lineage
    assert _names(tmp_path / "e") == ["v000001", "v000002"]
    _version(tmp_path, 3)
    prune(tmp_path, "e", keep=2, newest=3)
    assert _names(tmp_path / "e") == ["v000002", "v000003"]


def test_prune_newest_removes_a_killed_writers_temporaries_up_to_it(tmp_path):
    """A trainer killed while it wrote v3 left `.tmp-v000003-*`; its successor wrote v3 again
    (and v4): what is left of the killed write goes, a temporary above `newest` stays."""
    for v in (2, 3, 4):
        _version(tmp_path, v)
    for name in (".tmp-v000003-0123abcd", ".tmp-v000004-89abcdef", ".tmp-v000005-00000000"):
        (tmp_path / "e" / name).mkdir()
        (tmp_path / "e" / name / "model.safetensors").write_bytes(b"partial")
    prune(tmp_path, "e", keep=3, newest=4)
    assert _names(tmp_path / "e") == [".tmp-v000005-00000000", "v000002", "v000003", "v000004"]


def test_prune_no_experiment_dir_does_nothing(tmp_path):
    prune(tmp_path, "missing", keep=1)
    assert not (tmp_path / "missing").exists()


def test_prune_other_entries_not_counted_nor_removed(tmp_path):
    for v in range(1, 4):
        _version(tmp_path, v)
    (tmp_path / "e" / "v999999.txt").write_text("a file, not a version")
    (tmp_path / "e" / ".tmp-v000004-0123abcd").mkdir()
    (tmp_path / "e" / "other").mkdir()
    prune(tmp_path, "e", keep=1)
    assert _names(tmp_path / "e") == [".tmp-v000004-0123abcd", "other", "v000003", "v999999.txt"]


def test_prune_version_with_subdirectory_removed_whole(tmp_path):
    old = _version(tmp_path, 1)
    (old / "shards").mkdir()
    (old / "shards" / "a.safetensors").write_bytes(b"x")
    _version(tmp_path, 2)
    prune(tmp_path, "e", keep=1)
    assert _names(tmp_path / "e") == ["v000002"]


def test_prune_symlinked_version_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("keep me")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "v000001").symlink_to(elsewhere)
    _version(tmp_path, 2)
    prune(tmp_path, "e", keep=1)
    assert (elsewhere / "config.json").read_text() == "keep me"


def test_publish_version_replaces_existing_version(tmp_path):
    final = _version(tmp_path, 1)
    (final / "stale.bin").write_bytes(b"old")
    tmp = tmp_path / "e" / ".tmp-v000001-0123abcd"
    tmp.mkdir()
    (tmp / "config.json").write_text("new")
    uri = publish_version(tmp, final)
    assert uri == final.absolute().as_uri()
    assert _names(final) == ["config.json"]
    assert (final / "config.json").read_text() == "new"
    assert not tmp.exists()


def test_publish_version_missing_parent_made(tmp_path):
    tmp = tmp_path / ".tmp-v000001-0123abcd"
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    final = version_dir(tmp_path / "weights", "e", 1)
    publish_version(tmp, final)
    assert (final / "config.json").read_text() == "{}"
