"""The weight store: one directory of HuggingFace-format safetensors per version.

Layout: <root>/<experiment>/v<version>/ with config.json, model.safetensors and the tokenizer
files, written to a temporary directory and renamed into place (readers never see a partial
version). URIs are file:// URLs of that directory. Names starting with "." are no versions or
experiments: temporary directories, and the experiments' spares (`spare_dir`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

if TYPE_CHECKING:
    import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)


def spare_dir(root: Path, experiment_id: str) -> str:
    """An experiment's spare: a pruned version's directory, emptied and kept as the next
    version's temporary one (`prune(spare=True)`, `make_temp_dir`), so that a version written
    per trainer step costs a rename each way instead of an rmdir and a mkdir, its two costliest
    calls (an inode and a block freed, then allocated: ~87 and ~30 µs on an ext4 mounted with
    `discard`). Beside the experiment's directory, not in it: that one lists its versions."""
    return os.path.join(root, f".tmp-spare-{experiment_id}")


def uri_to_path(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(urlparse(uri).path)
    return Path(uri)


def path_to_uri(path: Path) -> str:
    return Path(path).absolute().as_uri()


def version_name(version: int) -> str:
    """A version's directory name in its experiment's directory."""
    return f"v{version:06d}"


def version_dir(root: Path, experiment_id: str, version: int) -> Path:
    return Path(root) / experiment_id / version_name(version)


def load_state_dict_files(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HuggingFace directory: model.safetensors, or every shard named by
    model.safetensors.index.json."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(d / shard)))
        return state
    single = d / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors in {d}")
    return load_file(str(single))


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).exists():
            shutil.copy2(Path(src_dir) / name, Path(dst_dir) / name)


def make_temp_dir(root: Path, experiment_id: str, name: str) -> str:
    """A new empty directory in the experiment's directory to write version `name` in before
    `publish_version` renames it into place: the experiment's spare if it has one, else made
    (and the experiment's directory with it, for its first version)."""
    exp = os.path.join(root, experiment_id)
    tmp = f"{exp}/.tmp-{name}-{os.urandom(4).hex()}"
    try:
        os.rename(spare_dir(root, experiment_id), tmp)
        return tmp
    except OSError:  # none (yet)
        pass
    try:
        os.mkdir(tmp)
    except FileNotFoundError:
        os.makedirs(exp, exist_ok=True)
        os.mkdir(tmp)
    return tmp


def publish_version(tmp_dir: str | Path, final_dir: str | Path) -> str:
    """Atomically move a fully written version directory into place (replacing one already
    there, after a rewind); return its URI."""
    try:
        os.rename(tmp_dir, final_dir)  # the usual case: tried first, no stat beforehand
    except FileNotFoundError:  # no parent yet (or no `tmp_dir`: raised again below)
        os.makedirs(os.path.dirname(final_dir), exist_ok=True)
        os.rename(tmp_dir, final_dir)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shutil.rmtree(final_dir)
        os.replace(tmp_dir, final_dir)
    return path_to_uri(final_dir)


def prune(
    root: Path,
    experiment_id: str,
    keep: int = 3,
    protect: Path | None = None,
    spare: bool = False,
) -> None:
    """Remove all but the newest `keep` versions of an experiment, and never `protect` (the
    version just put there for a reader: after a rewind it is older than the ones kept). With
    `spare`, the first one removed is emptied and kept as the experiment's `spare_dir` (gone
    from its name as if removed) for `make_temp_dir`."""
    d = os.path.join(root, experiment_id)
    try:
        with os.scandir(d) as it:  # the entries' types come with them: no stat per entry
            versions = sorted((e.name, e) for e in it if e.name.startswith("v") and e.is_dir())
    except FileNotFoundError:
        return
    for name, entry in versions[:-keep]:
        if protect is None or Path(d, name) != Path(protect):
            _remove_version(entry, spare_dir(root, experiment_id) if spare else None)
            spare = False


def _remove_version(entry: os.DirEntry, spare: str | None) -> None:
    """Delete a version directory (or empty it and rename it to `spare`): its files unlinked,
    without `shutil.rmtree`'s fd-based walk (a dozen syscalls more, every step). Anything else
    (a symlink, a subdirectory, a failure) goes to rmtree as before, errors ignored."""
    if not entry.is_symlink():
        try:
            with os.scandir(entry.path) as it:
                for f in it:
                    os.unlink(f.path)  # never follows a symlink; a subdirectory raises
            if spare is None:
                os.rmdir(entry.path)
            else:
                os.rename(entry.path, spare)  # an empty one there is replaced
            return
        except OSError:
            pass
    shutil.rmtree(entry.path, ignore_errors=True)
