"""What a rollout serves: the experiments bound to it (`Binding`, as BindExperiment sent them)
and the weights it holds for each (`Loaded`), changed only by BindExperiment and UpdateWeights.

A rollout serves one experiment, or several LoRA experiments on one base at once (the
scheduler's pool, services/scheduler/sharing.py) on an engine that `shares_adapters`: each is
bound and loaded apart (its tokenizer, its engine lane, its versions' fingerprints), and its
UpdateWeights moves its own lane only. Binding anything else (a full-parameter experiment,
another base) aborts them all. A version is read in place from a path, or fetched from the
NATS object store into this host's cache first (`NatsReceiver`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from prometheus_client import Histogram

from asyncrl.errors import BadRequest, Conflict
from asyncrl.fingerprint import differs
from asyncrl.logging import get_logger
from asyncrl.natsutil import check_experiment_id
from asyncrl.net import check_address
from asyncrl.runtime import freeze_heap
from asyncrl.settings import settings
from asyncrl.spec import ExperimentSpec, SamplingParams, SpecError, spec_from_json
from asyncrl.weights_nats import NatsReceiver, is_nats_uri
from asyncrl.workflow import Workflow, make_workflow, resolve_workflow
from services.rollout.adapters import is_adapter_dir
from services.rollout.codec import Codec
from services.rollout.engine import Engine, UpdatePhases
from services.rollout.reward_client import RewardBinding
from services.rollout.running import RunningGroups

log = get_logger(component="rollout")
SERVED_KEEP = 64
"""Versions behind the served one whose fingerprints are kept to stamp groups with."""


@dataclass(frozen=True)
class Binding:
    """The experiment this rollout serves, as BindExperiment sent it (once per binding)."""

    experiment_id: str
    spec: ExperimentSpec
    spec_json: str
    """The spec as sent: forwarded to reward workers when they bind."""
    workflow_cls: type[Workflow]

    @classmethod
    def create(cls, experiment_id: str, spec_json: str) -> Binding:
        """Validate the spec and load its workflow (a plugin is imported here, once);
        SpecError names what is wrong."""
        check_experiment_id(experiment_id)  # its groups' subjects
        spec = spec_from_json(spec_json)
        wf = spec.rollout.workflow
        try:
            make_workflow(wf.name, wf.args)
        except ValueError as e:
            raise SpecError("rollout.workflow", str(e)) from None
        return cls(experiment_id, spec, spec_json, resolve_workflow(wf.name))

    def workflow(self) -> Workflow:
        return self.workflow_cls(**self.spec.rollout.workflow.args)

    def n(self, eval_group: bool) -> int:
        return self.spec.eval.n_samples if eval_group else self.spec.rollout.n_samples

    def params(self, eval_group: bool) -> SamplingParams:
        return self.spec.eval.gconfig if eval_group else self.spec.rollout.gconfig

    def filter(self, eval_group: bool) -> str:
        return "none" if eval_group else self.spec.rollout.filter

    @property
    def rewards(self) -> RewardBinding:
        return RewardBinding(self.experiment_id, self.spec_json, self.spec.reward.timeout_s)


@dataclass
class Loaded:
    """An experiment whose weights this rollout serves."""

    codec: Codec
    lane: str
    """Its adapter lane in the engine (its id), "" when it has the engine to itself."""
    served: dict[int, str] = field(default_factory=dict)
    """Version -> the fingerprint of what the engine held (stamped onto samples)."""

    def serve(self, version: int, fingerprint: str) -> None:
        """The lane serves `version` now, holding weights of `fingerprint`."""
        self.served[version] = fingerprint
        for old in [v for v in self.served if v < version - SERVED_KEEP]:
            del self.served[old]  # a sample this stale is dropped: "" (unverified) at worst


def shares_base(a: ExperimentSpec, b: ExperimentSpec) -> bool:
    """Whether two experiments can share a rollout: both LoRA, on the same base and tokenizer."""
    lora = a.trainer.lora is not None and b.trainer.lora is not None
    return lora and (a.model.path, a.model.tokenizer_path) == (b.model.path, b.model.tokenizer_path)


def _weights_dir(path: Path) -> bool:
    """Whether `path` holds a LoRA adapter (the base is the spec's model) rather than a whole
    model; BadRequest naming `uri` when it holds neither or cannot be read."""
    try:
        if is_adapter_dir(path):
            return True
        if (path / "config.json").is_file():
            return False
    except OSError as e:  # a name too long, a file where a directory was meant
        raise BadRequest("uri", f"cannot read {str(path)[:200]!r}: {e.strerror}") from None
    raise BadRequest("uri", f"no HuggingFace config.json in {str(path)[:200]}")


async def engine_update(engine: Engine, binding: Binding, lane: str, path: Path, version: int):
    """`engine.update_weights` to `version` at `path`, in the experiment's lane when it has one
    (eta + 1 of its adapter versions stay loaded); how many requests it moved."""
    if not lane:
        return await engine.update_weights(str(path), version)
    keep = binding.spec.rollout.max_head_offpolicyness + 1
    return await engine.update_weights(str(path), version, lane=lane, keep=keep)


async def stored(path: Path, timeout_s: float) -> None:
    """Wait until a version's store copy is in place (a `broadcast` version is written beside
    its broadcast, so a rollout that falls back or joins may be there first)."""
    deadline = time.monotonic() + timeout_s
    while not (path / "config.json").is_file() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


WEIGHTS_CACHE = "weights-cache"
"""Where, under `settings().var`, a rollout keeps the versions it fetched from NATS."""
FETCH_RETRY_S = 20.0
"""How long fetching a version rides out NATS being away (this host's node catching up after
it was cut off answers 503 for a few seconds) before UpdateWeights fails."""
UPDATE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class WeightsResult:
    version: int
    seconds: float
    interrupted: int
    phases: UpdatePhases = field(default_factory=UpdatePhases)
    fingerprint: str = ""
    """Of the weights the experiment's lane holds now (what the scheduler checks)."""
    """Where an interrupting update's time went (zeros for a first load or a retry, but for
    the fetch of a `nats-obj://` version, in `read_s`)."""


class Serving:
    """The bound experiments and their loaded weights, one lock over both (a bind and an
    update never interleave)."""

    def __init__(
        self,
        engine: Engine,
        engine_kind: str,
        js,
        groups: RunningGroups,
        weights_cache: Path | None = None,
    ):
        self.engine = engine
        self.engine_kind = engine_kind
        self.groups = groups
        """The rollout's running groups: a bind that replaces the experiments aborts them."""
        self.bindings: dict[str, Binding] = {}
        """The experiments bound (several: LoRA ones sharing the base), as they were sent."""
        self.loaded: dict[str, Loaded] = {}
        """The bound experiments whose weights are loaded (set by their first UpdateWeights)."""
        self._lock = asyncio.Lock()
        self.weights_cache = weights_cache or settings().var / WEIGHTS_CACHE
        """This host's copies of the `nats-obj://` versions it loaded (a few, the newest)."""
        self.receiver = NatsReceiver(js, self.weights_cache, retry_s=FETCH_RETRY_S)
        """The rollout's side of the weights transport (services/trainer/transport.py)."""
        self.streams = None
        """`broadcast` experiments: the rollout's `BroadcastReceiver` (made on first use)."""
        self.update_seconds = Histogram(
            "asyncrl_rollout_weight_update_seconds",
            "UpdateWeights by phase: read, pause, load, resume, and the whole call (total)",
            ["experiment", "phase"],
            buckets=UPDATE_BUCKETS,
            registry=None,  # rendered by this service's collector, never the global registry
        )

    async def bind(self, experiment_id: str, spec_json: str) -> None:
        """Serve `experiment_id` from now on (its model loads with the next UpdateWeights):
        beside the bound ones if all are LoRA on its base (`shares_base`) and the engine
        shares adapters; else instead of them, their groups aborted."""
        binding = Binding.create(experiment_id, spec_json)
        if binding.spec.rollout.engine != self.engine_kind:
            raise Conflict(
                f"rollout.engine: this rollout worker runs the {self.engine_kind!r} engine, "
                f"the experiment asks for {binding.spec.rollout.engine!r}"
            )
        async with self._lock:
            others = [e for e in self.bindings if e != experiment_id]
            beside = not others or (
                self.engine.shares_adapters
                and all(shares_base(self.bindings[e].spec, binding.spec) for e in others)
            )
            if not beside:
                previous = ",".join(self.bindings)
                self.bindings.clear()
                self.loaded.clear()  # no groups until loaded
                if self.streams is not None:  # its group, staging sets and the trainer's files
                    self.streams.close()
                    self.streams = None
                await self.groups.abort_all(
                    f"aborted: rollout switched from experiment {previous!r} to {experiment_id!r}"
                )
            self.bindings[experiment_id] = binding
        log.info("experiment_bound", experiment=experiment_id, beside=others if beside else [])

    async def update_weights(
        self, experiment_id: str, version: int, uri: str, fp: str = "", group=(0, 0), store=""
    ) -> WeightsResult:
        """First load of a bound experiment (model + tokenizer, or its lane on the shared
        base), or an interrupting weight update of its lane (again if it holds other weights
        than fingerprint `fp`). Another experiment's requests are not touched. `group`: this
        rollout's rank and the rollouts' count in a `broadcast` experiment's weight group (0, 0:
        load from `uri`), meeting at `store` (host:port; the spec's `trainer.nccl_master`
        wins)."""
        binding = self.bindings.get(experiment_id)
        if binding is None:
            raise Conflict(
                f"experiment_id: this rollout is bound to {','.join(self.bindings) or 'nothing'!r},"
                f" not {experiment_id!r} (BindExperiment first)"
            )
        if version < 0:
            raise BadRequest("version", f"{version} is negative")
        if not uri:
            raise BadRequest("uri", "required")
        if store:
            check_address("broadcast_store", store)
        start = time.perf_counter()
        async with self._lock:
            loaded = self.loaded.get(experiment_id)
            moved = None
            if loaded is not None and group[1] and binding.spec.trainer.weight_sync == "broadcast":
                moved = await self._streamed(binding, version, uri, group, store)
            if moved is None:
                loaded, moved = await self._from_uri(binding, loaded, version, uri, fp)
            interrupted, phases = moved
            now = self.engine.version_of(loaded.lane)
            loaded.serve(now, self.engine.fingerprint_of(loaded.lane))
        seconds = time.perf_counter() - start
        self.update_seconds.labels(experiment_id, "total").observe(seconds)
        log.info(
            "weights_updated",
            experiment=experiment_id,
            version=version,
            uri=uri,
            interrupted=interrupted,
            seconds=round(seconds, 3),
            **{k: round(v, 4) for k, v in asdict(phases).items()},
        )
        return WeightsResult(now, seconds, interrupted, phases, loaded.served[now])

    async def _from_uri(self, binding: Binding, loaded: Loaded | None, version, uri, fp):
        """The version read from `uri` (fetched first from NATS): ((interrupted, phases))."""
        phases = UpdatePhases()
        if self.streams is not None:  # the engine's weights may be a staging set: written now
            self.streams.staging.forget()
        path, fetch_s = await self._local_dir(version, uri, fp)
        if binding.spec.trainer.weight_sync == "broadcast":  # its store copy may be on its way
            await stored(path, binding.spec.rollout.weight_update_timeout_s)
        adapter = _weights_dir(path)  # a LoRA version: the base is the spec's model
        if loaded is None:
            loaded = await self._load(binding, path, version, adapter)
            interrupted = 0  # nothing of this experiment ran before
        elif version == self.engine.version_of(loaded.lane) and not differs(
            fp, self.engine.fingerprint_of(loaded.lane)
        ):
            interrupted = 0  # a retried UpdateWeights: already served
        else:
            interrupted = await engine_update(self.engine, binding, loaded.lane, path, version)
            phases = self.engine.last_update
        if fetch_s or phases is self.engine.last_update:  # fetched, or an engine update
            phases = replace(phases, read_s=phases.read_s + fetch_s)  # fetched, then read
            self._observe(binding.experiment_id, phases)
        return loaded, (interrupted, phases)

    async def _streamed(self, binding: Binding, version: int, uri: str, group, store: str):
        """The version received by broadcast over the group meeting at `store` (the spec's
        `trainer.nccl_master` when set) and applied ((interrupted, phases)), or None when it
        did not come that way or not intact (then it is read from the store)."""
        from services.rollout.broadcast_receiver import BroadcastReceiver, Mismatch, Unavailable

        spec = binding.spec
        master = spec.trainer.nccl_master or store
        if not master:  # a scheduler that has not heard the trainer's commit since it started
            log.warning("broadcast_not_taken", version=version, reason="no store", then="store")
            return None
        if self.streams is None:
            self.streams = BroadcastReceiver(getattr(self.engine, "device", "cpu"))
        timeout = spec.rollout.weight_update_timeout_s / 2
        try:
            got = await asyncio.to_thread(
                self.streams.receive,
                binding.experiment_id,
                master,
                version,
                *group,
                timeout,
            )
        except (Unavailable, Mismatch) as exc:
            log.warning("broadcast_not_taken", version=version, reason=str(exc), then="store")
            return None
        path = await self.receiver.receive(version, uri)  # where it is (or will be) stored
        interrupted = await self.engine.apply_state(
            str(path), version, got.state, got.fingerprint, got.seconds
        )
        log.info(
            "weights_streamed",
            version=version,
            bytes=got.nbytes,
            moved=got.moved,
            delta=got.delta,
            seconds=got.seconds,
        )
        self._observe(binding.experiment_id, self.engine.last_update)
        return interrupted, self.engine.last_update

    async def _local_dir(self, version: int, uri: str, fp: str) -> tuple[Path, float]:
        """The version's directory on this host (`self.receiver`; of fingerprint `fp`'s
        lineage) and the seconds it took to fetch it (0 for a path read in place)."""
        t0 = time.perf_counter()
        path = await self.receiver.receive(version, uri, fp)
        if not is_nats_uri(uri):
            return path, 0.0  # read in place: nothing was fetched
        seconds = time.perf_counter() - t0
        log.info("weights_fetched", uri=uri, path=str(path), seconds=round(seconds, 3))
        return path, seconds

    def _observe(self, experiment_id: str, phases: UpdatePhases) -> None:
        for name, seconds in asdict(phases).items():
            self.update_seconds.labels(experiment_id, name.removesuffix("_s")).observe(seconds)

    async def _load(self, binding: Binding, path: Path, version: int, adapter: bool) -> Loaded:
        """The experiment's first version: the model (a LoRA one: the base from the spec, once
        for every experiment sharing it, then its version in its own lane) and tokenizer."""
        from transformers import AutoTokenizer

        model = binding.spec.model
        tokenizer = await asyncio.to_thread(
            AutoTokenizer.from_pretrained, model.tokenizer_path or model.path
        )
        if binding.spec.rollout.workflow.chat_template and not tokenizer.chat_template:
            raise SpecError("rollout.workflow.chat_template", "the tokenizer has no chat template")
        lora = binding.spec.trainer.lora
        lane = binding.experiment_id if lora is not None and self.engine.shares_adapters else ""
        if not lane or not any(other.lane for other in self.loaded.values()):
            keep = binding.spec.rollout.max_head_offpolicyness + 1  # adapter versions kept
            self.engine.serve_lora(lora, keep)
            base = Path(model.path) if adapter else path  # no lane holds the base yet
            await self.engine.load(str(base), 0 if adapter else version)
        if lane or adapter:
            await engine_update(self.engine, binding, lane, path, version)
        loaded = self.loaded[binding.experiment_id] = Loaded(Codec(tokenizer), lane)
        freeze_heap()  # the model and tokenizer: never scanned by the collector again
        log.info("experiment_loaded", experiment=binding.experiment_id, version=version, lane=lane)
        return loaded

    @property
    def experiment_ids(self) -> str:
        """The experiments whose weights are loaded, comma-separated ("" none)."""
        return ",".join(self.loaded)

    @property
    def tokenizer(self):
        """The loaded model's tokenizer (None until one is loaded; the experiments sharing the
        base share it)."""
        return next(iter(self.loaded.values())).codec.tokenizer if self.loaded else None
