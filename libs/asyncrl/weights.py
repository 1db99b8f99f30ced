"""The weight store: one directory of HuggingFace-format safetensors per version.

Layout: <root>/<experiment>/v<version>/ with config.json, model.safetensors and the tokenizer
files, written to a temporary directory and renamed into place (readers never see a partial
version). URIs are file:// URLs of that directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)


def weight_root() -> Path:
    return Path(os.environ.get("ASYNCRL_WEIGHTS", "var/weights")).absolute()


def uri_to_path(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(urlparse(uri).path)
    return Path(uri)


def path_to_uri(path: Path) -> str:
    return Path(path).absolute().as_uri()


def version_dir(root: Path, experiment_id: str, version: int) -> Path:
    return Path(root) / experiment_id / f"v{version:06d}"


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).exists():
            shutil.copy2(Path(src_dir) / name, Path(dst_dir) / name)


def publish_version(tmp_dir: Path, final_dir: Path) -> str:
    """Atomically move a fully written version directory into place; return its URI."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.replace(tmp_dir, final_dir)
    return path_to_uri(final_dir)


def prune(root: Path, experiment_id: str, keep: int = 3) -> None:
    """Remove all but the newest `keep` versions of an experiment."""
    d = Path(root) / experiment_id
    if not d.exists():
        return
    versions = sorted(p for p in d.iterdir() if p.is_dir() and p.name.startswith("v"))
    for p in versions[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
