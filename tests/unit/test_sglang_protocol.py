"""Pure parts of the SGLang adapter: its config from flat options, launch command, version
differences, response parsing, error messages, the bucket calls of the collective weight
update and its plan read from the trainer's store."""

from __future__ import annotations

import pytest

from asyncrl import buckets
from asyncrl.collective import open_store, plan_key
from services.rollout.engines import make_engine
from services.rollout.sglang_config import SGLangConfig
from services.rollout.sglang_engine import (
    ServerApi,
    SGLangBadResponse,
    error_message,
    parse_generate_response,
)
from services.rollout.sglang_process import LaunchConfig, build_command, parse_version
from services.rollout.sglang_sync import bucket_request, fetch_plan

FAKE_CMD = ["python", "-m", "tests.fakes.sglang_server"]


def test_make_engine_flat_launch_options_fill_the_nested_launch_config():
    engine = make_engine(
        "sglang",
        launch=True,
        launch_cmd=FAKE_CMD,
        tp_size=2,
        mem_fraction=0.7,
        extra_args=["--dtype", "bfloat16"],
        log_path="/tmp/child.log",
        drain_timeout_s=1.5,
        weight_sync="nccl",
        nccl_master="10.0.0.1:29500",
    )
    assert engine.url is None
    assert engine.launch_cfg == LaunchConfig(
        launch_cmd=FAKE_CMD,
        tp_size=2,
        mem_fraction=0.7,
        extra_args=["--dtype", "bfloat16"],
        log_path="/tmp/child.log",
    )
    assert engine.config.drain_timeout_s == 1.5
    assert engine.config.nccl_world == 3  # the trainer + two server GPUs


def test_make_engine_attach_keeps_defaults():
    engine = make_engine("sglang", url="http://127.0.0.1:30000/")
    assert engine.url == "http://127.0.0.1:30000" and engine.launch_cfg is None
    assert engine.config == SGLangConfig(url="http://127.0.0.1:30000/")
    assert (engine.config.weight_sync, engine.config.nccl_world) == ("disk", 2)


def test_sglang_options_launch_implied_by_model_path_or_launch_cmd():
    assert SGLangConfig.from_options(model_path="/m").launch == LaunchConfig(model_path="/m")
    assert SGLangConfig.from_options(launch_cmd=FAKE_CMD).launch.launch_cmd == FAKE_CMD


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"url": "http://h:1", "tp_sise": 2}, "unknown engine option 'tp_sise'"),
        ({"launch": True, "weight_version": 3}, "unknown engine option 'weight_version'"),
        ({"url": "http://h:1", "tp_size": 2}, "tp_size: options of a launched server.*nccl_world"),
        ({"url": "http://h:1", "launch_cmd": FAKE_CMD}, "either url .* or launch"),
        ({"tp_size": 2}, "needs --sglang-url URL"),
        ({"url": "http://h:1", "weight_sync": "shm"}, "weight_sync: expected disk or nccl"),
        ({"url": "http://h:1", "weight_sync": "nccl"}, "nccl_master: required as host:port"),
    ],
)
def test_sglang_options_misconfigured_raise_value_error_naming_it(opts, message):
    with pytest.raises(ValueError, match=message):
        make_engine("sglang", **opts)


def test_parse_version_release_candidates_and_garbage():
    assert parse_version("0.5.1rc0") == (0, 5, 1)
    assert parse_version("0.4.10.post2") == (0, 4, 10)
    assert parse_version("0.5") == (0, 5, 0)
    assert parse_version(None) == (0, 0, 0)


def test_build_command_new_sglang_passes_weight_version():
    cfg = LaunchConfig(
        model_path="/m",
        port=31000,
        tp_size=2,
        mem_fraction=0.7,
        weight_version=3,
        extra_args=["--dtype", "bfloat16"],
    )
    cmd = build_command(cfg, (0, 5, 9))
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[3:] == [
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.7",
        "--random-seed",
        "1",
        "--skip-server-warmup",
        "--weight-version",
        "3",
        "--dtype",
        "bfloat16",
    ]


def test_build_command_old_sglang_or_override_omits_what_does_not_apply():
    cfg = LaunchConfig(model_path="/m", port=1, weight_version=3, launch_cmd=["fake", "-x"])
    cmd = build_command(cfg, (0, 5, 0))
    assert cmd[:2] == ["fake", "-x"]
    assert "--weight-version" not in cmd


@pytest.mark.parametrize(
    ("version", "reports", "body", "info", "flat"),
    [
        ("0.4.10", False, None, "/get_model_info", False),
        ("0.5.1", True, None, "/get_model_info", False),
        ("0.5.4", True, None, "/get_model_info", False),
        ("0.5.5", True, {"mode": "abort"}, "/get_model_info", False),
        ("0.5.6", True, {"mode": "abort"}, "/get_model_info", True),
        ("0.5.9", True, {"mode": "abort"}, "/model_info", True),
    ],
)
def test_server_api_differences_by_version(version, reports, body, info, flat):
    api = ServerApi(parse_version(version))
    assert api.reports_weight_version is reports
    assert api.pause_body == body
    assert api.model_info_paths[0] == info
    assert api.takes_flattened_buckets is flat


def test_parse_generate_response_takes_ids_from_logprob_triples():
    data = [
        {
            "text": "ab",
            "output_ids": [7, 8],
            "meta_info": {
                "finish_reason": {"type": "abort", "message": "x"},
                "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None]],
                "weight_version": "2",
            },
        }
    ]
    ids, lps, finish, meta = parse_generate_response(data)
    assert (ids, lps, finish, meta["weight_version"]) == ([7, 8], [-0.5, -1.25], "abort", "2")


def test_parse_generate_response_without_output_ids_or_tokens():
    ids, lps, finish, _ = parse_generate_response(
        {"meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []}}
    )
    assert (ids, lps, finish) == ([], [], "abort")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "expected one answer, got a list of 0"),
        ({"text": "ab", "output_ids": [7]}, "no meta_info"),
        ({"output_ids": [7], "meta_info": {}}, "without output_token_logprobs"),
        ({"meta_info": {"completion_tokens": 2}}, "without output_token_logprobs"),
        (
            {"output_ids": [7, 8], "meta_info": {"output_token_logprobs": [[-0.5, 7, None]]}},
            r"output_ids \(2 tokens\) disagree .* \(1\)",
        ),
        ({"meta_info": {"output_token_logprobs": [[-0.5]]}}, "not a list of"),
        ({"meta_info": {"output_token_logprobs": [[None, 7, None]]}}, "not a list of"),
        ({"meta_info": {"output_token_logprobs": {"7": -0.5}}}, "not a list of"),
    ],
)
def test_parse_generate_response_malformed_raises_bad_response(data, message):
    with pytest.raises(SGLangBadResponse, match=message) as exc:
        parse_generate_response(data)
    assert exc.value.status == 200


def test_error_message_reads_both_sglang_error_shapes():
    assert error_message(400, '{"success": false, "message": "bad path"}') == "bad path"
    assert error_message(400, '{"error": {"message": "too long"}}') == "too long"
    assert error_message(500, "Internal Server Error") == "Internal Server Error"
    assert error_message(502, "") == "HTTP 502"


def test_bucket_request_is_one_flattened_bucket_with_version_and_flush_on_the_last_only():
    p = buckets.plan([("w", "bfloat16", (2, 3)), ("b", "float32", (3,))], 64, packed=True)
    assert bucket_request(p.bucket(0), "g", 4, last=False) == {
        "names": ["b", "w"],
        "dtypes": ["float32", "bfloat16"],
        "shapes": [[3], [2, 3]],
        "group_name": "g",
        "flush_cache": False,
        "load_format": "flattened_bucket",
    }
    last = bucket_request(p.bucket(0), "g", 4, last=True)
    assert last["flush_cache"] is True and last["weight_version"] == "4"


def test_fetch_plan_reads_the_trainers_plan_from_its_store():
    store = open_store("127.0.0.1", 0, True, 5)
    p = buckets.plan([("a", "float32", (3,)), ("b", "bfloat16", (5,))], 16, packed=True)
    store.set(plan_key("grp", 3), p.to_json())
    assert fetch_plan(f"127.0.0.1:{store.port}", "grp", 3, 5) == p
    with pytest.raises(RuntimeError):  # v4's plan never comes: the store's timeout
        fetch_plan(f"127.0.0.1:{store.port}", "grp", 4, 0.2)


def test_fetch_plan_refuses_a_padded_plan():
    store = open_store("127.0.0.1", 0, True, 5)
    store.set(plan_key("grp", 1), buckets.plan([("a", "int8", (3,))], 16).to_json())
    with pytest.raises(ValueError, match="not packed"):
        fetch_plan(f"127.0.0.1:{store.port}", "grp", 1, 5)
