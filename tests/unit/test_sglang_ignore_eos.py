"""`SamplingParams.ignore_eos` reaches SGLang's sampling params."""

from __future__ import annotations

from asyncrl.spec import SamplingParams
from services.rollout.engine import GenRequest
from services.rollout.sglang_engine import generate_body


def test_generate_body_ignore_eos_passed_through_default_false():
    plain = generate_body(GenRequest("r", [1, 2], SamplingParams()), "r", [], [2])
    assert plain["sampling_params"]["ignore_eos"] is False
    params = SamplingParams(ignore_eos=True, max_new_tokens=10)
    body = generate_body(GenRequest("r", [1, 2], params), "r/r1", [5, 6], [])
    assert body["sampling_params"]["ignore_eos"] is True
    assert body["sampling_params"]["max_new_tokens"] == 8 and body["input_ids"] == [1, 2, 5, 6]
