"""Bad input is refused at submit naming the field, and a record that went bad while stored
fails only its own experiment (issue 23, points 8 and 12). Real nats-server, real gRPC."""

from __future__ import annotations

import shutil
import sys

import grpc
import pytest

from asyncrl.v1 import common_pb2, scheduler_pb2
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import spec, submit

cluster = scheduler_env.cluster
files = scheduler_env.files

NOT_UTF8 = b'{"prompt": "caf\xe9", "answer": "1"}\n'  # latin-1 0xe9: an invalid UTF-8 sequence


async def test_submit_non_utf8_dataset_line_invalid_argument_names_line(cluster, files, tmp_path):
    await cluster.start_scheduler()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n' + NOT_UTF8)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await submit(cluster, spec(files, dataset={"path": str(bad)}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # '{"prompt": "caf' is 15 bytes: the bad byte is at offset 15 of line 2
    assert e.value.details() == "dataset.path: line 2: not UTF-8 (byte 0xe9 at 15)"


async def test_restore_with_non_utf8_line_fails_that_experiment_others_resume(
    cluster, files, tmp_path
):
    await cluster.start_scheduler()
    own = tmp_path / "own.jsonl"
    shutil.copy(files["data"], own)
    broken = await submit(cluster, spec(files, dataset={"path": str(own)}))
    healthy = await submit(cluster, spec(files))
    await cluster.scheduler.store.flush()
    await cluster.stop_scheduler()
    with open(own, "ab") as f:  # appended while the scheduler was down (20 good rows before)
        f.write(NOT_UTF8)
    await cluster.start_scheduler()  # it starts: today UnicodeDecodeError escaped _restore
    got = await cluster.experiment(broken)
    assert got.state == scheduler_pb2.EXPERIMENT_STATE_FAILED
    assert got.message == "cannot resume: dataset.path: line 21: not UTF-8 (byte 0xe9 at 15)"
    assert (await cluster.experiment(healthy)).state == scheduler_pb2.EXPERIMENT_STATE_PENDING


INF, NAN = float("inf"), float("nan")  # json.dumps writes them as Infinity and NaN


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"trainer": {"lr": INF}}, "trainer.lr"),
        ({"trainer": {"lr": NAN}}, "trainer.lr"),
        ({"reward": {"timeout_s": INF}}, "reward.timeout_s"),
        ({"rollout": {"group_timeout_s": INF}}, "rollout.group_timeout_s"),
        ({"rollout": {"gconfig": {"temperature": INF}}}, "rollout.gconfig.temperature"),
        ({"rollout": {"gconfig": {"temperature": NAN}}}, "rollout.gconfig.temperature"),
        ({"trainer": {"lr": "inf"}}, "trainer.lr"),  # a string pydantic would parse as inf
    ],
)
async def test_submit_non_finite_number_invalid_argument_names_field(
    cluster, files, override, field
):
    await cluster.start_scheduler()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await submit(cluster, spec(files, **override))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"{field}: Input should be a finite number"


@pytest.mark.parametrize(
    ("function", "reason"),
    [
        ("plugin:no_such_top_level_pkg:score", "'no_such_top_level_pkg' not found (no "),
        ("plugin:tests.fixtures_plugins.nope:score", "'tests.fixtures_plugins.nope' not found ("),
        (  # rewards is a module, not a package: nothing can be under it
            "plugin:tests.fixtures_plugins.rewards.sub:score",
            "'tests.fixtures_plugins.rewards.sub' not found ('rewards' is not a package)",
        ),
    ],
)
async def test_submit_missing_reward_plugin_module_invalid_argument(
    cluster, files, function, reason
):
    await cluster.start_scheduler()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await submit(cluster, spec(files, reward={"function": function}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"reward.function: plugin module {reason}")


async def test_submit_present_reward_plugin_module_accepted_without_import(cluster, files):
    await cluster.start_scheduler()
    module = "tests.fixtures_plugins.marker"  # importing it would record that it ran
    exp_id = await submit(cluster, spec(files, reward={"function": f"plugin:{module}:score"}))
    assert cluster.scheduler.get(exp_id).state.value == "PENDING"
    assert module not in sys.modules


BIG = "x" * (16 * 1024 + 1)  # one character over MAX_TEXT


@pytest.mark.parametrize(
    ("override", "details"),
    [
        ({"reward": {"kwargs": {"pattern": BIG}}}, "reward.kwargs.pattern: 16385 characters"),
        ({"rollout": {"gconfig": {"stop": ["a", BIG]}}}, "rollout.gconfig.stop.1: 16385 char"),
        (
            {"rollout": {"workflow": {"args": {"turns": {"k": BIG}}}}},
            "rollout.workflow.args.turns.k: 16385 characters, at most 16384",
        ),
        (
            {"rollout": {"gconfig": {"stop_token_ids": list(range(1025))}}},
            "rollout.gconfig.stop_token_ids: 1025 entries, at most 1024",
        ),
        (  # every value within its limit, the spec over 256 KiB: the kwargs are named
            {"reward": {"kwargs": {f"k{i}": "y" * 16000 for i in range(17)}}},
            "reward.kwargs: the spec is ",
        ),
    ],
)
async def test_submit_oversized_field_invalid_argument_names_field(
    cluster, files, override, details
):
    """Issue 23 point 12: named by the field, not `spec_json`."""
    await cluster.start_scheduler()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await submit(cluster, spec(files, **override))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(details)


@pytest.mark.parametrize(
    ("request_fields", "details"),
    [
        ({"address": "x" * 600}, "address: 'xxxx"),  # the fuzzer's: registered, before
        ({"address": "127.0.0.1"}, "address: '127.0.0.1' is not host:port (port 1-65535)"),
        ({"address": "127.0.0.1:0"}, "address: '127.0.0.1:0' is not host:port (port 1-65535)"),
        ({"address": "h:1", "capacity": -1}, "capacity: -1 is negative"),
        ({"address": "h:1", "name": "n" * 300}, "name: 300 characters, at most 256"),
    ],
)
async def test_register_worker_bad_field_invalid_argument_names_it(
    cluster, request_fields, details
):
    await cluster.start_scheduler()
    request = scheduler_pb2.RegisterWorkerRequest(
        kind=common_pb2.WORKER_KIND_ROLLOUT, **request_fields
    )
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await cluster.stub_as("rollout").RegisterWorker(request, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(details)
