"""Pure parts of the SGLang adapter: launch command, version differences, response parsing,
error messages, bucket plans for the collective weight update."""

from __future__ import annotations

import pytest

from asyncrl.tiny import build_tiny_model
from services.rollout.sglang_engine import ServerApi, error_message, parse_generate_response
from services.rollout.sglang_process import LaunchConfig, build_command, parse_version
from services.rollout.sglang_sync import TensorMeta, bucket_request, plan_buckets, tensor_metas


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
    ("version", "reports", "body", "info"),
    [
        ("0.4.10", False, None, "/get_model_info"),
        ("0.5.1", True, None, "/get_model_info"),
        ("0.5.4", True, None, "/get_model_info"),
        ("0.5.5", True, {"mode": "abort"}, "/get_model_info"),
        ("0.5.9", True, {"mode": "abort"}, "/model_info"),
    ],
)
def test_server_api_differences_by_version(version, reports, body, info):
    api = ServerApi(parse_version(version))
    assert api.reports_weight_version is reports
    assert api.pause_body == body
    assert api.model_info_paths[0] == info


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


def test_error_message_reads_both_sglang_error_shapes():
    assert error_message(400, '{"success": false, "message": "bad path"}') == "bad path"
    assert error_message(400, '{"error": {"message": "too long"}}') == "too long"
    assert error_message(500, "Internal Server Error") == "Internal Server Error"
    assert error_message(502, "") == "HTTP 502"


def test_plan_buckets_splits_by_bytes_and_keeps_big_tensors_alone():
    metas = [
        TensorMeta("a", "float32", (10,)),  # 40 B
        TensorMeta("b", "bfloat16", (10, 2)),  # 40 B
        TensorMeta("c", "float32", (100,)),  # 400 B
        TensorMeta("d", "int8", (8,)),
    ]  # 8 B
    assert [[m.name for m in b] for b in plan_buckets(metas, 100)] == [["a", "b"], ["c"], ["d"]]
    assert [[m.name for m in b] for b in plan_buckets(metas, 0)] == [["a"], ["b"], ["c"], ["d"]]
    assert len(plan_buckets(metas, 1 << 20)) == 1


def test_bucket_request_sets_version_and_flush_on_the_last_bucket_only():
    bucket = [TensorMeta("w", "bfloat16", (2, 3))]
    assert bucket_request(bucket, "g", 4, last=False) == {
        "names": ["w"],
        "dtypes": ["bfloat16"],
        "shapes": [[2, 3]],
        "group_name": "g",
        "flush_cache": False,
    }
    last = bucket_request(bucket, "g", 4, last=True)
    assert last["flush_cache"] is True and last["weight_version"] == "4"


def test_tensor_metas_reads_safetensors_headers_sorted(tmp_path):
    model, _ = build_tiny_model(tmp_path, hidden_size=32, num_layers=1)
    metas = tensor_metas(tmp_path)
    names = [m.name for m in metas]
    assert names == sorted(names)
    state = model.state_dict()
    assert "lm_head.weight" not in names  # tied: not saved, not sent
    for m in metas:
        assert m.dtype == "float32" and m.shape == tuple(state[m.name].shape)
