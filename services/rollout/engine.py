"""The inference-engine contract behind the rollout service (torch embedded, or SGLang).

An engine serves one model at a time. `generate` returns a *complete* sample, an
`asyncrl.types.Completion` (its `text` left to the service): when a weight update interrupts
it, the engine continues from the partial output under the new version and records, per token,
the version that produced it (and counts the interruption). Cancelling the `generate` coroutine
aborts the request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.spec import LoraSpec, SamplingParams
from asyncrl.types import Completion
from asyncrl.workflow import run_together


@dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    stop_token_ids: list[int] = field(default_factory=list)  # EOS etc., added by the service
    decode: Callable[[list[int]], str] | None = None  # for `params.stop` strings (torch engine)
    lane: str = ""
    """The adapter lane (an experiment sharing the engine's base) that samples it; "" the
    engine's own weights (`Engine.shares_adapters`)."""


@dataclass(frozen=True)
class UpdatePhases:
    """Where one `update_weights` call's time went, in seconds (0 for a phase an engine does
    not have)."""

    read_s: float = 0.0
    """Reading the version from the weight store while generation goes on."""
    pause_s: float = 0.0
    """Until generation stopped at a token boundary (SGLang: pause, then the aborted requests'
    partial answers)."""
    load_s: float = 0.0
    """The weights into the model while generation is stopped."""
    resume_s: float = 0.0
    """Until generation runs again."""


class Engine(ABC):
    name: str = "engine"
    last_update: UpdatePhases = UpdatePhases()
    """The phases of the last `update_weights` (an engine sets a new one per update)."""
    fingerprint: str = ""
    """The fingerprint (`asyncrl.fingerprint`) of the weights the engine holds, computed over
    what it loaded: set only where they were actually applied, so an update that reports
    success without applying them shows. "" where the engine cannot tell (unverified)."""
    adapter_keep: int = 2
    """LoRA: how many adapter versions stay loaded (the bound experiment's eta + 1)."""
    device_name: str = ""
    """Where it generates, as `asyncrl workers` shows it ("cpu", "cuda:0 = GPU 4 (...)")."""
    shares_adapters: bool = False
    """Whether it serves several LoRA experiments on its one base at once, each in its own
    lane (`update_weights(..., lane=)`, `GenRequest.lane`): the torch engine does."""

    def serve_lora(self, lora: LoraSpec | None, keep: int) -> None:
        """Called before `load`: the experiment trains `lora` adapters (None: full-model
        versions), and `keep` adapter versions stay loaded."""
        self.adapter_keep = keep

    @property
    @abstractmethod
    def version(self) -> int:
        """The policy version currently served."""

    def version_of(self, lane: str) -> int:
        """The version `lane` serves (an engine without lanes: `version`)."""
        return self.version

    def fingerprint_of(self, lane: str) -> str:
        """The fingerprint of what `lane` serves (an engine without lanes: `fingerprint`)."""
        return self.fingerprint

    @abstractmethod
    async def start(self) -> None:
        """Start background machinery (batching loop, child server)."""

    @abstractmethod
    async def stop(self) -> None: ...

    @abstractmethod
    async def load(self, model_dir: str, version: int) -> None:
        """Load a model (first load or switch of experiment); no request may be in flight."""

    @abstractmethod
    async def update_weights(self, model_dir: str, version: int) -> int:
        """Interrupt in-flight requests at a token boundary, swap weights, resume them.
        Returns how many requests were interrupted."""

    @abstractmethod
    async def generate(self, req: GenRequest) -> Completion: ...

    async def generate_many(self, reqs: list[GenRequest]) -> list[Completion]:
        """The outputs of `reqs` (a group's samples), in order, generated concurrently as
        `generate` would: cancelling aborts every request; the first failure aborts the others
        and is raised. Here, one task per request; an engine that can take a batch at once
        overrides it (a group is then one call, not n tasks)."""
        return await run_together([self.generate(req) for req in reqs])

    @property
    def running(self) -> int:
        return 0

    def stats(self) -> dict[str, float]:
        """Cumulative counters of the engine's work (name: value), for /metrics; empty where
        the engine keeps none."""
        return {}
