"""The reward service over real gRPC on port 0, with its real process pool."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from asyncrl.grpcutil import channel, check_health
from asyncrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.reward.server import create_reward

SCRIPTED = "plugin:tests.fixtures_plugins.rewards:scripted"
OK = common_pb2.REWARD_STATUS_OK
FAILED = common_pb2.REWARD_STATUS_FAILED


@pytest.fixture
async def reward():
    runtime, _ = await create_reward(port=0, workers=2, register=False)
    address = f"127.0.0.1:{runtime.port}"
    async with channel(address, "rollout") as ch:
        yield address, reward_pb2_grpc.RewardStub(ch)
    await runtime.close()


def _items(*completions: str, answer: str = "1") -> list[reward_pb2.ScoreItem]:
    return [
        reward_pb2.ScoreItem(id=f"i{k}", prompt="p", completion=c, answer=answer)
        for k, c in enumerate(completions)
    ]


def _spec_json(function: str, timeout_s: float = 5.0, kwargs: dict | None = None) -> str:
    reward = {"function": function, "timeout_s": timeout_s, "kwargs": kwargs or {}}
    return json.dumps({"model": {"path": "m"}, "dataset": {"path": "d"}, "reward": reward})


async def _bind(stub, experiment_id: str, function: str, **reward) -> None:
    request = common_pb2.BindExperimentRequest(
        experiment_id=experiment_id, spec_json=_spec_json(function, **reward)
    )
    await stub.BindExperiment(request, timeout=10)


async def _score(stub, function: str, items, **reward) -> reward_pb2.ScoreResponse:
    """Bind an experiment with this reward function, then score `items` for it."""
    experiment_id = f"exp-{function}-{len(items)}-{time.monotonic_ns()}"
    await _bind(stub, experiment_id, function, **reward)
    request = reward_pb2.ScoreRequest(experiment_id=experiment_id, items=items)
    return await stub.Score(request, timeout=30)


async def test_score_mixed_batch_each_item_explicit(reward):
    _, stub = reward
    items = _items("ok", "raise", "sleep 30", "ok", "nan", "text", answer="0.25")
    start = time.monotonic()
    resp = await _score(stub, SCRIPTED, items, timeout_s=0.5)
    elapsed = time.monotonic() - start

    got = {r.id: (r.status, r.reward, r.reason) for r in resp.results}
    assert [r.id for r in resp.results] == ["i0", "i1", "i2", "i3", "i4", "i5"]
    assert got["i0"] == (OK, 0.25, "")
    assert got["i3"] == (OK, 0.25, "")
    assert got["i1"] == (FAILED, 0.0, "ValueError: scripted failure")
    assert got["i2"] == (FAILED, 0.0, "timed out after 0.5s")
    assert got["i4"][0] == FAILED and "non-finite" in got["i4"][2]
    assert got["i5"][0] == FAILED and "non-numeric" in got["i5"][2]
    assert elapsed < 10  # the sleeper was killed at its timeout, not waited for


async def test_score_after_timeout_pool_still_serves(reward):
    _, stub = reward
    first = await _score(stub, SCRIPTED, _items("sleep 30", "sleep 30"), timeout_s=0.3)
    assert [r.status for r in first.results] == [FAILED, FAILED]
    again = await _score(stub, "numeric_match", _items("it is 1,000", "it is 999", answer="1000"))
    assert [(r.status, r.reward) for r in again.results] == [(OK, 1.0), (OK, 0.0)]


async def test_score_worker_dies_failed_with_exit_code(reward):
    _, stub = reward
    resp = await _score(stub, SCRIPTED, _items("exit", "ok"))
    got = [(r.status, r.reward, r.reason) for r in resp.results]
    assert got == [(FAILED, 0.0, "worker died (exit code 3)"), (OK, 1.0, "")]


async def test_score_builtin_with_kwargs_rewards(reward):
    _, stub = reward
    resp = await _score(stub, "regex", _items("42", "forty-two"), kwargs={"pattern": r"^\d+$"})
    assert [(r.status, r.reward) for r in resp.results] == [(OK, 1.0), (OK, 0.0)]


async def test_score_math_verify_equivalence_one(reward):
    _, stub = reward
    items = _items("so \\boxed{\\frac{1}{2}}", "\\boxed{3}", answer="0.5")
    resp = await _score(stub, "math_verify", items, timeout_s=10)
    assert [(r.status, r.reward) for r in resp.results] == [(OK, 1.0), (OK, 0.0)]


async def test_score_two_experiments_each_with_its_bound_function(reward):
    _, stub = reward
    await _bind(stub, "exact", "exact_match")
    await _bind(stub, "numeric", "numeric_match")
    items = _items("1.0", answer="1")
    exact = await stub.Score(reward_pb2.ScoreRequest(experiment_id="exact", items=items))
    numeric = await stub.Score(reward_pb2.ScoreRequest(experiment_id="numeric", items=items))
    assert (exact.results[0].reward, numeric.results[0].reward) == (0.0, 1.0)


async def test_score_unbound_experiment_failed_precondition(reward):
    _, stub = reward
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Score(reward_pb2.ScoreRequest(experiment_id="never", items=_items("1")))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'never' is not bound here" in e.value.details()


@pytest.mark.parametrize(
    ("function", "reward_kw", "details"),
    [
        ("nope", {}, "reward.function: Value error, unknown reward function 'nope'"),
        ("plugin:tests.no_such_module:f", {}, "cannot import tests.no_such_module"),
        ("regex", {}, "reward.kwargs: regex needs kwarg 'pattern'"),
        ("exact_match", {"timeout_s": -1}, "reward.timeout_s:"),
    ],
)
async def test_bind_bad_reward_invalid_argument_names_field(reward, function, reward_kw, details):
    _, stub = reward
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _bind(stub, "bad", function, **reward_kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details in e.value.details()


async def test_score_empty_items_empty_response(reward):
    _, stub = reward
    resp = await _score(stub, "exact_match", [])
    assert list(resp.results) == []


async def test_list_reward_functions_builtins(reward):
    address, stub = reward
    resp = await stub.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest(), timeout=5)
    assert list(resp.names) == ["exact_match", "numeric_match", "math_verify", "regex"]
    assert await check_health(address)


HANG = "plugin:tests.fixtures_plugins.rewards:sleep_forever"


async def test_hung_experiment_does_not_starve_another_and_answers_by_its_deadline(reward):
    """Issue 23 point 7: experiment A's plugin hangs (timeout_s 1); B's items, scored on the
    same two processes meanwhile, come back at their normal latency; A's call answers before
    its own 6 s deadline, each item FAILED with why (none DEADLINE_EXCEEDED: that would read
    as a dead reward service and re-queue the group)."""
    _, stub = reward
    await _bind(stub, "hung", HANG, timeout_s=1.0)
    await _bind(stub, "quick", SCRIPTED, timeout_s=5.0)
    warm = reward_pb2.ScoreRequest(experiment_id="quick", items=_items("ok", "ok"))
    await stub.Score(warm, timeout=30)  # the processes started (seconds, cold)
    hung_items = _items(*["x"] * 10)
    start = time.monotonic()
    hung = asyncio.ensure_future(
        stub.Score(reward_pb2.ScoreRequest(experiment_id="hung", items=hung_items), timeout=6)
    )
    await asyncio.sleep(0.3)  # A's items hold their share of the processes now
    latencies = []
    for _ in range(5):
        t0 = time.monotonic()
        quick = await stub.Score(
            reward_pb2.ScoreRequest(experiment_id="quick", items=_items("ok", "ok")), timeout=6
        )
        latencies.append(time.monotonic() - t0)
        assert [(r.status, r.reward) for r in quick.results] == [(OK, 1.0), (OK, 1.0)]
    # one process each: B's items never wait for one of A's 1 s timeouts (before: ~1 s each)
    assert max(latencies) < 0.5, latencies
    resp = await hung
    took = time.monotonic() - start
    reasons = [r.reason for r in resp.results]
    assert all(r.status == FAILED for r in resp.results)
    timed_out = reasons.count("timed out after 1s")
    not_started = [r for r in reasons if r.startswith("not scored before the call's deadline: ")]
    # A holds one process of its share, and its suspect items the two spare ones: items time
    # out (at most 3 at once) until start + 6 - 1 - 2 s
    assert 2 <= timed_out <= 9 and timed_out + len(not_started) == 10, reasons
    assert took < 6.0
