"""`asyncrl dump` reads an experiment's groups back from a real JetStream."""

from __future__ import annotations

import asyncio
import json

from typer.testing import CliRunner

from asyncrl.cli import app
from asyncrl.ledger import ensure_ledger, ledger_subject
from asyncrl.natsutil import connect, ensure_stream, publish_group
from asyncrl.types import RewardStatus, Sample, TrajectoryGroup

runner = CliRunner()


def group(exp: str, i: int, eval_: bool = False) -> TrajectoryGroup:
    samples = [
        Sample(
            output_ids=[1, 2],
            logprobs=[-0.5, -0.25],
            versions=[i, i + 1],
            finish_reason="stop",
            reward=float(k),
            text=f"s{k}",
            reward_status=RewardStatus.FAILED if k == 2 else RewardStatus.OK,
        )
        for k in range(3)
    ]
    return TrajectoryGroup(
        experiment_id=exp,
        group_id=f"{exp}-g{i}",
        prompt_id=f"p{i}",
        prompt=f"q{i}",
        answer=str(i),
        prompt_ids=[5],
        samples=samples,
        start_version=i,
        eval=eval_,
    )


async def publish(url: str, groups: list[TrajectoryGroup]) -> None:
    nc = await connect(url, identity="rollout")  # the CLI reads as admin, read-only
    js = nc.jetstream()
    await ensure_stream(js)
    for g in groups:
        await publish_group(js, g)
    await nc.drain()


def dump(url: str, exp: str, out, *extra: str):
    result = runner.invoke(app, ["dump", exp, "--out", str(out), "--nats", url, *extra])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_dump_train_groups_all_written_in_order_other_experiment_excluded(nats_server, tmp_path):
    asyncio.run(
        publish(
            nats_server.url,
            [group("a", 0), group("b", 0), group("a", 1), group("a", 2, eval_=True)],
        )
    )
    rows = dump(nats_server.url, "a", tmp_path / "a.jsonl")
    assert [r["group_id"] for r in rows] == ["a-g0", "a-g1"]
    first = rows[0]
    assert (first["prompt"], first["answer"], first["start_version"], first["eval"]) == (
        "q0",
        "0",
        0,
        False,
    )
    assert first["prompt_ids"] == [5]
    assert first["samples"][2] == {
        "text": "s2",
        "reward": 2.0,
        "reward_status": "failed",
        "reward_reason": "",
        "finish_reason": "stop",
        "versions": [0, 1],
        "output_ids": [1, 2],
        "logprobs": [-0.5, -0.25],
        "loss_mask": [1, 1],
    }


def test_dump_eval_and_limit_flags_select_groups(nats_server, tmp_path):
    asyncio.run(publish(nats_server.url, [group("a", i, eval_=i % 2 == 1) for i in range(5)]))
    rows = dump(nats_server.url, "a", tmp_path / "all.jsonl", "--eval")
    assert [r["eval"] for r in rows] == [False, True, False, True, False]
    rows = dump(nats_server.url, "a", tmp_path / "two.jsonl", "--limit", "2")
    assert [r["group_id"] for r in rows] == ["a-g0", "a-g2"]


def test_dump_unknown_experiment_writes_empty_file(nats_server, tmp_path):
    asyncio.run(publish(nats_server.url, [group("a", 0)]))
    assert dump(nats_server.url, "nope", tmp_path / "none.jsonl") == []


def test_dump_no_stream_yet_writes_empty_file(nats_server, tmp_path):
    assert dump(nats_server.url, "a", tmp_path / "none.jsonl") == []


def test_ledger_json_stays_parseable_when_a_warning_is_logged(nats_server):
    """A malformed ledger event is logged (a warning) while `asyncrl ledger --json` reads: the
    warning goes to stderr, stdout is the JSON alone."""

    async def malformed_event() -> None:
        nc = await connect(nats_server.url, identity="scheduler")  # the ledger's writer
        js = nc.jetstream()
        await ensure_ledger(js)
        await js.publish(ledger_subject("exp-warn"), b"not json")
        await nc.drain()

    asyncio.run(malformed_event())
    result = runner.invoke(app, ["ledger", "exp-warn", "--json", "--nats", nats_server.url])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["totals"] is not None
    assert "ledger_events_malformed" in result.stderr
