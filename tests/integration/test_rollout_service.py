"""The rollout service end to end: a real nats-server, the real reward service, and the rollout
gRPC server with the torch engine on a tiny model, all on port 0."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import grpc
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from transformers import AutoTokenizer

from asyncrl.convert import group_from_bytes
from asyncrl.grpcutil import channel
from asyncrl.natsutil import STREAM, eval_subject, train_subject, wait_until
from asyncrl.net import free_port
from asyncrl.spec import SamplingParams
from asyncrl.tiny import build_tiny_model
from asyncrl.types import RewardStatus
from asyncrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from asyncrl.weights import path_to_uri
from services.reward.server import create_reward
from services.rollout import running
from services.rollout.engine import GenRequest
from services.rollout.server import create_rollout
from services.rollout.service import GroupJob
from services.rollout.serving import Binding
from services.rollout.torch_engine import TorchEngine
from tests.integration import engine_gate
from tests.integration.engine_gate import hold_generation

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

EXP = "exp1"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    build_tiny_model(root / "v0", seed=0)
    build_tiny_model(root / "v1", seed=1)
    return root


@pytest.fixture(scope="module")
def no_eos_tokenizer(models, tmp_path_factory):
    """The tiny tokenizer without an EOS token: samples then always run to max_new_tokens, so
    tests can act while a long group is in flight."""
    tok = AutoTokenizer.from_pretrained(str(models / "v0"))
    tok.eos_token = None
    out = tmp_path_factory.mktemp("no_eos")
    tok.save_pretrained(str(out))
    return out


@pytest.fixture
async def rollout(nats_server, models):
    runtime, service = await create_rollout(
        nats_server.url, TorchEngine(seed=0), port=0, register=False
    )
    async with channel(f"127.0.0.1:{runtime.port}", "scheduler") as ch:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        await _serve(stub, models, EXP)
        yield stub, service
    await runtime.close()


def _spec_json(
    models,
    tokenizer_path=None,
    n: int = 3,
    max_new_tokens: int = 8,
    filter: str = "none",
    stop: tuple[str, ...] = (),
    workflow: str = "single_turn",
    chat_template: bool = False,
    engine: str = "torch",
    **workflow_args,
) -> str:
    """An experiment spec as BindExperiment carries it; eval groups get n samples too."""
    gconfig = {"temperature": 1.0, "max_new_tokens": max_new_tokens, "stop": list(stop)}
    return json.dumps(
        {
            "model": {"path": str(models / "v0"), "tokenizer_path": str(tokenizer_path or "")}
            if tokenizer_path
            else {"path": str(models / "v0")},
            "dataset": {"path": "unused-by-the-rollout.jsonl"},
            "rollout": {
                "n_samples": n,
                "gconfig": gconfig,
                "filter": filter,
                "engine": engine,
                "workflow": {
                    "name": workflow,
                    "args": workflow_args,
                    "chat_template": chat_template,
                },
            },
            "eval": {"n_samples": n, "gconfig": gconfig},
            "reward": {"function": "exact_match", "timeout_s": 5.0},
        }
    )


async def _bind(stub, models, experiment_id: str, tokenizer_path=None, **spec) -> None:
    await stub.BindExperiment(
        common_pb2.BindExperimentRequest(
            experiment_id=experiment_id, spec_json=_spec_json(models, tokenizer_path, **spec)
        ),
        timeout=30,
    )


async def _serve(stub, models, experiment_id: str, tokenizer_path=None, **spec) -> str:
    """Bind the rollout to `experiment_id` (spec settings as `_spec_json`), then load v0."""
    await _bind(stub, models, experiment_id, tokenizer_path, **spec)
    await stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(
            experiment_id=experiment_id, version=0, uri=path_to_uri(models / "v0")
        ),
        timeout=30,
    )
    return experiment_id


def _request(
    group_id: str,
    reward_addresses: list[str],
    eval: bool = False,
    experiment_id: str = EXP,
) -> rollout_pb2.GenerateGroupRequest:
    return rollout_pb2.GenerateGroupRequest(
        experiment_id=experiment_id,
        group_id=group_id,
        prompt_id="p-" + group_id,
        prompt="1+1=",
        answer="2",
        eval=eval,
        reward_addresses=reward_addresses,
        epoch=1,
    )


async def _read_back(js, subject: str, n: int):
    cfg = ConsumerConfig(
        durable_name="reader", ack_policy=AckPolicy.EXPLICIT, filter_subject=subject
    )
    sub = await js.pull_subscribe(subject, durable="reader", config=cfg)
    msgs = await sub.fetch(n, timeout=5)
    for m in msgs:
        await m.ack()
    return [group_from_bytes(m.data) for m in msgs]


async def test_generate_group_publishes_group_readable_from_jetstream(
    rollout, reward_address, js, models
):
    stub, _ = rollout
    summary = await stub.GenerateGroup(_request("g1", [reward_address]), timeout=60)
    assert summary.status == rollout_pb2.GROUP_STATUS_ACCEPTED and summary.published
    assert summary.failed_samples == 0
    assert list(summary.rewards) == [0.0, 0.0, 0.0]
    assert (summary.start_version, summary.end_version) == (0, 0)
    [group] = await _read_back(js, train_subject(EXP), 1)
    tok = AutoTokenizer.from_pretrained(str(models / "v0"))
    assert group.group_id == "g1" and group.prompt_id == "p-g1" and group.epoch == 1
    assert group.prompt_ids == tok("1+1=", add_special_tokens=False).input_ids
    assert len(group.prompt_ids) == 4 and len(group.samples) == 3
    assert summary.tokens == sum(len(s.output_ids) for s in group.samples)
    for s in group.samples:  # 8 tokens, or fewer when the tokenizer's EOS was sampled
        n = len(s.output_ids)
        assert n == len(s.logprobs) == len(s.versions) and 0 < n <= 8
        assert s.finish_reason == ("length" if n == 8 else "stop")
        assert s.versions == [0] * n and s.reward_status is RewardStatus.OK
        assert s.text == tok.decode(s.output_ids, skip_special_tokens=True)
    assert group.rollout_worker == summary.worker != ""


async def test_generate_groups_one_call_answers_each_a_bad_one_fails_alone(
    rollout, reward_address, js
):
    """Three groups in one GenerateGroups call: every summary comes back on the stream; the one
    for an experiment this rollout does not serve answers FAILED_PRECONDITION as its own
    GenerateGroup would have, and the others are published as usual."""
    stub, _ = rollout
    bad = _request("b2", [reward_address])
    bad.experiment_id = "other"
    groups = [_request("b1", [reward_address]), bad, _request("b3", [reward_address])]
    call = stub.GenerateGroups(rollout_pb2.GenerateGroupsRequest(groups=groups), timeout=60)
    summaries = {s.group_id: s async for message in call for s in message.summaries}
    assert sorted(summaries) == ["b1", "b2", "b3"]
    error = summaries["b2"].error
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "not 'other'" in error.details and error.fault == ""
    for gid in ("b1", "b3"):
        assert not summaries[gid].HasField("error") and summaries[gid].published
    published = await _read_back(js, train_subject(EXP), 2)
    assert sorted(g.group_id for g in published) == ["b1", "b3"]


async def test_generate_groups_no_reward_service_answers_fault_not_failed(rollout, js):
    stub, service = rollout
    service.rewards.max_wait_s = 0.5
    groups = [_request(g, [f"127.0.0.1:{free_port()}"]) for g in ("u1", "u2")]
    call = stub.GenerateGroups(rollout_pb2.GenerateGroupsRequest(groups=groups), timeout=60)
    summaries = [s async for message in call for s in message.summaries]
    assert sorted(s.group_id for s in summaries) == ["u1", "u2"]
    for s in summaries:
        assert s.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert s.error.fault == "reward-unavailable" and "reward service" in s.error.details
    assert (await js.stream_info(STREAM)).state.messages == 0


async def test_generate_group_constant_reward_is_rejected_and_not_published(
    rollout, reward_address, js, models
):
    stub, _ = rollout
    exp = await _serve(stub, models, "filtered", filter="nonconstant_reward")
    summary = await stub.GenerateGroup(
        _request("g2", [reward_address], experiment_id=exp), timeout=60
    )
    assert summary.status == rollout_pb2.GROUP_STATUS_REJECTED and not summary.published
    assert summary.reason == "constant reward 0 across 3 scored samples"
    assert (await js.stream_info(STREAM)).state.messages == 0


async def test_generate_group_eval_constant_reward_is_published_to_eval_subject(
    rollout, reward_address, js, models
):
    stub, _ = rollout
    exp = await _serve(stub, models, "filtered", filter="nonconstant_reward")
    summary = await stub.GenerateGroup(
        _request("e1", [reward_address], eval=True, experiment_id=exp), timeout=60
    )
    assert summary.status == rollout_pb2.GROUP_STATUS_ACCEPTED and summary.published
    [group] = await _read_back(js, eval_subject(exp), 1)
    assert group.eval and group.group_id == "e1"


async def test_generate_group_dead_reward_address_fails_over_to_live_one(rollout, reward_address):
    stub, _ = rollout
    dead = f"127.0.0.1:{free_port()}"
    # round-robin: one of the two groups necessarily tries the dead address first
    for gid in ("f1", "f2"):
        summary = await stub.GenerateGroup(_request(gid, [dead, reward_address]), timeout=60)
        assert summary.status == rollout_pb2.GROUP_STATUS_ACCEPTED, summary.reason
        assert summary.failed_samples == 0


async def test_generate_group_no_live_reward_service_is_unavailable_not_failed(rollout, js):
    # an infrastructure fault, not the group's fate: the scheduler retries it (same id)
    stub, service = rollout
    service.rewards.max_wait_s = 0.5
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.GenerateGroup(_request("f3", [f"127.0.0.1:{free_port()}"]), timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "reward service" in e.value.details()
    assert dict(e.value.trailing_metadata())["asyncrl-fault"] == "reward-unavailable"
    assert (await js.stream_info(STREAM)).state.messages == 0


async def test_generate_group_reward_restarted_mid_group_is_scored_not_failed(rollout, js):
    stub, service = rollout
    port = free_port()
    address = f"127.0.0.1:{port}"
    reward, _ = await create_reward(port=port, workers=1, register=False)
    summary = await stub.GenerateGroup(_request("r0", [address]), timeout=60)
    assert summary.status == rollout_pb2.GROUP_STATUS_ACCEPTED  # bound, channel open
    await reward.close()  # kill: the next group finds no reward service
    failures = _count_failed_score_calls(service)
    call = stub.GenerateGroup(_request("r1", [address]), timeout=60)
    await wait_until(lambda: failures, timeout=30, interval=0.01)
    reward, _ = await create_reward(port=port, workers=1, register=False)  # restarted
    try:
        summary = await call
    finally:
        await reward.close()
    assert summary.status == rollout_pb2.GROUP_STATUS_ACCEPTED, summary.reason
    assert summary.failed_samples == 0 and summary.published


def _count_failed_score_calls(service) -> list[str]:
    """The codes of the reward calls that failed from now on (the rollout's own client)."""
    failures: list[str] = []
    score_once = service.rewards._score_once

    async def counted(*args):
        try:
            return await score_once(*args)
        except grpc.aio.AioRpcError as e:
            failures.append(e.code().name)
            raise

    service.rewards._score_once = counted
    return failures


async def test_bind_mismatched_engine_is_failed_precondition(rollout, models):
    stub, _ = rollout
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _bind(stub, models, "sg", engine="sglang")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "rollout.engine: this rollout worker runs the 'torch' engine" in e.value.details()


async def test_update_weights_for_unbound_experiment_is_failed_precondition(rollout, models):
    stub, _ = rollout
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(
                experiment_id="other", version=1, uri=path_to_uri(models / "v1")
            ),
            timeout=10,
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "bound to 'exp1', not 'other'" in e.value.details()


async def test_update_weights_malformed_broadcast_store_is_invalid_argument_naming_it(
    rollout, models
):
    stub, _ = rollout
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(
                experiment_id=EXP,
                version=1,
                uri=path_to_uri(models / "v1"),
                group_rank=1,
                group_size=1,
                broadcast_store="no-port",
            ),
            timeout=10,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "broadcast_store: 'no-port' is not host:port (port 1-65535)"


async def test_generate_group_unknown_experiment_is_failed_precondition(rollout, reward_address):
    stub, _ = rollout
    req = _request("x1", [reward_address])
    req.experiment_id = "other"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.GenerateGroup(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_bind_bad_spec_is_invalid_argument_naming_the_field(rollout, models):
    stub, _ = rollout
    spec = json.loads(_spec_json(models))
    spec["rollout"]["gconfig"]["top_p"] = 1.5
    request = common_pb2.BindExperimentRequest(experiment_id="bad", spec_json=json.dumps(spec))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.BindExperiment(request, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rollout.gconfig.top_p" in e.value.details()


async def _serve_long(stub, models, no_eos_tokenizer, **spec) -> str:
    """Switch the rollout to experiment 'long' (no EOS: every sample runs to its length)."""
    return await _serve(stub, models, "long", no_eos_tokenizer, **spec)


async def _group_under_way(
    stub,
    service,
    models,
    no_eos_tokenizer,
    group_id: str,
    reward_address: str,
    *,
    tokens: int = 4,
    max_new_tokens: int = 200,
) -> tuple[str, asyncio.Future]:
    """Experiment 'long' (n=2) and one of its groups generating: (experiment id, the call),
    once the engine has generated `tokens` tokens; it holds there until the test's next call
    reaches the engine (engine_gate), so the group is still under way when it does."""
    exp = await _serve_long(stub, models, no_eos_tokenizer, n=2, max_new_tokens=max_new_tokens)
    engine = service.engine
    start = engine.tokens_generated
    held = hold_generation(engine, lambda: engine.tokens_generated >= start + tokens)
    call = asyncio.ensure_future(
        stub.GenerateGroup(_request(group_id, [reward_address], experiment_id=exp), timeout=60)
    )
    await wait_until(held.is_set, timeout=30, interval=0.001)
    return exp, call


async def test_generate_group_stop_strings_end_samples_at_the_completing_token(
    rollout, reward_address, js, models, no_eos_tokenizer
):
    stub, _ = rollout
    digits = [str(d) for d in range(10)]
    exp = await _serve_long(
        stub, models, no_eos_tokenizer, n=4, max_new_tokens=30, stop=tuple(digits)
    )
    summary = await stub.GenerateGroup(
        _request("ss1", [reward_address], experiment_id=exp), timeout=60
    )
    assert summary.status == rollout_pb2.GROUP_STATUS_ACCEPTED
    [group] = await _read_back(js, train_subject(exp), 1)
    tok = AutoTokenizer.from_pretrained(str(no_eos_tokenizer))
    reasons = []
    for s in group.samples:
        text, before = tok.decode(s.output_ids), tok.decode(s.output_ids[:-1])
        hit = any(d in text for d in digits)
        assert not any(d in before for d in digits)  # nothing ran past a stop string
        assert s.finish_reason == ("stop" if hit else "length")
        assert hit or len(s.output_ids) == 30
        reasons.append(s.finish_reason)
    assert "stop" in reasons


async def test_update_weights_mid_group_interrupts_and_group_spans_versions(
    rollout, reward_address, js, models, no_eos_tokenizer
):
    stub, service = rollout
    exp, call = await _group_under_way(
        stub, service, models, no_eos_tokenizer, "w1", reward_address,
        tokens=10, max_new_tokens=150,
    )  # fmt: skip
    resp = await stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(
            experiment_id=exp, version=1, uri=path_to_uri(models / "v1")
        ),
        timeout=30,
    )
    assert resp.version == 1 and resp.interrupted == 2
    summary = await call
    assert (summary.start_version, summary.end_version) == (0, 1) and summary.tokens == 300
    [group] = await _read_back(js, train_subject(exp), 1)
    assert group.start_version == 0
    for s in group.samples:  # 5+ tokens at v0, the rest at v1, in order, none lost
        k = s.versions.count(0)
        assert s.versions == [0] * k + [1] * (150 - k) and 5 <= k < 150
    status = await stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=5)
    assert (status.experiment_id, status.version, status.engine) == (exp, 1, "torch")
    assert status.tokens_generated == 300 and status.running_groups == 0


async def test_cancelled_and_aborted_group_stops_engine_requests_and_publishes_nothing(
    rollout, reward_address, js, models, no_eos_tokenizer
):
    stub, service = rollout
    exp = await _serve_long(stub, models, no_eos_tokenizer, n=2, max_new_tokens=200)
    held = hold_generation(service.engine, lambda: service.engine.tokens_generated >= 4)
    call = stub.GenerateGroup(_request("c1", [reward_address], experiment_id=exp), timeout=60)
    await wait_until(held.is_set, timeout=30, interval=0.001)
    call.cancel()  # what the scheduler does to a stale group, with AbortGroups
    with pytest.raises(asyncio.CancelledError):
        await call
    abort = rollout_pb2.AbortGroupsRequest(experiment_id=exp, group_ids=["c1"], reason="stale")
    await stub.AbortGroups(abort, timeout=5)
    await wait_until(lambda: service.engine.running == 0 and service.running_groups == 0, timeout=5)
    tokens = service.engine.tokens_generated
    # a request after the cancel: once it is answered, the engine loop has ended the run that
    # was in flight and batched its news; a request left running would have stepped with it
    probe = GenRequest(rid="probe", input_ids=[1, 2], params=SamplingParams(max_new_tokens=1))
    assert len((await service.engine.generate(probe)).output_ids) == 1
    assert service.engine.tokens_generated <= tokens + 2 + 1  # the step in flight, the probe's
    assert (await js.stream_info(STREAM)).state.messages == 0


async def _orphaned_groups(
    stub, service, models, no_eos_tokenizer, reward_address, ids, monkeypatch
):
    """Experiment 'long' (n=2, 200 tokens a sample, no EOS) and a GenerateGroups call for
    `ids` cancelled while they generate (the scheduler closed): (experiment id, requests,
    the engine's token count before the call)."""
    exp = await _serve_long(stub, models, no_eos_tokenizer, n=2, max_new_tokens=200)
    groups = [_request(g, [reward_address], experiment_id=exp) for g in ids]
    start = service.engine.tokens_generated
    monkeypatch.setattr(engine_gate, "HOLD_LIMIT_S", 2.0)  # an adoption queues no news
    held = hold_generation(service.engine, lambda: service.engine.running == 2 * len(ids))
    call = stub.GenerateGroups(rollout_pb2.GenerateGroupsRequest(groups=groups), timeout=60)
    await wait_until(held.is_set, timeout=30, interval=0.001)
    call.cancel()
    await wait_until(lambda: service.groups.orphans == len(ids), timeout=5, interval=0.001)
    return exp, groups, start


async def test_cancelled_call_leaves_orphans_that_publish_nothing_and_are_dropped(
    rollout, reward_address, js, models, no_eos_tokenizer, monkeypatch
):
    """A call that ends without its summaries (the scheduler closed) leaves its groups going
    for ORPHAN_GRACE_S, publishing nothing; nobody adopts them, so they are dropped."""
    monkeypatch.setattr(running, "ORPHAN_GRACE_S", 1.0)
    stub, service = rollout
    await _orphaned_groups(
        stub, service, models, no_eos_tokenizer, reward_address, ("k1", "k2"), monkeypatch
    )
    assert service.running_groups == 2  # still going, with no call
    await wait_until(lambda: service.running_groups == 0, timeout=30)
    assert service.engine.running == 0
    assert (await js.stream_info(STREAM)).state.messages == 0


async def test_next_call_for_an_orphan_adopts_it_and_nothing_is_generated_twice(
    rollout, reward_address, js, models, no_eos_tokenizer, monkeypatch
):
    """A scheduler's successor dispatches the groups it found in flight under their ids: the
    rollout answers them from the runs already going (each sample's 200 tokens once), and each
    group is published once."""
    stub, service = rollout
    exp, groups, start = await _orphaned_groups(
        stub, service, models, no_eos_tokenizer, reward_address, ("o1", "o2"), monkeypatch
    )
    summaries = [
        s
        async for batch in stub.GenerateGroups(
            rollout_pb2.GenerateGroupsRequest(groups=groups), timeout=60
        )
        for s in batch.summaries
    ]
    assert sorted(s.group_id for s in summaries) == ["o1", "o2"]
    assert all(s.published and s.tokens == 400 for s in summaries)
    assert service.engine.tokens_generated - start == 2 * 2 * 200  # nothing generated again
    assert service.running_groups == 0
    published = await _read_back(js, train_subject(exp), 2)
    assert sorted(g.group_id for g in published) == ["o1", "o2"]


async def test_abort_groups_stops_an_orphan_at_once(
    rollout, reward_address, js, models, no_eos_tokenizer, monkeypatch
):
    """The scheduler withdrawing groups (too stale, the run over) aborts them as it cancels
    their call: an aborted orphan is not kept for adoption."""
    stub, service = rollout
    exp, _, _ = await _orphaned_groups(
        stub, service, models, no_eos_tokenizer, reward_address, ("w1",), monkeypatch
    )
    request = rollout_pb2.AbortGroupsRequest(experiment_id=exp, group_ids=["w1"], reason="gone")
    assert list((await stub.AbortGroups(request, timeout=5)).aborted) == ["w1"]
    await wait_until(lambda: service.running_groups == 0, timeout=5)
    assert service.engine.running == 0
    assert (await js.stream_info(STREAM)).state.messages == 0


async def test_abort_groups_stops_an_unpublished_group_and_spares_the_rest(
    rollout, reward_address, js, models, no_eos_tokenizer
):
    """AbortGroups (the scheduler found the group too stale): a group still generating answers
    ABORTED with the reason and publishes nothing; another experiment's ids, unknown ids and a
    finished group are left alone."""
    stub, service = rollout
    exp, call = await _group_under_way(
        stub, service, models, no_eos_tokenizer, "stale", reward_address
    )

    async def abort(experiment_id, *ids):
        request = rollout_pb2.AbortGroupsRequest(
            experiment_id=experiment_id, group_ids=list(ids), reason="aborted: too stale"
        )
        return list((await stub.AbortGroups(request, timeout=5)).aborted)

    assert await abort("another", "stale") == []
    assert await abort(exp, "stale", "unknown") == ["stale"]
    summary = await call
    assert summary.status == rollout_pb2.GROUP_STATUS_ABORTED
    assert summary.reason == "aborted: too stale" and not summary.published
    assert service.running_groups == 0 and service.engine.running == 0
    assert await abort(exp, "stale") == []  # finished: nothing to abort
    assert (await js.stream_info(STREAM)).state.messages == 0


async def test_bind_new_experiment_aborts_running_groups(
    rollout, reward_address, models, no_eos_tokenizer
):
    stub, service = rollout
    _, call = await _group_under_way(stub, service, models, no_eos_tokenizer, "a1", reward_address)
    await _bind(stub, models, "exp2")
    resp = await stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(
            experiment_id="exp2", version=3, uri=path_to_uri(models / "v1")
        ),
        timeout=30,
    )
    assert (resp.version, resp.interrupted) == (3, 0)
    summary = await call
    assert summary.status == rollout_pb2.GROUP_STATUS_FAILED and not summary.published
    assert "switched from experiment 'long' to 'exp2'" in summary.reason
    assert service.experiment_id == "exp2" and service.engine.running == 0


async def test_group_dispatched_again_while_running_is_answered_from_the_same_run(
    rollout, reward_address, js, models, no_eos_tokenizer, monkeypatch
):
    """A rollout cut off from the scheduler keeps running its groups; the scheduler re-queues
    them and, once the rollout is back, may dispatch one to it again under the same id while
    the earlier call is still open. Both calls get the one run's summary, published once (it
    used to be refused as 'already running', which fenced the whole rollout)."""
    stub, service = rollout
    monkeypatch.setattr(engine_gate, "HOLD_LIMIT_S", 2.0)  # the second call queues no news
    exp, first = await _group_under_way(
        stub, service, models, no_eos_tokenizer, "again", reward_address, max_new_tokens=60
    )
    second = await stub.GenerateGroup(
        _request("again", [reward_address], experiment_id=exp), timeout=60
    )
    earlier = await first
    assert second.published and second.status != rollout_pb2.GROUP_STATUS_FAILED
    assert earlier == second
    assert service.running_groups == 0 and service.engine.running == 0
    [group] = await _read_back(js, train_subject(exp), 1)
    assert group.group_id == "again"


async def test_group_id_dispatched_again_for_another_prompt_supersedes_the_earlier_run(
    rollout, reward_address, js, models, no_eos_tokenizer
):
    """The same id for another prompt is not the same group: the earlier run is aborted and
    the new one runs."""
    stub, service = rollout
    exp, first = await _group_under_way(
        stub, service, models, no_eos_tokenizer, "again", reward_address, max_new_tokens=60
    )
    other = _request("again", [reward_address], experiment_id=exp)
    other.prompt = "2+2="
    second = await stub.GenerateGroup(other, timeout=60)
    earlier = await first
    assert earlier.status == rollout_pb2.GROUP_STATUS_FAILED and not earlier.published
    assert "dispatched this group again" in earlier.reason
    assert second.published and second.status != rollout_pb2.GROUP_STATUS_FAILED
    assert service.running_groups == 0 and service.engine.running == 0
    [group] = await _read_back(js, train_subject(exp), 1)
    assert group.group_id == "again"


async def test_single_turn_group_is_what_one_workflow_run_per_sample_gives(rollout, models):
    """The built-in single_turn runs as one engine call for the whole group; the same workflow
    under a plugin name (a SingleTurn subclass) runs once per sample, each with its own
    context. Both give the same trajectories (request ids `<group>:<sample>` seed them)."""
    _, service = rollout
    job = GroupJob(EXP, "same", "p-same", "1+1=", "2")
    runs = []
    for workflow in ("single_turn", "tests.fixtures_plugins.workflows:PerSample"):
        spec_json = _spec_json(models, n=4, max_new_tokens=8, workflow=workflow)
        binding = Binding.create(EXP, spec_json)
        prompt_ids, chat_prompt = service._prompt(job, binding)
        samples = await service._samples(job, binding, prompt_ids, chat_prompt)
        service._generation().fill_text(samples)  # the text to score
        runs.append(samples)
    together, per_sample = runs
    assert len(together) == 4 and len({tuple(s.output_ids) for s in together}) > 1
    for x, y in zip(together, per_sample, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        assert replace(x, logprobs=y.logprobs) == y
        assert x.text and x.text == service.tokenizer.decode(x.output_ids, skip_special_tokens=True)


async def test_plugin_workflow_yields_one_trajectory_system_groups_n_env_tokens_masked(
    rollout, reward_address, js, models, no_eos_tokenizer
):
    stub, _ = rollout
    exp = await _serve_long(
        stub,
        models,
        no_eos_tokenizer,
        filter="nonconstant_reward",
        workflow="tests.fixtures_plugins.workflows:TwoCalls",
        marker="|#",
    )
    summary = await stub.GenerateGroup(
        _request("wf1", [reward_address], experiment_id=exp), timeout=60
    )
    assert summary.status == rollout_pb2.GROUP_STATUS_ACCEPTED
    assert sorted(summary.rewards) == [0.0, 1.0, 2.0]  # the workflow's own rewards
    [group] = await _read_back(js, train_subject(exp), 1)
    assert len(group.samples) == 3
    for s in group.samples:
        assert s.loss_mask == [1, 1, 1, 0, 0, 1, 1]  # 3 policy, "|#" from the env, 2 policy
        assert len(s.output_ids) == len(s.logprobs) == len(s.versions) == 7
        assert s.logprobs[3:5] == [0.0, 0.0] and all(lp < 0 for lp in s.logprobs[:3])
        assert s.versions == [0] * 7
        tok = AutoTokenizer.from_pretrained(str(no_eos_tokenizer))
        assert tok.decode(s.output_ids[3:5]) == "|#"


async def test_multi_turn_workflow_scores_each_turn_feedback_is_context(
    rollout, reward_address, js, models
):
    stub, _ = rollout
    tok = AutoTokenizer.from_pretrained(str(models / "v0"))
    exp = await _serve(
        stub,
        models,
        "mt",
        n=4,
        max_new_tokens=4,
        workflow="multi_turn",
        max_turns=2,
        feedback=" no. ",
    )
    summary = await stub.GenerateGroup(
        _request("mt1", [reward_address], experiment_id=exp), timeout=60
    )
    assert summary.status == rollout_pb2.GROUP_STATUS_ACCEPTED  # filter "none"
    [group] = await _read_back(js, train_subject(exp), 1)
    for s in group.samples:
        assert s.reward in (0.0, 0.5, 1.0) and s.reward_status is RewardStatus.OK
        env = [i for i, m in enumerate(s.loss_mask) if m == 0]
        if s.reward == 1.0:  # right at the first answer: no feedback, one turn
            assert s.loss_mask == []
        else:  # a wrong first answer, then the feedback, then the second answer
            feedback = tok(" no. ", add_special_tokens=False).input_ids
            assert [s.output_ids[i] for i in env] == feedback
            assert env == list(range(env[0], env[0] + len(feedback)))  # one contiguous run
            assert s.text != "" and s.loss_mask[-1] == 1


@pytest.fixture(scope="module")
def chat_tokenizer(models, tmp_path_factory):
    """The tiny tokenizer with a ChatML-like template whose end of turn is its EOS."""
    from asyncrl.tiny import CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(str(models / "v0"))
    tok.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("chat_tok")
    tok.save_pretrained(str(out))
    return out


async def test_openai_sdk_agent_two_turns_one_trajectory_per_sample_scored_on_answer(
    rollout, reward_address, js, models, chat_tokenizer
):
    stub, _ = rollout
    await _serve(
        stub,
        models,
        "chat",
        chat_tokenizer,
        workflow="tests.fixtures_plugins.workflows:AskTwice",
        chat_template=True,
        max_tokens=4,
    )
    summary = await stub.GenerateGroup(
        _request("ag1", [reward_address], experiment_id="chat"), timeout=60
    )
    assert summary.status == rollout_pb2.GROUP_STATUS_ACCEPTED, summary.reason
    [group] = await _read_back(js, train_subject("chat"), 1)
    tok = AutoTokenizer.from_pretrained(str(chat_tokenizer))
    assert tok.decode(group.prompt_ids) == "u:1+1=<eos>a:"
    follow_up = tok("u:sure?<eos>a:", add_special_tokens=False).input_ids
    for s in group.samples:
        env = [i for i, m in enumerate(s.loss_mask) if m == 0]
        first = s.output_ids[: env[0]]
        closes = [] if first[-1] == tok.eos_token_id else [tok.eos_token_id]
        assert [s.output_ids[i] for i in env] == closes + follow_up  # one contiguous env run
        assert env == list(range(env[0], env[0] + len(env)))
        second = s.output_ids[env[-1] + 1 :]
        assert 1 <= len(first) <= 4 and 1 <= len(second) <= 4
        assert s.text == tok.decode(second, skip_special_tokens=True)  # the scored answer
        assert s.reward_status is RewardStatus.OK


async def test_chat_template_without_one_in_tokenizer_is_invalid_argument(rollout, models):
    stub, _ = rollout
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _serve(stub, models, "ct", chat_template=True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rollout.workflow.chat_template" in err.value.details()


async def test_bad_workflow_is_invalid_argument_failing_workflow_fails_group(
    rollout, reward_address, models
):
    stub, _ = rollout
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _bind(stub, models, "bw", workflow="multi_turn", max_turns=0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rollout.workflow" in err.value.details() and "max_turns" in err.value.details()
    exp = await _serve(stub, models, "bw", workflow="tests.fixtures_plugins.workflows:Broken")
    summary = await stub.GenerateGroup(
        _request("bw2", [reward_address], experiment_id=exp), timeout=30
    )
    assert summary.status == rollout_pb2.GROUP_STATUS_FAILED
    assert "scripted workflow failure" in summary.reason and not summary.published
