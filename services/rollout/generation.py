"""The engine as a workflow sees it: requests carry the stop ids, completions come back with
their text decoded, and every generated token is counted in the rollout's throughput."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.spec import SamplingParams
from asyncrl.throughput import Throughput
from asyncrl.types import Completion, Sample
from services.rollout.codec import Codec
from services.rollout.engine import Engine, GenRequest


@dataclass(frozen=True)
class Generation:
    """One loaded model's generation: its engine and tokenizer (a group keeps the ones it
    started with)."""

    engine: Engine
    codec: Codec
    throughput: Throughput
    lane: str = ""
    """The engine lane its requests sample in (a LoRA experiment sharing the base)."""

    @property
    def tokenizer(self) -> Any:
        return self.codec.tokenizer

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams) -> Completion:
        """One completion, its text decoded (a workflow's `ctx.generate`)."""
        completion = await self.engine.generate(self.request(rid, input_ids, params))
        return self.decoded(completion)

    async def generate_many(
        self, requests: list[tuple[str, list[int], SamplingParams]]
    ) -> list[Completion]:
        """Several completions in one engine call (`asyncrl.workflow.generate_all`)."""
        completions = await self.engine.generate_many([self.request(*r) for r in requests])
        return [self.decoded(c) for c in completions]

    def request(self, rid: str, input_ids: list[int], params: SamplingParams) -> GenRequest:
        return GenRequest(
            rid=rid,
            input_ids=input_ids,
            params=params,
            stop_token_ids=self.stops(params),
            decode=self.decode,
            lane=self.lane,
        )

    def decoded(self, completion: Completion) -> Completion:
        self.throughput.add(len(completion.output_ids))
        completion.text = self.decode(completion.output_ids)
        return completion

    def decode(self, token_ids: list[int]) -> str:
        return self.codec.decode(token_ids)

    def stops(self, params: SamplingParams) -> list[int]:
        """The token ids that end a sample: the spec's, and EOS unless `ignore_eos`."""
        eos = self.codec.eos_token_id
        if eos is None or params.ignore_eos:
            return list(params.stop_token_ids)
        return [*params.stop_token_ids, eos]

    def fill_text(self, samples: list[Sample]) -> None:
        """What to score when a workflow left `text` empty: the policy's tokens, decoded."""
        for sample in samples:
            if sample.text:
                continue
            ids = sample.output_ids
            if sample.loss_mask and not all(sample.loss_mask):
                ids = [t for t, m in zip(ids, sample.loss_mask, strict=True) if m]
            sample.text = self.decode(ids)
