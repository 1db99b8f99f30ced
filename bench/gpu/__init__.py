"""GPU readiness check (`make gpu-check`): one prepared script for a single-GPU machine.

Five parts, each in its own process with its own time cap, each reported on its own (a part
that fails or runs out of time is recorded as such; the others still run):

- `train`: one megatron-core train step (`MegatronBackend`, bf16, Megatron DDP + distributed
  optimizer on CUDA) on SmolLM2-135M's shape and on a ~0.5B Qwen2 shape, random weights:
  step time, peak memory, tokens/s;
- `engine`: the embedded torch engine on the device: tokens/s at 64 concurrent requests, then
  an interrupt + weight update mid-generation (per-token versions change), the recorded
  logprobs checked against a plain HF forward under the version that produced each token;
- `weights`: a trained version into two torch engines on the device, for SmolLM2-135M's and
  Qwen2.5-0.5B's shapes, per transport (`disk`, `broadcast`, `broadcast+delta`; bench/
  weights.py's measurement): train end -> both serving against a device-to-device copy of the
  bytes, the trainer's stall, and gather / seal / send / receive / apply;
- `math`: the math recipe's GPU spec (examples/math/gpu.yaml: final-answer reward, megatron
  trainer) through all four services under the supervisor for a few steps, on a random
  Qwen2.5-0.5B-shaped model with the torch engine (no SGLang there): steps, step time,
  rewards, evals, and whether the ledger is clean;
- `stack`: nats-server, scheduler, rollout, reward and trainer under the supervisor, running a
  SmolLM2-shaped chat-arithmetic experiment for as many steps as fit, then the rollout/trainer
  logprob mismatch: mean |logprob_rollout - logprob_trainer| over the tokens generated at each
  version, the trainer's side recomputed by the megatron backend under that version.

`python -m bench.gpu --dry-run` runs all five with tiny shapes on the CPU in seconds (the test
in make test); see docs/gpu.md.
"""
