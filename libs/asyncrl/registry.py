"""The named choices of an experiment spec, each mapped to the code that implements it.

One table per choice; the spec's `Literal` types are derived from these names, and services
build the chosen implementation with `load`, which imports it only then (a torch-only
machine never imports the SGLang adapter, a torch trainer never imports megatron-core).

    ENGINES.names                      # ("torch", "sglang")
    ENGINES.load("torch")(seed=0)      # services.rollout.torch_engine.TorchEngine(seed=0)

A user's own code is named the same way, `dotted.module.path:attribute` (`PLUGIN_NAME`): a
workflow as `rollout.workflow.name`, a reward function after `plugin:` in `reward.function`.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Literal

from asyncrl.errors import SpecError

PLUGIN_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
"""`dotted.module.path:attribute`, identifiers only: how a plugin is named."""


def is_plugin_name(name: str) -> bool:
    """Whether `name` is a plugin's name (by syntax: nothing is imported)."""
    return PLUGIN_NAME.fullmatch(name) is not None


def import_object(path: str) -> Any:
    """The object `module:attribute` names (`attribute` may be dotted), imported now; the
    import's or getattr's own error otherwise."""
    module, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry:
    """Names of one spec field's choices -> `module:attribute` of their implementation."""

    def __init__(self, field: str, entries: dict[str, str]):
        self.field = field
        self.entries = dict(entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def literal(self) -> Any:
        """`Literal[...]` of the names, for a pydantic field."""
        return Literal[self.names]

    def load(self, name: str) -> Any:
        """The implementation of `name` (imported now); SpecError naming the field if unknown."""
        if name not in self.entries:
            raise SpecError(self.field, f"unknown {name!r} (one of {', '.join(self.names)})")
        return import_object(self.entries[name])


ENGINES = Registry(
    "rollout.engine",
    {
        "torch": "services.rollout.torch_engine:TorchEngine",
        "sglang": "services.rollout.sglang_engine:SGLangEngine.from_options",
    },
)
"""Inference engines of the rollout service; called with the engine's flat options."""

FILTERS = Registry(
    "rollout.filter",
    {
        "none": "services.rollout.filters:keep_all",
        "nonconstant_reward": "services.rollout.filters:nonconstant_reward",
    },
)
"""Dynamic filters: fn(OK rewards) -> a rejection reason, or "" to accept."""

TRAINER_BACKENDS = Registry(
    "trainer.backend",
    {
        "megatron": "services.trainer.backends.megatron_backend:MegatronBackend",
        "torch": "services.trainer.backends.torch_backend:TorchBackend",
    },
)
"""Trainer backends; called with the validated ExperimentSpec."""

WORKFLOWS = Registry(
    "rollout.workflow.name",
    {
        "single_turn": "asyncrl.workflow:SingleTurn",
        "multi_turn": "asyncrl.workflow:MultiTurn",
    },
)
"""Built-in workflows; `module:Class` names a plugin (a Workflow subclass)."""
