"""The rollout's reward client against a real reward service: groups that ask for scores in
the same pass of the event loop share one Score call, and each gets its own scores back."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.net import free_port
from asyncrl.types import RewardStatus, ScoreItem
from services.rollout.reward_client import RewardBinding, RewardClient, RewardUnavailable

SPEC = json.dumps(
    {
        "model": {"path": "unused"},
        "dataset": {"path": "unused.jsonl"},
        "reward": {"function": "exact_match", "timeout_s": 5.0},
    }
)
BINDING = RewardBinding("exp", SPEC, 5.0)


@pytest.fixture
async def counted():
    """A reward client whose Score calls (each one RPC) are counted by their item counts."""
    client = RewardClient()
    calls: list[int] = []
    score_once = client._score_once

    async def counting(address, binding, req, deadline):
        calls.append(len(req.items))
        return await score_once(address, binding, req, deadline)

    client._score_once = counting
    yield client, calls
    await client.close()


def items(group: str, answers: list[str]) -> list[ScoreItem]:
    return [
        ScoreItem(id=f"{group}:{i}", prompt="q", completion=text, answer="42")
        for i, text in enumerate(answers)
    ]


async def test_groups_finishing_together_share_one_score_call(reward_address, counted):
    address, (client, calls) = reward_address, counted
    got = await asyncio.gather(
        client.score([address], BINDING, items("g1", ["42", "41"])),
        client.score([address], BINDING, items("g2", ["0"])),
        client.score([address], BINDING, items("g3", ["42", "42", "x"])),
    )
    assert [[s.reward for s in scores] for scores in got] == [
        [1.0, 0.0],
        [0.0],
        [1.0, 1.0, 0.0],
    ]
    assert all(s.status is RewardStatus.OK for scores in got for s in scores)
    assert calls == [6]  # one call for the three groups
    await client.score([address], BINDING, items("g4", ["42"]))
    assert calls == [6, 1]  # a later pass: a call of its own


async def test_a_cancelled_caller_leaves_the_shared_call_to_the_others(reward_address, counted):
    address, (client, calls) = reward_address, counted
    first = asyncio.ensure_future(client.score([address], BINDING, items("g1", ["42"])))
    second = asyncio.ensure_future(client.score([address], BINDING, items("g2", ["42"])))
    await asyncio.sleep(0)  # both joined the batch
    first.cancel()
    assert [s.reward for s in await second] == [1.0]
    assert calls == [2]


async def test_unreachable_reward_service_fails_every_waiting_caller_of_the_shared_call():
    client = RewardClient(max_wait_s=0.2)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    first = asyncio.ensure_future(client.score([address], BINDING, items("g1", ["42"])))
    second = asyncio.ensure_future(client.score([address], BINDING, items("g2", ["42"])))
    third = asyncio.ensure_future(client.score([address], BINDING, items("g3", ["42"])))
    await asyncio.sleep(0)  # all three joined the batch
    first.cancel()
    got = await asyncio.gather(first, second, third, return_exceptions=True)
    assert isinstance(got[0], asyncio.CancelledError)
    assert all(isinstance(e, RewardUnavailable) for e in got[1:])
    await client.close()


async def test_hung_reward_function_fails_the_items_not_the_service(reward_address):
    """Issue 23 point 7: a plugin that hangs, more items than one process can time out before
    the calls' deadlines (6 calls x 4 items x 0.5 s on one process, each call due in
    10 + 0.5 x 4 = 12 s): every item FAILED with its reason, no RewardUnavailable (which
    re-queued the group forever: the queue behind the hung items read as a dead service)."""
    spec = json.loads(SPEC)
    spec["reward"] = {"function": "plugin:tests.fixtures_plugins.rewards:sleep_forever"}
    spec["reward"]["timeout_s"] = 0.5
    binding = RewardBinding("hung", json.dumps(spec), 0.5)
    client = RewardClient(max_wait_s=2.0)
    calls = []
    for g in range(6):  # one Score call each: not joined into one batch
        calls.append(
            asyncio.ensure_future(
                client.score([reward_address], binding, items(f"g{g}", ["x"] * 4))
            )
        )
        await asyncio.sleep(0.05)
    got = await asyncio.gather(*calls, return_exceptions=True)
    await client.close()
    assert not [e for e in got if isinstance(e, BaseException)], got
    reasons = [s.reason for scores in got for s in scores]
    assert all(s.status is RewardStatus.FAILED for scores in got for s in scores)
    cut = [r for r in reasons if r.startswith("not scored before the call's deadline: ")]
    assert len(reasons) == 24 and cut  # 24 x 0.5 s > the last call's 12 s - 2 s margin
    assert set(reasons) - set(cut) <= {"timed out after 0.5s"}


async def test_a_retry_goes_to_the_address_the_scheduler_names_now(reward_address):
    """The only replica stopped (its port is dead) and came back on another port: once a
    heartbeat names the new one (`known`), the call's retries go there and it succeeds long
    before `max_wait_s` -- not after the 10 s of retrying the dead port."""
    client = RewardClient(max_wait_s=10.0)
    dead = f"127.0.0.1:{free_port()}"
    loop = asyncio.get_running_loop()
    started = loop.time()
    call = asyncio.ensure_future(client.score([dead], BINDING, items("g", ["42"])))
    await asyncio.sleep(0.3)
    assert not call.done()
    client.known([])  # the scheduler has no reward worker yet: the last list stays
    client.known([reward_address])
    scores = await call
    assert [s.reward for s in scores] == [1.0]
    assert loop.time() - started < 5.0
    await client.close()


async def test_a_call_dispatched_to_a_replica_that_left_goes_to_the_heartbeats_at_once(
    reward_address,
):
    """The group was dispatched while the only replica was the old one (a hand-over): that
    replica left (its port is dead) and the newest heartbeat names its successor. The call's
    second attempt goes there, without a backoff; the call's own list, older than the
    heartbeat's, does not send the retries back to the dead port (they did until `max_wait_s`:
    RewardUnavailable, the group re-queued)."""
    client = RewardClient(max_wait_s=0.5)
    tried: list[str] = []
    score_once = client._score_once

    async def tracing(address, binding, req, deadline):
        tried.append(address)
        return await score_once(address, binding, req, deadline)

    client._score_once = tracing
    dead = f"127.0.0.1:{free_port()}"
    client.known([reward_address])
    scores = await client.score([dead], BINDING, items("g", ["42"]))
    assert [s.reward for s in scores] == [1.0]
    assert tried == [dead, reward_address]
    tried.clear()  # a later call still dispatched with the old list: straight over again
    assert [s.reward for s in await client.score([dead], BINDING, items("h", ["0"]))] == [0.0]
    assert tried == [dead, reward_address]
    await client.close()
