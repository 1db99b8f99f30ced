"""The reward service over real gRPC on port 0, with its real process pool."""

from __future__ import annotations

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
    async with channel(address) as ch:
        yield address, reward_pb2_grpc.RewardStub(ch)
    await runtime.close()


def _items(*completions: str, answer: str = "1") -> list[reward_pb2.ScoreItem]:
    return [
        reward_pb2.ScoreItem(id=f"i{k}", prompt="p", completion=c, answer=answer)
        for k, c in enumerate(completions)
    ]


async def test_score_mixed_batch_each_item_explicit(reward):
    _, stub = reward
    request = reward_pb2.ScoreRequest(
        function=SCRIPTED,
        timeout_s=0.5,
        items=_items("ok", "raise", "sleep 30", "ok", "nan", "text", answer="0.25"),
    )
    start = time.monotonic()
    resp = await stub.Score(request, timeout=20)
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
    first = await stub.Score(
        reward_pb2.ScoreRequest(
            function=SCRIPTED, timeout_s=0.3, items=_items("sleep 30", "sleep 30")
        ),
        timeout=20,
    )
    assert [r.status for r in first.results] == [FAILED, FAILED]
    again = await stub.Score(
        reward_pb2.ScoreRequest(
            function="numeric_match",
            timeout_s=5,
            items=_items("it is 1,000", "it is 999", answer="1000"),
        ),
        timeout=20,
    )
    assert [(r.status, r.reward) for r in again.results] == [(OK, 1.0), (OK, 0.0)]


async def test_score_worker_dies_failed_with_exit_code(reward):
    _, stub = reward
    resp = await stub.Score(
        reward_pb2.ScoreRequest(function=SCRIPTED, timeout_s=5, items=_items("exit", "ok")),
        timeout=20,
    )
    got = [(r.status, r.reward, r.reason) for r in resp.results]
    assert got == [(FAILED, 0.0, "worker died (exit code 3)"), (OK, 1.0, "")]


async def test_score_builtin_with_kwargs_rewards(reward):
    _, stub = reward
    resp = await stub.Score(
        reward_pb2.ScoreRequest(
            function="regex", kwargs={"pattern": r"^\d+$"}, items=_items("42", "forty-two")
        ),
        timeout=20,
    )
    assert [(r.status, r.reward) for r in resp.results] == [(OK, 1.0), (OK, 0.0)]


async def test_score_math_verify_equivalence_one(reward):
    _, stub = reward
    resp = await stub.Score(
        reward_pb2.ScoreRequest(
            function="math_verify",
            timeout_s=10,
            items=_items("so \\boxed{\\frac{1}{2}}", "\\boxed{3}", answer="0.5"),
        ),
        timeout=30,
    )
    assert [(r.status, r.reward) for r in resp.results] == [(OK, 1.0), (OK, 0.0)]


async def test_score_unknown_function_invalid_argument(reward):
    _, stub = reward
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Score(reward_pb2.ScoreRequest(function="nope", items=_items("1")), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reward.function: unknown reward function 'nope'" in e.value.details()


async def test_score_regex_without_pattern_invalid_argument(reward):
    _, stub = reward
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Score(reward_pb2.ScoreRequest(function="regex", items=_items("1")), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'pattern'" in e.value.details()


async def test_score_negative_timeout_invalid_argument(reward):
    _, stub = reward
    request = reward_pb2.ScoreRequest(function="exact_match", timeout_s=-1, items=_items("1"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Score(request, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("timeout_s:")


async def test_score_empty_items_empty_response(reward):
    _, stub = reward
    resp = await stub.Score(reward_pb2.ScoreRequest(function="exact_match"), timeout=5)
    assert list(resp.results) == []


async def test_list_reward_functions_builtins(reward):
    address, stub = reward
    resp = await stub.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest(), timeout=5)
    assert list(resp.names) == ["exact_match", "numeric_match", "math_verify", "regex"]
    assert await check_health(address)
