"""The experiment spec: the one definition of what a user submits, as pydantic models.

These models are the source of truth. On the wire a spec travels as JSON (`spec_json` fields
in the protos), validated here on submit; its JSON Schema, generated from these models
(`make schema` -> protos/asyncrl/v1/experiment.schema.json), lets a client in any language
build one. Choice fields (engine, filter, backend, workflow) take their names from
`asyncrl.registry`, reward functions from `asyncrl.rewards`. `SpecError` names the offending
field (e.g. ``trainer.lr``) so servers answer INVALID_ARGUMENT with it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from asyncrl.errors import SpecError
from asyncrl.registry import ENGINES, FILTERS, TRAINER_BACKENDS, WORKFLOWS, is_plugin_name
from asyncrl.rewards import PLUGIN_PREFIX, REWARD_FUNCTIONS, is_plugin
from asyncrl.settings import settings
from asyncrl.spec_rules import check_broadcast, check_lora, chosen_weight_sync

__all__ = ["SpecError"]  # raised by every validator here; defined with its kin in asyncrl.errors

MAX_NAME = 200
"""Longest name or key (experiment name, dataset keys)."""
MAX_PATH = 4096
"""Longest file or directory path."""
MAX_TEXT = 16 * 1024
"""Longest string anywhere else in a spec (a reward kwarg, a stop string, a workflow argument)."""
MAX_ITEMS = 1024
"""Most entries of any list or mapping in a spec."""


class _Section(BaseModel):
    # attribute docstrings become the JSON Schema's descriptions
    # allow_inf_nan=False: every float of a spec is finite (inf would travel as JSON null and
    # be refused only by a worker, far from the submit)
    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,
    )


class SamplingParams(_Section):
    """Sampling settings for generation."""

    temperature: float = Field(1.0, ge=0.0)
    """Softmax temperature; 0 means greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    max_new_tokens: int = Field(1024, gt=0)
    """Upper bound on generated tokens per sample (1024: room for a worked answer; a task
    with short answers sets less, so that rollouts and the trainer's batches stay small)."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a sample (the tokenizer's EOS is one unless `ignore_eos`)."""
    stop: list[str] = Field(default_factory=list, max_length=32)
    """Stop strings: a sample ends with the token that completes one (torch and SGLang); at
    most 32, SGLang's limit."""
    ignore_eos: bool = False
    """Generate `max_new_tokens` tokens whatever is sampled: the tokenizer's EOS ends nothing
    (benchmarks). `stop_token_ids` and `stop` still apply."""


class ModelSpec(_Section):
    """The model trained, as its first version (v0)."""

    path: str = Field(max_length=MAX_PATH)
    """HuggingFace-format causal LM directory (config.json + safetensors + tokenizer)."""
    tokenizer_path: str | None = Field(None, max_length=MAX_PATH)
    """Tokenizer directory; defaults to `path`."""


class DatasetSpec(_Section):
    """The training prompts."""

    path: str = Field(max_length=MAX_PATH)
    """JSONL file, one prompt per line: a JSON object with at least `prompt_key` and
    `answer_key`, e.g. {"prompt": "2+3=", "answer": "5"}."""
    prompt_key: str = Field("prompt", max_length=MAX_NAME)
    """Key of a line's prompt: the text the model continues (or the user turn, with
    `rollout.workflow.chat_template`)."""
    answer_key: str = Field("answer", max_length=MAX_NAME)
    """Key of a line's reference answer, which the reward function compares a completion
    with (a number or other JSON value is taken as its text)."""
    epochs: int = Field(1, gt=0)
    """Passes over the prompts; the run ends when they are done or at `trainer.total_steps`,
    whichever comes first."""
    shuffle: bool = True
    """Shuffle each epoch's order (seeded with `seed` + epoch, so a resumed run walks the same
    order)."""
    max_prompts: int | None = Field(None, gt=0)
    """Use only the first N prompts (after loading, before shuffling)."""


class RewardSpec(_Section):
    """How a sample is scored (docs/rewards.md)."""

    function: str = "exact_match"
    """A built-in (exact_match, numeric_match, math_verify, regex) or plugin:<module>:<fn>."""
    timeout_s: float = Field(5.0, gt=0)
    """Per-item timeout; a timeout is a FAILED sample, never a silent 0."""
    kwargs: dict[str, str] = Field(default_factory=dict)
    """Keyword arguments of the function (strings; each function parses its own)."""

    @field_validator("function")
    @classmethod
    def _known_or_plugin(cls, v: str) -> str:
        """Checked by name only: the reward service that runs a plugin imports it."""
        if v not in REWARD_FUNCTIONS and not is_plugin(v):
            known = ", ".join([*REWARD_FUNCTIONS, "plugin:<module>:<fn>"])
            raise ValueError(f"unknown reward function {v!r} (one of {known})")
        return v


class WorkflowSpec(_Section):
    """How one trajectory is produced (docs/workflows.md)."""

    name: str = "single_turn"
    """A built-in (single_turn, multi_turn) or module:Class (an asyncrl.workflow.Workflow
    subclass)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the workflow's constructor."""
    chat_template: bool = False
    """Render each dataset prompt as a user turn with the tokenizer's chat template (generation
    prompt added); needed by chat workflows (`ctx.chat`, the OpenAI-compatible endpoint)."""

    @field_validator("name")
    @classmethod
    def _known_or_plugin(cls, v: str) -> str:
        """Checked by name only: the rollout that runs a plugin imports it."""
        if v not in WORKFLOWS.names and not is_plugin_name(v):
            known = ", ".join([*WORKFLOWS.names, "module:Class"])
            raise ValueError(f"unknown workflow {v!r} (one of {known})")
        return v


class RolloutSpec(_Section):
    """Generation: the engine, the group size and the staleness bound."""

    n_samples: int = Field(4, gt=0)
    """GRPO group size: samples per prompt."""
    max_head_offpolicyness: int = Field(2, ge=0)
    """eta: how many versions a trained sample may lag the trainer. 0 = synchronous RL (each
    version's samples come from the version before); 2, the default, lets generation run up to
    two versions ahead of training, which keeps both busy while the off-policy correction
    stays small."""
    max_concurrent_rollouts: int = Field(64, gt=0)
    """Upper bound on groups in flight."""
    gconfig: SamplingParams = Field(default_factory=SamplingParams)
    """Sampling settings of the training rollouts."""
    engine: ENGINES.literal() = "torch"
    """Inference engine the rollouts must run."""
    filter: FILTERS.literal() = "nonconstant_reward"
    """Dynamic filter: `nonconstant_reward` rejects groups whose rewards are all equal."""
    group_timeout_s: float = Field(600.0, gt=0)
    """Deadline of one dispatch call to a rollout (its groups generated, scored and
    published); a call past it fails and its groups are dispatched again under the same ids."""
    weight_update_timeout_s: float = Field(30.0, gt=0)
    """Deadline for each rollout to take a committed version (UpdateWeights). A rollout that
    has not answered by then (frozen, or stuck loading) is fenced, and the commit completes
    with the others; it also bounds how long one commit can wait."""
    workflow: WorkflowSpec = Field(default_factory=WorkflowSpec)
    """How one trajectory is produced; the system runs it n_samples times per prompt."""


class LoraSpec(_Section):
    """A LoRA adapter trained on the frozen base model (torch backend, torch engine): each
    version is the adapter (adapter_model.safetensors + adapter_config.json), not the model
    (docs/lora.md)."""

    rank: int = Field(8, gt=0, le=1024)
    """r: the inner dimension of each low-rank update B @ A."""
    alpha: float = Field(16.0, gt=0)
    """lora_alpha: the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input in the gradient forward only (the proximal and
    behaviour logprobs are taken without it)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Names (the last part of the module path) of the nn.Linear layers that get an
    adapter, e.g. q_proj, v_proj, gate_proj, up_proj, down_proj."""

    @field_validator("target_modules")
    @classmethod
    def _plain_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not name or len(name) > MAX_NAME or not name.replace("_", "").isalnum():
                raise ValueError(f"{name!r} is not a module name (letters, digits, _)")
        if len(set(v)) != len(v):
            raise ValueError(f"a module is named twice: {v}")
        return v


class TrainerSpec(_Section):
    """Training: the backend, the optimizer, the objective and the weight sync."""

    backend: TRAINER_BACKENDS.literal() = "megatron"
    """`megatron` (Megatron-Core GPTModel, TP/DP; docs/megatron.md) or `torch` (the
    HuggingFace model with torch.optim, one process; LoRA)."""
    batch_size: int = Field(8, gt=0)
    """B: groups per optimizer step (= per version)."""
    total_steps: int = Field(200, gt=0)
    """Optimizer steps (= versions) of the run; it ends earlier when the dataset's epochs are
    done."""
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate (the peak, with `lr_schedule: linear`)."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """`linear` decays the learning rate from `lr` to `lr * min_lr_ratio` over total_steps."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """The final learning rate of the linear schedule, as a fraction of `lr`."""
    minibatches: int = Field(1, gt=0)
    """Optimizer updates per version (the batch is split into this many minibatches)."""
    micro_batch_tokens: int = Field(8192, gt=0)
    """Megatron backend: padded tokens per forward pass (rows x padded length, at least one
    row); the proximal-logprob recompute and each minibatch run in micro-batches of that size.
    Larger is fewer passes and more activation memory."""
    eps_clip: float = Field(0.2, gt=0, lt=1)
    """PPO's clip: the ratio pi/pi_prox is clipped to [1 - eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: float | None = Field(None, gt=0)
    """The upper clip (DAPO's clip-higher, e.g. 0.28); unset: eps_clip."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual-clip PPO's c (e.g. 3): a token with a negative advantage loses at most c x |A|,
    however far its ratio grew; unset: no dual clip."""
    behav_imp_weight_cap: float | None = Field(5.0, gt=1.0)
    """Bound on the behaviour importance weight w = pi_prox/pi_behav: tokens above it are
    masked (token_cap), or the weight is truncated to it (token_tis, gspo)."""
    # -- the objective: each choice below is one name (services/trainer/losses.py) ---------
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Advantage estimator over a group's rewards: `grpo` (r - mean) / std; `dr_grpo`
    r - mean (GRPO without std normalisation); `rloo` r minus the mean of the others."""
    offpolicy_correction: Literal[
        "token_cap", "token_tis", "token_mis", "gspo", "seq_mis", "icepop", "cispo", "m2po"
    ] = "token_cap"
    """How the gap between behaviour and trained policy is corrected: `token_cap` (w, tokens
    with w > cap masked), `token_tis` (w truncated at cap), `token_mis` (tokens with w outside
    [is_mask_low, is_mask_high] masked), `gspo` (sequence-level ratios: geometric means of
    token ratios, weight truncated at cap), `seq_mis` (a sample whose geometric-mean weight is
    outside the bounds dropped whole), `icepop` (w zeroed outside the bounds, two-sided),
    `cispo` (REINFORCE with the IS weight pi/pi_behav clipped by cispo_eps_low/high, no gradient),
    `m2po` (tokens masked until the second moment of log w over the batch is at most
    m2po_bound). GSPO's paper clips its sequence ratio at eps 3e-4..4e-4: set eps_clip with
    it."""
    is_mask_low: float = Field(0.5, ge=0)
    """Lower bound of the masking corrections (token_mis, seq_mis, icepop)."""
    is_mask_high: float = Field(2.0, gt=0, validate_default=True)
    """Upper bound of the masking corrections (token_mis, seq_mis, icepop)."""
    m2po_bound: float = Field(0.04, gt=0)
    """M2PO: the bound on the second moment of the log behaviour weight."""
    cispo_eps_low: float = Field(1.0, gt=0, le=1.0)
    """CISPO: its weight pi/pi_behav is clipped below at 1 - cispo_eps_low (1: no lower bound,
    as MiniMax-M1)."""
    cispo_eps_high: float = Field(0.28, gt=0)
    """CISPO: its weight is clipped above at 1 + cispo_eps_high (verl, slime, SkyRL: 0.2-0.28)."""
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "dr_grpo"] = (
        "token_mean"
    )
    """How token losses make a minibatch's loss: the mean over tokens, the mean over samples
    of each sample's sum or mean, or Dr.GRPO's sum / (samples x loss_agg_constant). Unset with
    `gspo`: seq_mean_token_mean (GSPO's objective is a mean of sequence ratios)."""
    masked_tokens_in_norm: bool = True
    """Tokens an off-policy correction masks stay in the loss normaliser (AReaL's and slime's
    convention: a masked token adds 0 and does not raise the weight of its neighbours); false
    counts only the kept tokens (verl's masked IS)."""
    loss_agg_constant: int | None = Field(None, gt=0)
    """Dr.GRPO's constant normaliser in tokens; default rollout.gconfig.max_new_tokens."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL to the initial model (0: no reference model is kept)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator: k1 log(pi/ref), k2 log(pi/ref)^2 / 2, k3 (ref/pi - 1) -
    log(ref/pi)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL goes: a loss term, or a penalty kl_coef * sum_t kl_t on each reward."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: the loss less entropy_coef x the token-mean entropy."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradients are scaled to at most this global L2 norm before each optimizer update."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1: the decay of the gradient's running mean."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2: the decay of the squared gradient's running mean."""
    checkpoint_every: int = Field(10, gt=0)
    """Steps between the trainer's checkpoints. A checkpoint waits until every version trained
    is committed and in the ledger, so it stalls the step after it; a trainer restarted after
    a crash trains again from its last checkpoint (at most `checkpoint_every` - 1 steps)."""
    tp_size: int = Field(1, gt=0)
    """Megatron backend: tensor-parallel ranks (the trainer runs under torchrun with
    tp_size x dp_size processes, `ASYNCRL_TRAINER_NPROC`)."""
    dp_size: int = Field(1, gt=0)
    """Megatron backend: data-parallel ranks."""
    weight_sync: Literal["auto", "disk", "nats", "nccl", "broadcast"] = "auto"
    """How rollouts get a new version (services/trainer/transport.py): `auto` (the default,
    chosen at submit by `asyncrl.spec_rules.chosen_weight_sync`: `broadcast` for the torch
    engine without LoRA, where it is faster than `disk` (docs/benchmarks.md, "Weights at wire
    speed"), else `disk`; `nats` under the deprecated ASYNCRL_WEIGHTS_TRANSPORT=nats), `disk`
    (they load it from the weight store, a shared filesystem), `nats` (the trainer also uploads
    it to the NATS object store, rollouts fetch it into their cache: no shared filesystem),
    `nccl` (also broadcast to the SGLang engines' GPUs, the trainer rank 0; NCCL with CUDA, else
    gloo) or `broadcast` (streamed from the parameters in checksummed buckets to the torch
    engines over one process group, the store written beside it: services/trainer/broadcast.py).
    The weight store is written in every case."""
    nccl_master: str | None = Field(None, pattern=r"^.+:\d+$")
    """host:port of rank 0, the trainer (the engines' `nccl_master`; `broadcast`: its store).
    Unset with `broadcast`, the trainer hosts its store on its advertised host
    (ASYNCRL_ADVERTISE_HOST) at a port the OS gives it, and the rollouts learn that address
    with each version (CommitWeights, then UpdateWeights)."""
    broadcast_bucket_mb: int = Field(64, gt=0, le=4096)
    """`broadcast`: MiB per bucket (one collective each)."""
    broadcast_delta: bool = True
    """`broadcast`: a version may travel as the 4-byte words that changed since the previous one
    (indices + values per bucket; a bucket where that is not smaller goes whole), when every
    rollout holds the previous one; checked against the full version's checksums like a full
    one, so a rollout whose base differs rejects it and loads the version from the store."""
    broadcast_full_every: int = Field(8, ge=1)
    """`broadcast` with `broadcast_delta`: at most K-1 delta versions in a row, then a full one
    (one goes full also after a mismatch, a failed broadcast or a change of the group; 1: never
    a delta). Each delta version is proven whole by its checksums, so this is a backstop that
    bounds how long staging buffers live on deltas alone; 8 costs one full send in eight (with
    deltas at ~5 % of full, an average version moves ~17 % of its bytes)."""
    nccl_world_size: int | None = Field(None, gt=1)
    """Ranks of the weight-update group: 1 (the trainer) + the TP ranks of all engines."""
    loggers: list[Literal["tensorboard", "wandb"]] = Field(default_factory=lambda: ["tensorboard"])
    """Run logs of every step (all StepMetrics fields, weight-update phases included) and eval,
    under `<ASYNCRL_VAR>/runs/<experiment id>/` on the scheduler's host: `tensorboard` (event
    files in `tensorboard/`), `wandb` (a W&B run in `wandb/`: offline unless WANDB_MODE says
    otherwise or WANDB_API_KEY is set; `wandb sync` uploads an offline run later). TensorBoard is
    on by default (local files, no network, no account); W&B is opted into."""
    lora: LoraSpec | None = None
    """Train a LoRA adapter on the frozen base instead of every weight (torch backend and
    torch engine only); unset trains the full model."""

    @model_validator(mode="before")
    @classmethod
    def _gspo_aggregates_per_sequence(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("offpolicy_correction") == "gspo":
            return {"loss_agg": "seq_mean_token_mean", **data}
        return data

    @field_validator("loggers")
    @classmethod
    def _no_repeated_logger(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"a logger is named twice: {v}")
        return v

    @field_validator("is_mask_high")
    @classmethod
    def _above_low(cls, v: float, info: ValidationInfo) -> float:
        low = info.data.get("is_mask_low")
        if low is not None and v <= low:
            raise ValueError(f"must be above is_mask_low ({low})")
        return v

    @model_validator(mode="after")
    def _nccl_needs_its_group(self) -> TrainerSpec:
        if self.weight_sync == "nccl" and not (self.nccl_master and self.nccl_world_size):
            raise ValueError("weight_sync nccl needs nccl_master and nccl_world_size")
        return self


class EvalSpec(_Section):
    """Periodic evaluation on a held-out set."""

    dataset_path: str | None = Field(None, max_length=MAX_PATH)
    """JSONL eval set (same keys as the train set); unset disables eval."""
    every_versions: int = Field(5, ge=0)
    """Run eval every K versions (and at v0 and at the end); 0 = only at v0 and the end."""
    n_samples: int = Field(1, gt=0)
    """Samples per eval prompt (accuracy is over all of them)."""
    gconfig: SamplingParams = Field(default_factory=lambda: SamplingParams(temperature=0.0))
    """Sampling settings of eval (greedy by default)."""
    max_prompts: int | None = Field(None, gt=0)
    """Evaluate only the first N prompts of the eval set."""
    before_training: bool = True
    """Hold training until the run's first eval round (at v0: the baseline) is done, so that
    round measures v0 alone; false lets training start beside it, and the fleet's next
    versions then generate part of it (EvalResult.min/max_version say which). A resumed or
    restarted run that has evaluated before holds nothing."""
    one_version: bool = True
    """Every token of an eval round comes from the version it is labelled with: while a round
    generates, the fleet takes no new weights (commits are recorded; the trainer goes on
    until the staleness bound holds it), then it takes the newest. False lets the fleet update
    mid-round (no pause; EvalResult.min/max_version say which versions generated it)."""


class ExperimentSpec(_Section):
    """One RL experiment: what `asyncrl submit` sends (`asyncrl spec --defaults` prints every
    field with its default)."""

    name: str = Field("experiment", max_length=MAX_NAME)
    """A label for people; the experiment's id is derived from it."""
    model: ModelSpec
    """The model trained."""
    dataset: DatasetSpec
    """The prompts trained on (a JSONL file)."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """Generation: engine, group size, staleness bound, sampling."""
    reward: RewardSpec = Field(default_factory=RewardSpec)
    """How samples are scored."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    """Training: backend, optimizer, objective, checkpoints, weight sync."""
    eval: EvalSpec = Field(default_factory=EvalSpec)
    """Evaluation every few versions; off unless `eval.dataset_path` is set."""
    seed: int = 1
    """Seeds the dataset's shuffle (and the Megatron backend's random state)."""
    share: float = Field(1.0, gt=0)
    """This experiment's weight in the fleet: the scheduler spreads whole rollout replicas
    across experiments (a LoRA pool counting its experiments' mean) and the reward workers in
    proportion to it, and divides a LoRA pool's shared replicas' group slots between its
    experiments by it (docs/lora.md, "Sharing a fleet")."""


def check_files(spec: ExperimentSpec) -> None:
    """Raise SpecError for referenced files or directories that do not exist."""
    if not Path(spec.dataset.path).is_file():
        raise SpecError("dataset.path", f"file not found: {spec.dataset.path}")
    if spec.eval.dataset_path and not Path(spec.eval.dataset_path).is_file():
        raise SpecError("eval.dataset_path", f"file not found: {spec.eval.dataset_path}")
    if not (Path(spec.model.path) / "config.json").is_file():
        raise SpecError("model.path", f"no HuggingFace config.json in {spec.model.path}")
    tokenizer_dir = Path(spec.model.tokenizer_path or spec.model.path)
    if spec.rollout.workflow.chat_template and not has_chat_template(tokenizer_dir):
        raise SpecError("rollout.workflow.chat_template", f"no chat template in {tokenizer_dir}")


def check_reward_plugin(spec: ExperimentSpec) -> None:
    """SpecError("reward.function") for a plugin whose module is not on this host's path."""
    if is_plugin(spec.reward.function):
        module = spec.reward.function.removeprefix(PLUGIN_PREFIX).partition(":")[0]
        check_plugin_module(module, "reward.function")


def check_plugin_module(module: str, field: str) -> None:
    """SpecError(field) when the plugin module `module` (a.b.c) cannot be found on this host's
    path. Located, never imported: no user code runs (a top-level name is looked up by the
    finders, each package below it in its directories by importlib.machinery.PathFinder)."""
    parts = module.split(".")
    search: list[str] | None = None  # the package directories the next part is looked up in
    for depth in range(len(parts)):
        if depth == 0:  # a top-level name: every finder (editable installs too), no import
            found = importlib.util.find_spec(parts[0])
        else:
            name = ".".join(parts[: depth + 1])
            found = importlib.machinery.PathFinder.find_spec(name, search)
        if found is None:
            raise SpecError(field, f"plugin module {module!r} not found (no {parts[depth]!r})")
        search = found.submodule_search_locations
        if search is None and depth < len(parts) - 1:
            raise SpecError(
                field, f"plugin module {module!r} not found ({parts[depth]!r} is not a package)"
            )


def has_chat_template(tokenizer_dir: Path) -> bool:
    """Whether a saved tokenizer carries a chat template (chat_template.jinja, or the key in
    tokenizer_config.json), read without loading transformers."""
    if (tokenizer_dir / "chat_template.jinja").is_file():
        return True
    config = tokenizer_dir / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def validate_spec(data: dict) -> ExperimentSpec:
    """Validate a plain dict; raise SpecError naming the first bad field."""
    try:
        spec = ExperimentSpec.model_validate(data)
    except ValidationError as e:
        raise _spec_error(e) from None
    check_lora(spec)
    check_broadcast(spec)
    return spec


def spec_from_json(text: str | bytes) -> ExperimentSpec:
    """The wire form (a JSON object) to a validated spec; SpecError names the first bad field,
    also one too long (`check_sizes`). `trainer.weight_sync: auto` comes out chosen
    (`chosen_weight_sync`): the scheduler's submit chooses, and stores and sends the choice."""
    try:
        spec = ExperimentSpec.model_validate_json(text)
    except ValidationError as e:
        raise _spec_error(e) from None
    check_sizes(spec.model_dump())
    check_lora(spec)
    check_broadcast(spec)
    if spec.trainer.weight_sync == "auto":  # at submit; the choice then travels to the workers
        spec.trainer.weight_sync = chosen_weight_sync(spec, settings().weights_transport)
    return spec


def check_sizes(data: Any, path: str = "") -> None:
    """SpecError naming the first string longer than MAX_TEXT, key longer than MAX_NAME, or
    list or mapping of more than MAX_ITEMS entries in `data` (a spec as a dict)."""
    if isinstance(data, str) and len(data) > MAX_TEXT:
        raise SpecError(path, f"{len(data)} characters, at most {MAX_TEXT}")
    if not isinstance(data, (list, dict)):
        return
    if len(data) > MAX_ITEMS:
        raise SpecError(path, f"{len(data)} entries, at most {MAX_ITEMS}")
    for key, value in data.items() if isinstance(data, dict) else enumerate(data):
        if isinstance(key, str) and len(key) > MAX_NAME:
            raise SpecError(path, f"a key of {len(key)} characters, at most {MAX_NAME}")
        check_sizes(value, f"{path}.{key}" if path else str(key))


def largest_field(data: Any, path: str = "") -> str:
    """The field that makes `data` (a spec as a dict) large: from the top, into the part that
    holds at least half of its parent's JSON, as deep as that goes (a spec over the size limit
    with every field within its own is named by it)."""
    size = len(json.dumps(data))
    parts = data.items() if isinstance(data, dict) else enumerate(data)
    if isinstance(data, (list, dict)) and data:
        key, value = max(parts, key=lambda kv: len(json.dumps(kv[1])))
        if 2 * len(json.dumps(value)) >= size:
            return largest_field(value, f"{path}.{key}" if path else str(key))
    return path or "spec_json"


def spec_to_json(spec: ExperimentSpec) -> str:
    """The wire form: every field, defaults included, so a reader needs no defaults of its own."""
    return spec.model_dump_json()


def _spec_error(e: ValidationError) -> SpecError:
    """The first bad field with its reason; the others are named after it."""
    fields = [".".join(str(p) for p in err["loc"]) or "spec_json" for err in e.errors()]
    reason = e.errors()[0]["msg"]
    if len(fields) > 1:
        reason += f" (also invalid: {', '.join(fields[1:])})"
    return SpecError(fields[0], reason)


def json_schema() -> dict:
    """The JSON Schema of a spec, for clients in other languages."""
    return ExperimentSpec.model_json_schema()


if __name__ == "__main__":  # `make schema`
    json.dump(json_schema(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
