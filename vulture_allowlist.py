"""Names `vulture` (make lint) reports unused in libs/ and services/ that are used: called by a
framework, loaded by name, or kept as an interface for tests and benchmarks. Never imported
or executed; vulture reads these as uses. Anything new here needs its reason beside it.
`make lint` already ignores typer commands, pydantic validators, gRPC `intercept_*` hooks and
pydantic `model_config` (its --ignore-decorators / --ignore-names)."""

_ = object  # vulture only parses this file

# gRPC methods, called by the generated servicer base classes
_.GenerateGroup  # services/rollout/server.py
_.ListRewardFunctions  # services/reward/server.py
_.CheckpointNow  # services/trainer/server.py

# loaded by name from asyncrl.registry (ENGINES, TRAINER_BACKENDS, WORKFLOWS, FILTERS)
TorchEngine  # services/rollout/torch_engine.py
TorchBackend  # services/trainer/backends/torch_backend.py
SingleTurn  # libs/asyncrl/workflow.py
MultiTurn
AgentWorkflow
keep_all  # services/rollout/filters.py
nonconstant_reward

# read by libraries: transformers' Cache interface, tokenizers' Tokenizer properties
_.get_seq_length  # services/rollout/kv_pool.py
_.is_compileable
_.pre_tokenizer  # libs/asyncrl/tiny.py
_.decoder

# fields read by name: settings via getattr (Settings.service_args), StepMetrics fields (a
# dataclass made from the proto at import, `asyncrl.types._record_from_proto`), engine counters
# (dataclasses.asdict in TorchEngine.stats, for /metrics), the WeightPhase names (the trainer and
# the rollout label their histograms with the same strings)
scheduler_args  # libs/asyncrl/settings.py
rollout_args
reward_args
trainer_args
_.scheduler_s  # services/scheduler/fleet.py (StepMetrics)
_.rollout_read_s
_.rollout_pause_s
_.rollout_load_s
_.rollout_resume_s
step_seconds  # services/rollout/torch_engine.py (EngineCounters)
context_tokens
prefill_seconds
prefill_tokens
prefill_forwards
SERIALIZE  # libs/asyncrl/phases.py
WRITE
UPLOAD
TOTAL
turns  # libs/asyncrl/types.py Sample.turns: policy turns appended (the workflow tests read it)

# arguments a signature must have: a signal handler's, an abstract method's
signum  # libs/asyncrl/supervisor/daemon.py
frame
api_key  # libs/asyncrl/workflow.py AgentWorkflow.agent

# interfaces kept for tests and benchmarks (each is exercised there)
wait_until  # asyncrl.natsutil: tests/integration, bench/interrupt.py
CHAT_TEMPLATE  # asyncrl.tiny: tests of chat templates
build_tiny_model  # asyncrl.tiny: engine tests build two tiny checkpoints
_.settled  # ExperimentRunner.settled: tests wait for the dispatch loop to go idle
_.reopened  # GroupConsumer.reopened: the consumer test counts re-creations
_.model_info  # SGLangEngine.model_info: the SGLang contract tests
ppo_decoupled_loss  # services/trainer/algo.py: the loss on one minibatch, for parity tests
unshard  # services/trainer/megatron/convert.py: shard's inverse, the TP round-trip test
latest_checkpoint  # services/trainer/checkpoint.py: tests read the newest checkpoint (the service verifies via resume_point)
_.rootRank  # asyncrl.collective.Group.broadcast: torch's BroadcastOptions, read by the C++ side
_.rootTensor  # the same
weight_bytes_sent  # services/trainer/metrics.py StepTimes: read through asdict into StepMetrics
weight_bytes_full  # the same
_.broadcasts  # services/trainer/weight_sync.py WeightBroadcaster: broadcasts made, the tests count them
send_state  # the same: a version straight from tensors (tests, tools)
