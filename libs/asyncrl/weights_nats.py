"""Weights without a shared filesystem: versions in a JetStream object store bucket.

With `trainer.weight_sync: nats` (services/trainer/transport.py; the deprecated
`ASYNCRL_WEIGHTS_TRANSPORT=nats` is its alias) the trainer writes a version to its local
weight store as always (checkpoints and resume read it there), then uploads the version's
files to the bucket `WEIGHTS_BUCKET` as objects `<experiment>/v000123/<file>`, the manifest
(`<experiment>/v000123/manifest.json`: the file names, sizes and SHA-256 digests, and the
weights' fingerprint) last: a version without a manifest is not there yet. Its URI, what CommitWeights carries, is
`nats-obj://asyncrl_weights/<experiment>/v000123`.

A rollout fetches such a URI into its own cache directory (`<cache>/<experiment>/v000123`):
every file read chunk by chunk into a temporary directory, its size and SHA-256 checked against
the object's info, and the directory renamed into place, so a cached version is always whole.
The cache is keyed by content (the manifest's digest): a version published again with other
bytes (a trainer resumed from an older checkpoint) is fetched again.

Reading is our own: an ordered consumer on the object's chunk subject, each chunk written to
the file as it arrives. nats-py's `ObjectStore.get()` (nats-py 2.16) gathers the object with
`result.data += chunk`, copying everything read so far per chunk: measured on one host
(nats-server 2.15.1, 128 KiB chunks, an unsecured loopback server), 16 MiB in 1.1 s, 32 MiB in
4.0 s, 64 MiB in 12.3 s, 128 MiB in 38 s, 256 MiB in 172 s (1.5 MiB/s): quadratic, 3-4.5x the
time per 2x the size, where the put of 256 MiB takes 0.8 s. This reader fetches 256 MiB in
0.72 s (355 MiB/s; secure server, 512 KiB chunks) where `get()` of the same object takes 41 s
(`python -m bench --only weight_transfer`, docs/benchmarks.md).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO

import nats.errors
import nats.js.errors
from nats.js.api import ObjectInfo, ObjectMeta, ObjectMetaOptions, ObjectStoreConfig, StorageType
from nats.js.object_store import OBJ_STREAM_TEMPLATE, ObjectStore

from asyncrl.errors import BadRequest, Conflict
from asyncrl.fingerprint import differs, read_manifest
from asyncrl.natsutil import WEIGHTS_BUCKET, iter_stored
from asyncrl.retry import jetstream_call
from asyncrl.settings import settings
from asyncrl.weights import WeightReceiver, prune

SCHEME = "nats-obj://"
MANIFEST = "manifest.json"
CONTENT_KEY = ".nats-manifest-digest"
"""In a cached version directory: the digest of the manifest it was fetched by (its key)."""
LINEAGE_KEY = ".nats-fingerprint"
"""In a cached version directory: the weights' fingerprint its manifest named (its lineage)."""
CHUNK_SIZE = 512 * 1024
"""Bytes per chunk message: under nats-server's default max_payload (1 MiB); 4x nats-py's
default, so a version is a quarter as many messages to publish, hash and write."""
CHUNK_TIMEOUT_S = 30.0
"""A fetch fails when no chunk came for this long (the server or the route is gone)."""
CACHE_KEEP = 3
"""Versions a rollout keeps in its cache per experiment: the one it serves, the one it is
reading, and one more for a retry that names the previous one."""
_VERSION = re.compile(r"^v\d{6,}$")


class WeightsFetchError(Conflict):
    """The version `uri` names cannot be had whole (missing, pruned, corrupted, or no chunk came
    in time); `reason` says why. A Conflict: FAILED_PRECONDITION with this message, so the
    scheduler's log says which version and why."""

    def __init__(self, uri: str, reason: str):
        super().__init__(f"{uri}: {reason}")
        self.uri = uri
        self.reason = reason


def is_nats_uri(uri: str) -> bool:
    return uri.startswith(SCHEME)


def version_prefix(experiment_id: str, version: int) -> str:
    """`<experiment>/v000123`: the version's object names start with it (as in the file store)."""
    return f"{experiment_id}/v{version:06d}"


def version_uri(experiment_id: str, version: int, bucket: str = WEIGHTS_BUCKET) -> str:
    return f"{SCHEME}{bucket}/{version_prefix(experiment_id, version)}"


def parse_uri(uri: str) -> tuple[str, str]:
    """(bucket, `<experiment>/v000123`) of a `nats-obj://` URI."""
    bucket, _, prefix = uri.removeprefix(SCHEME).partition("/")
    experiment, _, version = prefix.partition("/")
    if not is_nats_uri(uri) or not bucket or not experiment or not _VERSION.match(version):
        raise BadRequest("uri", f"not nats-obj://<bucket>/<experiment>/v000123: {uri}")
    return bucket, prefix


async def weights_bucket(js, bucket: str = WEIGHTS_BUCKET):
    """The bucket, created when missing (file storage, `settings().nats_replicas`)."""
    try:
        return await js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        config = ObjectStoreConfig(storage=StorageType.FILE, replicas=settings().nats_replicas)
        return await js.create_object_store(bucket, config)


# -- the trainer's side ------------------------------------------------------------------------
async def upload_version(
    js, src_dir: Path, experiment_id: str, version: int, bucket: str = WEIGHTS_BUCKET
) -> str:
    """Every file of the version directory `src_dir` as an object, the manifest last; returns
    the version's URI. Uploading a version again replaces it (a resumed trainer does)."""
    obs = await weights_bucket(js, bucket)
    prefix = version_prefix(experiment_id, version)
    files = sorted(p for p in Path(src_dir).iterdir() if p.is_file())
    options = ObjectMetaOptions(max_chunk_size=CHUNK_SIZE)
    digests = {}
    for path in files:
        with path.open("rb") as f:  # nats-py reads it in a worker thread, chunk by chunk
            meta = ObjectMeta(name=f"{prefix}/{path.name}", options=options)
            digests[path.name] = (await obs.put("", f, meta=meta)).digest
    manifest = {
        "files": {p.name: p.stat().st_size for p in files},
        "digests": digests,  # each file's SHA-256: the manifest's own digest keys its content
        "fingerprint": read_manifest(Path(src_dir)),
    }
    await obs.put(f"{prefix}/{MANIFEST}", json.dumps(manifest).encode())
    return version_uri(experiment_id, version, bucket)


async def uploaded(js, experiment_id: str, version: int, bucket: str = WEIGHTS_BUCKET) -> bool:
    """Whether the bucket holds `version` whole (its manifest is there)."""
    obs = await weights_bucket(js, bucket)
    try:
        await obs.get_info(f"{version_prefix(experiment_id, version)}/{MANIFEST}")
    except nats.js.errors.ObjectNotFoundError:
        return False
    return True


async def list_objects(js, bucket: str = WEIGHTS_BUCKET) -> list[ObjectInfo]:
    """The objects in the bucket, from their metadata messages (one per object, the newest:
    a put or delete rolls the subject up) read one by one: no consumer, and no stream lookup by
    subject (nats-py's `ObjectStore.list()` does both)."""
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    infos = [
        ObjectInfo.from_response(json.loads(msg.data))
        async for msg in iter_stored(js, stream, f"$O.{bucket}.M.>")
    ]
    return [i for i in infos if not i.deleted]


async def prune_versions(
    js,
    experiment_id: str,
    keep: int,
    bucket: str = WEIGHTS_BUCKET,
    newest: int | None = None,
    protect: int | None = None,
) -> None:
    """Delete all but the newest `keep` versions of an experiment from the bucket, each one's
    manifest first (a reader then finds it gone rather than partial). `newest`: the version
    just uploaded; those above it are an abandoned lineage, deleted (`asyncrl.weights.prune`).
    `protect`: a version never deleted for the count (the run's final one)."""
    obs = await weights_bucket(js, bucket)
    by_version: dict[str, list[str]] = {}
    for info in await list_objects(js, bucket):
        experiment, _, rest = info.name.partition("/")
        version, _, _ = rest.partition("/")
        if experiment == experiment_id and _VERSION.match(version):
            by_version.setdefault(version, []).append(info.name)
    ordered = sorted(by_version)
    abandoned = [v for v in ordered if newest is not None and int(v[1:]) > newest]
    ordered = [v for v in ordered if v not in abandoned]
    old = [v for v in ordered[:-keep] if protect is None or v != f"v{protect:06d}"]
    for version in abandoned + old:
        names = sorted(by_version[version], key=lambda n: not n.endswith(f"/{MANIFEST}"))
        for name in names:
            await obs.delete(name)


# -- the rollout's side ------------------------------------------------------------------------
async def read_object(js, bucket: str, name: str, dest: BinaryIO, uri: str) -> ObjectInfo:
    """Write object `name` into `dest` chunk by chunk as the chunks arrive (an ordered consumer
    on its chunk subject), checking its size and SHA-256 against its info. A missing object
    raises nats-py's ObjectNotFoundError."""
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    obs = ObjectStore(bucket, stream, js)
    info = await obs.get_info(name)
    digest, size = hashlib.sha256(), 0
    if info.size:
        sub = await js.subscribe(f"$O.{bucket}.C.{info.nuid}", stream=stream, ordered_consumer=True)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=CHUNK_TIMEOUT_S)
                except nats.errors.TimeoutError:
                    raise WeightsFetchError(
                        uri, f"{name}: no chunk for {CHUNK_TIMEOUT_S:.0f} s after {size} bytes"
                    ) from None
                dest.write(msg.data)
                digest.update(msg.data)
                size += len(msg.data)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
    want = base64.urlsafe_b64decode(info.digest.partition("=")[2])
    if size != info.size or digest.digest() != want:
        raise WeightsFetchError(
            uri, f"{name}: {size} bytes read, not the {info.size} bytes and digest of its info"
        )
    return info


def cached_key(version_dir: Path) -> str:
    """The content key of a cached version directory ("" for none, or one cached before keys)."""
    try:
        return (Path(version_dir) / CONTENT_KEY).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return ""


async def _manifest_info(js, bucket: str, prefix: str, uri: str, cached: bool) -> ObjectInfo | None:
    """The info of the version's manifest, None when the bucket no longer has the version but
    the cache does (pruned since: the cached copy is served, as it always was)."""
    try:
        obs = await js.object_store(bucket)
        return await obs.get_info(f"{prefix}/{MANIFEST}")
    except nats.js.errors.BucketNotFoundError:
        if cached:
            return None
        raise WeightsFetchError(uri, f"no bucket {bucket!r}") from None
    except nats.js.errors.ObjectNotFoundError:
        if cached:
            return None
        raise WeightsFetchError(uri, "no such version (not uploaded, or pruned)") from None


async def fetch_version(
    js, uri: str, cache_root: Path, keep: int = CACHE_KEEP, fingerprint: str = ""
) -> Path:
    """The version `uri` names as a local directory under `cache_root`, fetched unless the
    cache has it with the content the bucket has now; the cache keeps the experiment's newest
    `keep` versions.

    The cache is keyed by content, not by the version number alone: a trainer resumed from an
    older checkpoint publishes the versions after it again with other weights, and a rollout
    that cached the abandoned lineage's v000123 must not load those bytes as the new one's.
    The key is the digest of the version's manifest (which holds every file's SHA-256), written
    as `CONTENT_KEY` in the cached directory: one object-info request per cache hit.

    When the bucket no longer has the version, the cached copy is served only if it is of the
    lineage asked for: `fingerprint` (the one committed with the version; "" unknown) differs
    from the cached copy's own, and the copy is an abandoned lineage's (cached before a
    rewind): it is dropped, and the fetch fails naming both."""
    bucket, prefix = parse_uri(uri)
    final = Path(cache_root) / prefix
    info = await _manifest_info(js, bucket, prefix, uri, cached=final.is_dir())
    if info is None:
        return _cached_of_lineage(final, fingerprint, uri)
    if cached_key(final) == info.digest:
        return final
    manifest = io.BytesIO()
    try:
        info = await read_object(js, bucket, f"{prefix}/{MANIFEST}", manifest, uri)
    except nats.js.errors.ObjectNotFoundError:
        raise WeightsFetchError(uri, "no such version (not uploaded, or pruned)") from None
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        await _read_files(js, bucket, prefix, json.loads(manifest.getvalue()), tmp, uri)
        (tmp / CONTENT_KEY).write_text(info.digest)
        (tmp / LINEAGE_KEY).write_text(json.loads(manifest.getvalue()).get("fingerprint", ""))
        _install(tmp, final, info.digest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune(Path(cache_root), prefix.partition("/")[0], keep=keep, protect=final)
    return final


def _cached_of_lineage(final: Path, fingerprint: str, uri: str) -> Path:
    """`final`, the cached copy of a version the bucket no longer has, unless its weights are
    not `fingerprint`'s (then it is removed: WeightsFetchError)."""
    try:
        cached = (final / LINEAGE_KEY).read_text()
    except FileNotFoundError:
        cached = read_manifest(final)
    if not differs(cached, fingerprint):
        return final
    stale = final.parent / f".stale-{final.name}-{uuid.uuid4().hex[:8]}"
    with contextlib.suppress(FileNotFoundError):
        os.replace(final, stale)
    shutil.rmtree(stale, ignore_errors=True)
    raise WeightsFetchError(
        uri,
        f"not in the bucket, and the cached copy is of another lineage (fingerprint {cached}, "
        f"not {fingerprint}): dropped",
    )


async def _read_files(js, bucket: str, prefix: str, manifest: dict, dest: Path, uri: str) -> None:
    """Every file the manifest names into `dest`, each checked against the manifest's digest
    for it (a version published again while it was read is a mix of two: refused)."""
    digests = manifest.get("digests", {})  # absent in a manifest from before content keys
    for name in manifest["files"]:
        with (dest / name).open("wb") as f:
            try:
                info = await read_object(js, bucket, f"{prefix}/{name}", f, uri)
            except nats.js.errors.ObjectNotFoundError:
                raise WeightsFetchError(uri, f"{name} is missing (pruned meanwhile?)") from None
        if digests.get(name, info.digest) != info.digest:
            raise WeightsFetchError(uri, f"{name} changed while read (published again?)")


def _install(tmp: Path, final: Path, key: str) -> None:
    """Rename the fetched `tmp` into place as `final`, replacing a cached copy of other content
    (an abandoned lineage's); one of the same content (another rollout on this host, same cache,
    put it there first) is kept."""
    if final.is_dir():
        if cached_key(final) == key:
            return
        stale = final.parent / f".stale-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.replace(final, stale)
        except FileNotFoundError:
            pass  # another rollout moved it first
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:
        if cached_key(final) != key:
            raise


class NatsReceiver(WeightReceiver):
    """A `nats-obj://` version fetched into `cache_root` (unless there already), retried for
    `retry_s` while NATS is away (idempotent: a temporary directory renamed into place); any
    other URI is a local path, as `WeightReceiver` reads it."""

    def __init__(self, js, cache_root: Path, retry_s: float):
        self.js, self.cache_root, self.retry_s = js, Path(cache_root), retry_s

    async def receive(self, version: int, uri: str, fingerprint: str = "") -> Path:
        if not is_nats_uri(uri):
            return await super().receive(version, uri, fingerprint)
        return await jetstream_call(
            lambda: fetch_version(self.js, uri, self.cache_root, fingerprint=fingerprint),
            self.retry_s,
        )
