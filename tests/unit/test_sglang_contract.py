"""The SGLang engine's requests and the answers it reads, checked against the installed
`sglang` package (pinned, installed without its GPU dependencies): /generate bodies through
sglang's request schema and SamplingParams checks, control bodies through its io_struct types,
the launch argv through the flags its ServerArgs declares, answers as sglang's api_types build
them, and the facts the engine and the fake rely on (tests/sglang_contract.py says how a
module that needs CUDA is read). The calls a real engine run makes:
tests/integration/test_sglang_contract_calls.py."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import msgspec
import pytest

from asyncrl import buckets
from asyncrl.spec import SamplingParams, SpecError, spec_from_json
from asyncrl.tiny import build_tiny_model
from services.rollout.engine import GenRequest
from services.rollout.sglang_process import LaunchConfig, LoraLaunch, build_command, parse_version
from services.rollout.sglang_protocol import (
    MAX_STOP_STRINGS,
    InvalidSampling,
    PromptTooLong,
    ServerApi,
    abort_body,
    adapter_name,
    continue_body,
    disk_update_body,
    error_message,
    generate_body,
    init_group_body,
    lora_load_body,
    lora_unload_body,
    parse_context_length,
    parse_generate_response,
    session_body,
    wire_rid,
)
from services.rollout.sglang_sync import bucket_request
from tests import sglang_contract as sg
from tests.fakes import sglang_rules
from tests.fakes.sglang_weights import flattened_layout

API = ServerApi(parse_version(sg.PINNED))
REPO = Path(__file__).resolve().parents[2]
SPEC = {"model": {"path": "/m"}, "dataset": {"path": "/d.jsonl"}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(tokenizer, vocab size, context length) of the tiny test model."""
    from transformers import AutoConfig, AutoTokenizer

    path = tmp_path_factory.mktemp("sglang-contract") / "model"
    build_tiny_model(path)
    config = AutoConfig.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path), config.vocab_size, config.max_position_embeddings


def test_installed_sglang_is_the_pinned_release():
    assert sg.version() == sg.PINNED
    pins = (REPO / "requirements-sglang.txt").read_text().split()
    assert f"sglang=={sg.PINNED}" in pins


def body_of(prompt_len: int, done: int = 0, context: int | None = None, **params) -> dict:
    req = GenRequest("g:1", list(range(3, 3 + prompt_len)), SamplingParams(**params), [2])
    rid = wire_rid(req.rid, 1 if done else 0, 7)
    return generate_body(req, rid, list(range(5, 5 + done)), [2], context)


GENERATE_CASES = {
    "defaults": {},
    "greedy, top_k 0": {"temperature": 0.0, "top_k": 0},
    "sampled, top_k 0 (sent as -1)": {"temperature": 0.8, "top_k": 0},
    "top_k 20, top_p 0.9": {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
    "32 stop strings": {"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)]},
    "ignore_eos": {"ignore_eos": True, "max_new_tokens": 16},
}


@pytest.mark.parametrize("params", GENERATE_CASES.values(), ids=GENERATE_CASES.keys())
@pytest.mark.parametrize("done", [0, 3], ids=["first segment", "resumed"])
def test_generate_bodies_pass_sglang_schema_sampling_and_context_checks(model, params, done):
    tokenizer, vocab, context = model
    sg.check_generate(body_of(6, done, context, **params), tokenizer, vocab, context)


def test_generate_body_near_the_context_is_clamped_to_what_sglang_admits(model):
    tokenizer, vocab, context = model
    body = body_of(context - 10, context=context, max_new_tokens=128)
    assert body["sampling_params"]["max_new_tokens"] == 10  # context - prompt
    sg.check_generate(body, tokenizer, vocab, context)
    assert sg.admits(context - 10, 10, context) and not sg.admits(context - 10, 11, context)
    assert not sg.admits(context, 0, context)  # a prompt of the whole context: refused
    with pytest.raises(PromptTooLong, match=f"input \\({context} tokens\\).*\\({context} tokens"):
        body_of(context, context=context)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda sp: sp.update(top_k=0), "top_k must be -1 .* got 0"),
        (lambda sp: sp.update(seed=3), "unknown field `seed`"),
        (lambda sp: sp.update(stop=[f"s{i}" for i in range(33)]), "at most 32 stop strings"),
        (lambda sp: sp.update(max_new_tokens=10_000), "do not fit a context"),
    ],
    ids=["top_k 0", "unknown key", "33 stops", "over the context"],
)
def test_sglang_checks_refuse_what_the_engine_must_not_send(model, mutate, message):
    """The checks above can fail: each body the server would answer with a 400 is refused."""
    tokenizer, vocab, context = model
    body = body_of(6, context=context, temperature=0.8)
    mutate(body["sampling_params"])
    with pytest.raises(sg.ContractBroken, match=message):
        sg.check_generate(body, tokenizer, vocab, context)


def test_more_stop_strings_than_sglang_takes_refused_naming_the_field():
    # the spec refuses 33 at submit; a workflow's override (model_copy(update=)) skips that
    params = SamplingParams().model_copy(update={"stop": ["x"] * 33})
    with pytest.raises(
        InvalidSampling, match="^stop: SGLang takes at most 32 stop strings, got 33$"
    ) as e:
        generate_body(GenRequest("r", [3], params), "3:r/r0.0", [], [])
    assert e.value.field == "stop"
    with pytest.raises(SpecError) as exc:
        spec_from_json(json.dumps(SPEC | {"rollout": {"gconfig": {"stop": ["x"] * 33}}}))
    assert exc.value.field == "rollout.gconfig.stop"
    spec_from_json(json.dumps(SPEC | {"rollout": {"gconfig": {"stop": ["x"] * 32}}}))


def test_control_bodies_parse_into_sglang_io_struct_types():
    p = buckets.plan([("a.weight", "bfloat16", (4, 2)), ("b.bias", "float32", (4,))], 64, True)
    bodies = {
        "/pause_generation": API.pause_body,
        "/continue_generation": continue_body(),
        "/abort_request": abort_body(wire_rid("g:1", 0, 3)),
        "/update_weights_from_disk": disk_update_body("/w/v3", 3, API),
        "/init_weights_update_group": init_group_body("10.0.0.1:29500", 1, 2, "grp", "nccl"),
        "/begin_weight_update": session_body(),
        "/end_weight_update": session_body(),
    }
    for path, body in bodies.items():
        sg.check_control(path, body)
    for last in (False, True):
        body = bucket_request(p.bucket(0), "grp", 3, last)
        sg.check_control("/update_weights_from_distributed", body)
    assert sg.route("/pause_generation")[1] == "PauseGenerationReqInput"


def test_control_checks_refuse_a_body_sglang_would_not_take():
    with pytest.raises(sg.ContractBroken, match="PauseGenerationReqInput refuses"):
        sg.check_control("/pause_generation", {"mode": "stop"})
    with pytest.raises(sg.ContractBroken, match="a 422 without one"):
        sg.check_control("/continue_generation", None)
    with pytest.raises(sg.ContractBroken, match=r"\['flush'\] are not fields"):
        sg.check_control("/update_weights_from_disk", {"model_path": "/w", "flush": True})


def test_launch_argv_parses_with_the_flags_sglang_server_args_declares():
    cfg = LaunchConfig(model_path="/m", port=31000, tp_size=2, mem_fraction=0.7, weight_version=3)
    argv = build_command(cfg, API.version)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    fields = ["model_path", "host", "port", "tp_size", "mem_fraction_static", "random_seed"]
    fields += ["skip_server_warmup", "weight_version"]
    parsed = sg.parse_launch_args(argv[3:], fields)
    assert parsed == {
        "model_path": "/m",
        "host": "127.0.0.1",
        "port": 31000,
        "tp_size": 2,
        "mem_fraction_static": 0.7,
        "random_seed": 1,
        "skip_server_warmup": True,
        "weight_version": "3",
    }
    with pytest.raises(sg.ContractBroken, match="unknown options"):
        sg.parse_launch_args(["--model-path", "/m", "--gpu-fraction", "0.7"], fields)


@pytest.mark.parametrize(
    ("finish", "kind"),
    [("FinishAbort", "abort"), ("FinishStop", "stop"), ("FinishLength", "length")],
)
def test_generate_answer_as_sglang_encodes_it_parses(finish, kind):
    api = sg.api_types()
    meta = api.GenerateMetaInfo(
        id="8:g:1/r0.7",
        finish_reason=getattr(api, finish)(),
        output_token_logprobs=[
            api.LogprobEntry(logprob=-0.5, token_id=7, text=None),
            api.LogprobEntry(logprob=-1.25, token_id=8, text=None),
        ],
        weight_version="3",
    )
    answer = api.GenerateResponse(text="ab", meta_info=meta, output_ids=[7, 8]).to_json_value()
    ids, lps, got, info = parse_generate_response(answer)
    assert (ids, lps, got, info["weight_version"]) == ([7, 8], [-0.5, -1.25], kind, "3")
    assert [f.name for f in msgspec.structs.fields(api.LogprobEntry)] == [
        "logprob",
        "token_id",
        "text",
    ]


def test_info_answers_the_engine_reads_are_what_sglang_serves():
    api = sg.api_types()
    server = {f.name: f.type for f in msgspec.structs.fields(api.GetServerInfoResponse)}
    assert server["version"] is str
    assert '"version": __version__' in sg.calls_in(sg.HTTP_SERVER, "server_info")
    model = {f.name for f in msgspec.structs.fields(api.GetModelInfoResponse)}
    assert "weight_version" in model
    assert '"weight_version"' in sg.calls_in(sg.HTTP_SERVER, "model_info")
    # GET /v1/models: ModelList(data=[ModelCard(max_model_len=model_config.context_len)])
    protocol = "srt/entrypoints/openai/protocol.py"
    assert "max_model_len" in sg.calls_in(protocol, "ModelCard")
    assert "data: List[ModelCard]" in sg.calls_in(protocol, "ModelList")
    listing = sg.calls_in(sg.HTTP_SERVER, "available_models")
    sg.require(
        "max_model_len=_global_state.tokenizer_manager.model_config.context_len" in listing,
        "/v1/models no longer reports model_config.context_len as max_model_len",
    )
    answer = {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]}
    assert parse_context_length(answer) == 4096


def test_distributed_updates_need_the_session_the_engine_opens():
    for path in ("/begin_weight_update", "/end_weight_update"):
        sg.route(path)
    updater = "srt/managers/scheduler_components/weight_updater.py"
    sg.require(
        "if self._session is None:" in sg.calls_in(updater, "update_weights_from_distributed"),
        "update_weights_from_distributed no longer checks for a weight-update session",
    )
    sg.require(
        "already open" in sg.calls_in(updater, "begin_weight_update"),
        "begin_weight_update no longer says a session is already open (the engine's cue)",
    )
    assert API.needs_update_session


BUCKETS = [
    (["a", "b", "c"], ["bfloat16", "float32", "int8"], [[3, 2], [4], [5]]),  # aligned
    (["a", "b"], ["int8", "float32"], [[3], [1]]),  # b at byte 3: misaligned
    (["a"], ["float32"], [[2, -1]]),  # a negative dimension
    ([], [], []),  # no tensor
]


@pytest.mark.parametrize(("names", "dtypes", "shapes"), BUCKETS)
def test_fake_flattened_bucket_layout_and_refusals_are_sglangs(names, dtypes, shapes):
    real = sg.tensor_bucket_module().FlattenedTensorBucket
    try:
        bucket = real.empty(names, dtypes, shapes, "cpu")
    except ValueError as e:
        with pytest.raises(ValueError) as fake:
            flattened_layout(names, dtypes, shapes)
        assert str(fake.value) == str(e)
        return
    layout, total = flattened_layout(names, dtypes, shapes)
    assert total == bucket.get_flattened_tensor().numel()
    assert [(n, d, s, a, z) for n, d, s, a, z in layout] == [
        (m.name, m.dtype, m.shape, m.start_idx, m.end_idx) for m in bucket.get_metadata()
    ]


def test_packed_plans_are_buckets_sglang_rebuilds_and_the_update_path_takes_them():
    metas = [("a", "int8", (3,)), ("b", "float32", (2,)), ("c", "bfloat16", (5,))]
    metas += [("d", "int64", (1,)), ("e", "int8", (1,))]
    p = buckets.plan(metas, 24, packed=True)
    real = sg.tensor_bucket_module().FlattenedTensorBucket
    for i, size in enumerate(p.sizes):
        body = bucket_request(p.bucket(i), "grp", 1, last=False)
        bucket = real.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
        assert bucket.get_flattened_tensor().numel() == size
        assert [m.start_idx for m in bucket.get_metadata()] == [s.offset for s in p.bucket(i)]
    runner = "srt/model_executor/model_runner_components/weight_updater.py"
    sg.require(
        'if load_format == "flattened_bucket":'
        in sg.calls_in(runner, "receive_weights_from_distributed"),
        "receive_weights_from_distributed no longer takes flattened buckets (any other "
        "load_format: one broadcast per tensor, as the fake)",
    )
    updater = "srt/managers/scheduler_components/weight_updater.py"
    sg.require(
        'f"Failed to receive weights: {e}"'
        in sg.calls_in(updater, "update_weights_from_distributed"),
        "a refused bucket is no longer answered 'Failed to receive weights: ...' (the fake's)",
    )
    assert "load_format" in sg.struct_fields("UpdateWeightsFromDistributedReqInput")


def test_abort_matches_by_prefix_and_wire_rids_are_prefix_free():
    scheduler = sg.calls_in("srt/managers/scheduler.py", "abort_request")
    sg.require(
        "req.rid.startswith(recv_req.rid)" in scheduler,
        "the scheduler's abort no longer matches by prefix",
    )
    rids = ["g:1", "g:10", "g:1/r1", "g:1/r1.2", "", "7:g:1", "g:1/r1.20"]
    sent = [wire_rid(rid, seg, seq) for rid in rids for seg in (0, 1, 12) for seq in (2, 20, 201)]
    assert len(set(sent)) == len(sent)
    for a in sent:
        assert [b for b in sent if b != a and b.startswith(a)] == []
    assert wire_rid("g:1", 0, 7) == "8:g:1/r0.7"


def test_fake_rules_track_sglang():
    api = sg.api_types()
    keys = tuple(f.name for f in msgspec.structs.fields(api.SamplingParams))
    assert sglang_rules.SAMPLING_KEYS == keys
    assert sglang_rules.MAX_STOP_COUNT == sg.sampling_module().MAX_STOP_COUNT == MAX_STOP_STRINGS
    mode = sg.struct_fields("PauseGenerationReqInput")["mode"][0]
    assert typing.get_args(sg.evaluate(mode, "PauseGenerationReqInput.mode")) == (
        sglang_rules.PAUSE_MODES
    )
    pause = sg.calls_in(sg.TOKENIZER_MANAGER, "pause_generation")
    sg.require("await asyncio.sleep(1.0)" in pause, "the abort pause no longer polls every 1 s")
    timeout = 'HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))'
    sg.require(timeout in (sg.root() / sg.HTTP_SERVER).read_text(), "health timeout moved")


# ------------------------------------------------------------------------------- LoRA
def test_lora_bodies_pass_sglang_checks(model):
    """A segment naming an adapter, and the load / unload of one, as sglang takes them."""
    tokenizer, vocab, context = model
    req = GenRequest("g:1", list(range(3, 9)), SamplingParams(), [2])
    name = adapter_name(7, 3)
    body = generate_body(req, wire_rid("g:1", 0, 1), [], [2], context, adapter=name)
    assert body["lora_path"] == name
    sg.check_generate(body, tokenizer, vocab, context)
    sg.check_control("/load_lora_adapter", lora_load_body(name, "/w/v000007"))
    sg.check_control("/unload_lora_adapter", lora_unload_body(name))
    assert sg.route("/load_lora_adapter")[1] == "LoadLoRAAdapterReqInput"
    assert sg.route("/unload_lora_adapter")[1] == "UnloadLoRAAdapterReqInput"
    with pytest.raises(sg.ContractBroken, match="lora_path"):
        sg.check_control("/load_lora_adapter", {"lora_name": name})  # lora_path required


def test_lora_launch_flags_parse_with_sglang_server_args():
    flags = LoraLaunch(max_rank=16, target_modules=("q_proj", "v_proj"), max_per_batch=3)
    argv = build_command(LaunchConfig(model_path="/m", lora=flags), API.version)
    fields = ["model_path", "host", "port", "tp_size", "mem_fraction_static", "random_seed"]
    fields += ["skip_server_warmup", "enable_lora", "max_lora_rank", "lora_target_modules"]
    fields += ["max_loras_per_batch"]
    parsed = sg.parse_launch_args(argv[3:], fields)
    assert parsed["enable_lora"] is True and parsed["max_lora_rank"] == 16
    assert parsed["lora_target_modules"] == ["q_proj", "v_proj"]
    assert parsed["max_loras_per_batch"] == 3
    with pytest.raises(sg.ContractBroken, match="refuses"):  # not a module sglang adapts
        sg.parse_launch_args(["--lora-target-modules", "wte"], ["lora_target_modules"])


def test_lora_answers_and_refusals_are_what_the_engine_reads():
    """The LoRA routes answer io_struct.LoRAUpdateOutput; a failure's reason is its
    `error_message` (the engine shows it), and a name in use is refused by sglang, which is
    why every load gets a new name."""
    fields = sg.struct_fields("LoRAUpdateOutput")
    assert {"success", "error_message", "loaded_adapters"} <= set(fields)
    assert error_message(400, json.dumps({"success": False, "error_message": "no"})) == "no"
    sg.require(
        "already loaded" in sg.calls_in("srt/lora/lora_manager.py", "validate_new_adapter"),
        "sglang no longer refuses an adapter name in use: adapter_name's rule may be moot",
    )
    assert adapter_name(3, 0) != adapter_name(3, 1) and "." not in adapter_name(3, 0)
