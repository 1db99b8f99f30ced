"""The check's report as markdown: one table per part, failures with their error."""

from __future__ import annotations


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("-" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(x, digits: int = 3):
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-2 and x else round(x, digits)
    return x


def _ckpt(c: dict | None) -> str:
    if not c:
        return "-"
    return f"save {c['save_s']} s, load {c['load_s']} s" if c["ok"] else "FAILED"


def _train(parts: list[dict]) -> str:
    rows = [
        [p["shape"], p.get("params_m"), p.get("dtype"), f"{p.get('rows')} x {p.get('row_tokens')}",
         p.get("step_s"), p.get("first_step_s"), p.get("tokens_per_s"), p.get("loss_tokens_per_s"),
         p.get("peak_mem_gib"), p.get("peak_reserved_gib"), _ckpt(p.get("checkpoint"))]
        for p in parts if p["ok"]
    ]  # fmt: skip
    header = ["shape", "params (M)", "dtype", "rows x tokens", "step s (median)", "first step s",
              "tokens/s", "loss tokens/s", "peak alloc GiB", "peak reserved GiB", "checkpoint"]  # fmt: skip
    return "### Megatron-Core train step (TP=1)\n\n" + _table(header, rows)


def _engine(p: dict) -> str:
    i = p["interrupt"]
    lp = i["logprob_check"]
    rows = [
        ["shape / device", f"{p['shape']} / {p['device']}"],
        ["concurrent requests x new tokens", f"{p['concurrency']} x {p['max_new_tokens']}"],
        ["tokens/s (wall, all requests)", p["tokens_per_s"]],
        ["decode step ms (64 rows)", p["step_ms"]],
        ["interrupt: requests updated mid-generation", f"{i['interrupted']} / {i['requests']}"],
        ["interrupt: outputs with versions 0..0 1..1", f"{i['mixed_version_outputs']} (monotone: {i['versions_monotone']})"],
        ["update s (read / pause / load / resume)", f"{i['update_s']} ({i['read_s']} / {i['pause_s']} / {i['load_s']} / {i['resume_s']})"],
        ["recorded vs HF fp32 logprobs, max / mean abs diff", f"{_fmt(lp['max_abs'])} / {_fmt(lp['mean_abs'])} ({lp['tokens']} tokens)"],
    ]  # fmt: skip
    return "### Torch engine\n\n" + _table(["", ""], rows)


def _weights(parts: list[dict]) -> str:
    rows = [
        [p["shape"], p["device"], p["version_mib"], t, r["serving_s"], f"{r['x_copy']}x",
         r["stall_s"], " / ".join(str(r.get(k, "-")) for k in ("pack_s", "seal_s", "send_s", "receive_s", "apply_s")),
         r["sent_mib"]]
        for p in parts if p["ok"] for t, r in p["transports"].items()
    ]  # fmt: skip
    copies = ", ".join(f"{p['shape']} {_fmt(p['copy_s'], 4)} s" for p in parts if p["ok"])
    header = ["shape", "device", "MiB", "transport", "train end -> 2 engines serving s",
              "x copy", "trainer stall s", "gather / seal / send / receive / apply s", "MiB sent"]  # fmt: skip
    head = f"### Weights into two engines (copy of 2 x the bytes on the device: {copies})"
    return head + "\n\n" + _table(header, rows)


def _stack(p: dict) -> str:
    mg, hf = p.get("mismatch_megatron", {}), p.get("mismatch_hf_fp32", {})
    td = p.get("trainer_logprob_diff", {})
    rows = [
        ["model", f"{p['shape']} (random weights, char tokenizer)"],
        ["services start s", p.get("start_s")],
        ["GPU placement (CUDA_VISIBLE_DEVICES)", p.get("gpus")],
        ["steps (state)", f"{p.get('steps')} ({p.get('experiment_state')}{', cancelled at the cap' if p.get('cancelled_at_cap') else ''})"],
        ["run s / s per step", f"{p.get('run_s')} / {p.get('s_per_step')}"],
        ["B x n x max_new_tokens", f"{p['batch_size']} x {p['n_samples']} x {p['max_new_tokens']}"],
        ["groups read back", p.get("groups_read")],
        ["mismatch vs megatron (trainer): mean / max abs, tokens", f"{_fmt(mg.get('mean_abs'))} / {_fmt(mg.get('max_abs'))}, {mg.get('tokens')}"],
        ["trainer's own logprob_diff in the run: mean / max abs, tokens", f"{_fmt(td.get('mean_abs'))} / {_fmt(td.get('max_abs'))}, {td.get('tokens')}"],
        ["mismatch vs HF fp32 forward: mean / max abs", f"{_fmt(hf.get('mean_abs'))} / {_fmt(hf.get('max_abs'))}"],
        ["versions measured", len(mg.get("versions_measured", []))],
    ]  # fmt: skip
    return "### Whole stack (SmolLM2 task)\n\n" + _table(["", ""], rows)


def _math(p: dict) -> str:
    ledger = p.get("ledger") or {}
    totals = ledger.get("totals", {})
    fates = ", ".join(f"{k} {totals[k]}" for k in ("trained", "left_over", "lost", "trained_twice", "in_flight") if k in totals)  # fmt: skip
    evals = ", ".join(f"v{e['version']} {_fmt(e['accuracy'])} ({e['n_prompts']} prompts)" for e in p.get("evals", []))  # fmt: skip
    rows = [
        ["spec", f"{p['spec']} ({p['engine']} engine, {p['backend']} trainer, {p['reward']})"],
        ["changed for this machine", ", ".join(f"`{o}`" for o in p["overrides"])],
        ["model", f"{p['shape']} (random weights, char tokenizer)"],
        ["services start s", p.get("start_s")],
        ["GPU placement (CUDA_VISIBLE_DEVICES)", p.get("gpus")],
        ["steps (state)", f"{p.get('steps')} of {p['total_steps']} ({p.get('experiment_state')}{', cancelled at the cap' if p.get('cancelled_at_cap') else ''})"],
        ["run s / s per step / trainer step s (median)", f"{p.get('run_s')} / {p.get('s_per_step')} / {p.get('step_time_s')}"],
        ["B x n x max_new_tokens", f"{p['batch_size']} x {p['n_samples']} x {p['max_new_tokens']}"],
        ["reward_mean per step", p.get("reward_mean_per_step")],
        ["samples read back: reward mean, not final_answer of their text", f"{p.get('samples')}: {_fmt(p.get('reward_mean'))}, {p.get('reward_mismatches')}"],
        ["eval accuracy", evals or None],
        ["ledger", f"{'clean' if p.get('ledger_clean') else 'NOT clean'}: {fates}; {ledger.get('steps')} steps, {ledger.get('trained_groups')} groups"],
    ]  # fmt: skip
    return "### Math recipe (examples/math/gpu.yaml)\n\n" + _table(["", ""], rows)


def markdown(report: dict) -> str:
    m = report["machine"]
    out = [
        f"## gpu-check {'(dry run, CPU)' if report['dry_run'] else ''}".rstrip(),
        "",
        f"{m.get('date')} · device {report['device']} {m.get('gpu', '')} · torch {m.get('torch')} · "
        f"megatron-core {m.get('megatron-core')} · transformers {m.get('transformers')} · "
        f"total {report.get('total_s')} s",
        "",
        f"machine: {m.get('line', 'unknown')}",
        "",
        "`" + report["command"] + "`",
    ]
    parts = report["parts"]
    train = [p for p in parts if p["part"] == "train"]
    if train:
        out += ["", _train(train)]
    weights = [p for p in parts if p["part"] == "weights"]
    if any(p["ok"] for p in weights):
        out += ["", _weights(weights)]
    for p in parts:
        if p["ok"] and p["part"] == "engine":
            out += ["", _engine(p)]
        if p["ok"] and p["part"] == "math":
            out += ["", _math(p)]
        if p["ok"] and p["part"] == "stack":
            out += ["", _stack(p)]
    problems = [f"- {p['part']} {p['shape']}: {x}" for p in parts for x in p.get("problems", [])]
    if problems:
        out += ["", "### Problems", "", *problems]
    failed = [p for p in parts if not p["ok"]]
    if failed:
        out += ["", "### Failed parts", ""]
        out += [f"- {p['part']} {p['shape']}: {p['error']}" for p in failed]
    status = _table(["part", "shape", "ok", "seconds", "cap s"],
                    [[p["part"], p["shape"], p["ok"], p.get("seconds"), p.get("cap_s")] for p in parts])  # fmt: skip
    return "\n".join([*out, "", status, ""])
