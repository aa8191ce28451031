"""The typed experiment config: one nested, validated object, every field with a default and help.

YAML files only supply values; the schema here is the single source of truth for defaults and help
(`tether train --help` lists every key with its default and help, generated from here; a config
reference in the docs is planned). Library components never receive this object whole: builders
and recipes translate the relevant section into plain arguments.
"""

from __future__ import annotations

import os
from pathlib import PurePath
from typing import Annotated, Any, Literal, get_args

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tether.algorithms import ADVANTAGES, AGGREGATIONS, CORRECTIONS, POLICY_LOSSES
from tether.config.unread import refuse_unread_settings
from tether.data.tasks import check_task_options
from tether.engine.types import MAX_TOP_K, MIN_TEMPERATURE
from tether.errors import ConfigError
from tether.rewards.loader import reward_file

MAX_GROUP_SIZE = 65536  # samples of one prompt: a bound that keeps the config's own checks small
MAX_THREADS = 1024  # torch refuses thread counts past its int, and crashes on some far below that


def _types_in(annotation: object) -> set[object]:
    """Every type an annotation names, unions and tuples unpacked: ``tuple[float, float] | None`` ->
    {tuple, float, NoneType}."""
    found: set[object] = {annotation}
    for arg in get_args(annotation):
        found |= _types_in(arg)
    return found


def _home_expanded(value: object) -> object:
    """``~/data.jsonl`` as the user's home: no shell expands a ``~`` in YAML or after ``key=``."""
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


# A path setting: ``~`` is the user's home (no shell expands one in YAML or after ``key=``).
HomePath = Annotated[str, BeforeValidator(_home_expanded)]


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: object, info: ValidationInfo) -> object:
        """``max_steps: true`` is a typo, not 1: pydantic's lax mode would take a bool as a number."""
        items = value if isinstance(value, list | tuple) else [value]
        if info.field_name is not None and any(isinstance(item, bool) for item in items):
            allowed = _types_in(cls.model_fields[info.field_name].annotation)
            if bool not in allowed and (int in allowed or float in allowed):
                raise ValueError("expected a number, not a boolean")
        return value


class ScratchModelConfig(Section):
    family: Literal["llama", "qwen2", "qwen3", "mistral"] = Field(
        "qwen2", description="Architecture family of a model built from scratch.")
    hidden_size: int = Field(128, gt=0, description="Hidden size of a model built from scratch.")
    intermediate_size: int = Field(384, gt=0, description="MLP inner size.")
    num_layers: int = Field(4, gt=0, description="Number of decoder layers.")
    num_heads: int = Field(4, gt=0, description="Attention (query) heads.")
    num_kv_heads: int = Field(2, gt=0, description="Key/value heads (grouped-query attention).")
    max_position_embeddings: int = Field(512, gt=0, description="Context length.")
    tie_word_embeddings: bool = Field(True, description="Share input embedding and LM head.")

    @model_validator(mode="after")
    def _heads_divide(self) -> ScratchModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        return self


class ModelSection(Section):
    path: HomePath | None = Field(
        None, description="Hugging Face-format model directory (config.json + safetensors + tokenizer). "
        "When empty, a model is built from `model.scratch` with the built-in character tokenizer.")
    scratch: ScratchModelConfig = Field(default_factory=ScratchModelConfig,
                                        description="Shape of a model built from scratch.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype for training and generation. bfloat16: the optimizer keeps "
        "fp32 master weights and steps on them (mixed precision); the model and the engine run in this "
        "dtype. float16 is refused for training (no loss scaling yet: small gradients would flush to 0); "
        "`tether generate --dtype float16` serves fp16.")

    @field_validator("dtype")
    @classmethod
    def _trainable_dtype(cls, dtype: str) -> str:
        if dtype == "float16":
            raise ValueError("float16 training needs loss scaling, which tether does not have yet (fp16 gradients "
                             "of a large vocabulary flush to 0); use bfloat16")
        return dtype


class DataSection(Section):
    @model_validator(mode="before")
    @classmethod
    def _train_file_replaces_the_default_task(cls, values: Any) -> Any:
        """``data.train`` given without ``data.task``: train on the file (the task default is off)."""
        if isinstance(values, dict) and values.get("train") is not None and "task" not in values:
            return {**values, "task": None}
        return values

    @model_validator(mode="after")
    def _not_both_task_and_train(self) -> DataSection:
        if self.task is not None and self.train is not None:
            raise ValueError(f"data.task={self.task!r} and data.train={self.train!r} are both set; "
                             "set data.task: null to train on data.train")
        if self.task is not None:  # before a model is built: an unknown task or option
            try:
                check_task_options(self.task, self.task_options)
            except ConfigError as error:
                raise ValueError(str(error)) from None
        return self

    train: HomePath | None = Field(
        None, description="Training data: a JSONL or Parquet file, a `datasets` directory, or a dataset name "
        "(`org/name`) in the local `datasets` cache. "
        "Setting it turns the default `data.task` off. Rows: `prompt` (grpo); `prompt` + `completion`, "
        "`messages` or `text` (sft: the loss is on the completion, a `messages` row's last assistant "
        "message (earlier turns are context), a chat `completion` whole (as TRL), or all of a `text`).")
    eval: HomePath | None = Field(None, description="Held-out data in the same formats as `data.train`.")
    train_split: str = Field("train", description="Split of `data.train` when it is a `datasets` "
                             "dataset with splits.")
    eval_split: str = Field("test", description="Split of `data.eval` when it is a `datasets` dataset "
                            "with splits (point both at one DatasetDict: train on one split, evaluate on another).")
    task: str | None = Field(
        "arith", description="Built-in synthetic task generated from `seed` (e.g. `arith`, `copy`); "
        "null (the default once `data.train` is set) reads `data.train`.")
    task_options: dict[str, int | float | str | bool] = Field(
        default_factory=dict, description="Keyword options of the built-in task (e.g. num_digits).")
    num_train: int = Field(2000, gt=0, description="Training examples drawn from a built-in task.")
    num_eval: int = Field(200, gt=0, description="Held-out examples drawn from a built-in task.")
    max_seq_len: int = Field(256, ge=2, description="Longest tokenised example (prompt + completion; longer "
                             "completions are cut, with one warning counting them); the sft recipe (grpo: "
                             "rollout.max_new_tokens and engine.max_model_len).")


class AlgorithmSection(Section):
    advantage: str = Field("grpo", description="Advantage estimator, by registry name.")
    policy_loss: str = Field("auto", description="Policy loss, by registry name; `auto`: ppo_clip when "
                             "`rollout.mode=sync`, decoupled_ppo when async.")
    proximal: Literal["recompute", "loglinear", "bypass"] = Field(
        "recompute", description="Proximal log-probs of decoupled PPO: `recompute` (trainer weights before "
        "the update; free with one epoch unless a masking correction, `mis_*` or `geo_mask`, is on), "
        "`loglinear` (interpolated by version, no forward but one per epoch for a masking correction), "
        "`bypass` (the engine's behaviour log-probs: plain PPO over them).")
    loss_agg: str = Field("token_mean", description="How per-token losses become a scalar, by name.")
    clip_low: float = Field(0.2, ge=0, description="PPO clip range below 1 (ratio >= 1 - clip_low).")
    clip_high: float = Field(0.2, ge=0, description="PPO clip range above 1 (ratio <= 1 + clip_high).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL-to-reference loss term; 0 disables. "
                           "The KL compares the policy and reference at the sampling temperature, without "
                           "top-k/top-p.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator for the loss term: `k3` "
                                                    "(GRPO's) or `k2`; `k1` is refused as a loss term (its "
                                                    "expected gradient is 0).")
    epochs_per_batch: int = Field(1, ge=1, description="Optimizer passes over each rollout batch.")
    correction: str = Field("none", description="Off-policy correction (tis_token, tis_seq, mis_token, "
                            "mis_seq, geo_mask, none), by registry name.")
    correction_cap: float = Field(2.0, gt=0, description="Cap (truncation or mask threshold) of the "
                                  "importance weight used by the correction.")

    @field_validator("advantage", "policy_loss", "loss_agg", "correction")
    @classmethod
    def _registered(cls, name: str, info) -> str:
        if info.field_name == "policy_loss" and name == "auto":
            return name
        registry = {"advantage": ADVANTAGES, "policy_loss": POLICY_LOSSES, "loss_agg": AGGREGATIONS,
                    "correction": CORRECTIONS}[info.field_name]
        if name not in registry:
            names = [*(["auto"] if info.field_name == "policy_loss" else []), *registry.names()]
            raise ValueError(f"must be one of {', '.join(names)}")
        return name

    @model_validator(mode="after")
    def _correction_applies(self) -> AlgorithmSection:
        """Combinations under which the correction would do nothing, or fail at the first step."""
        if self.proximal == "bypass" and self.correction != "none":
            raise ValueError(f"algorithm.correction={self.correction} does nothing with algorithm.proximal=bypass: "
                             "the proximal log-probs are the engine's, so its ratio to them is 1; use proximal "
                             "recompute or loglinear, or correction none")
        if self.correction == "geo_mask" and self.correction_cap < 1:
            raise ValueError(f"algorithm.correction_cap={self.correction_cap}: geo_mask keeps sequences whose "
                             "geometric-mean ratio lies in [1/cap, cap], so the cap must be >= 1 (typical: 1.01-1.05)")
        if self.kl_coef > 0 and self.kl_estimator == "k1":  # verl's kl_loss_type=kl pitfall
            raise ValueError("algorithm.kl_estimator=k1 as a loss term pulls toward nothing: its gradient, "
                             "grad log pi, is 0 in expectation over samples of pi (it adds noise while kl/ref "
                             "looks sensible); use k2 (gradient of KL(pi||ref)) or k3 (GRPO's; gradient of "
                             "KL(ref||pi))")
        return self


class RolloutSection(Section):
    group_size: int = Field(8, ge=1, le=MAX_GROUP_SIZE, description="Samples per prompt (the GRPO group, G).")
    prompts_per_step: int = Field(16, ge=1, description="Prompts per RL step.")
    max_new_tokens: int = Field(32, ge=1, description="Longest completion.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy; else at least 1e-5).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="Top-k sampling (0 disables).")
    mode: Literal["sync", "async"] = Field("sync", description="Synchronous (on-policy) or "
                                           "asynchronous generation.")
    max_staleness: int = Field(0, ge=0, description="Async mode: most policy versions a consumed sample may lag "
                               "the trainer (S); 0 is on-policy. Lag = trainer version at the step that "
                               "consumes a sample - version of its oldest token.")
    partial_rollouts: bool | None = Field(
        None, description="Weight updates reach sequences in flight, which continue under the new weights "
        "(each token stamped with its version). Off: updates wait until the groups in flight finish. "
        "Empty: on when the staleness bound in force (0 in sync mode) or oversample is above 0.")
    oversample: int = Field(0, ge=0, description="Extra groups started beyond what a batch needs: a batch "
                            "closes on the fastest groups (early cut); the rest run on into the next batch "
                            "(async) or are dropped (finished) or aborted (running) and their prompts re-issued "
                            "first (sync).")
    dynamic_sampling: bool = Field(False, description="Drop groups whose rewards are all equal (no GRPO "
                                   "signal) and generate replacements (DAPO's dynamic sampling).")
    generator_threads: int = Field(0, ge=0, le=MAX_THREADS, description="torch CPU threads of the generator process in "
                                   "async mode (0: half of the cores).")
    generate_during_boot: bool = Field(True, description="Async mode: while the generator process starts "
                                       "(importing torch, building its engine: seconds), the trainer's "
                                       "process generates, then hands the prompt stream and the current "
                                       "weights over.")
    weight_bucket_mb: float = Field(32.0, gt=0, description="Size of one shared-memory bucket when "
                                    "shipping weights to the generator process (async mode).")

    @field_validator("temperature")
    @classmethod
    def _temperature_not_tiny(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:  # logits / temperature would overflow fp32
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        return value


class EngineSection(Section):
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    max_num_seqs: int = Field(256, ge=1, description="Sequences (samples) decoding at once.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Per-step token budget (prefill "
                                        "chunks + decodes).")
    kv_cache_bytes: int | None = Field(None, ge=1, description="KV memory in bytes (the paged pool, "
                                       "its contiguous decode copies and a draft model's KV); empty: "
                                       "`kv_cache_memory_fraction` of free memory. The grpo recipe caps "
                                       "the pool at what its rollouts can hold at once.")
    kv_cache_memory_fraction: float = Field(0.3, gt=0, le=1, description="Share of free memory for the "
                                            "KV memory (as `kv_cache_bytes`) when `kv_cache_bytes` is "
                                            "empty: a GPU's free memory; on the host MemAvailable, within "
                                            "what the process's cgroup (a container, a Slurm job) allows. "
                                            "Not vLLM's gpu_memory_utilization (a share of the whole GPU): "
                                            "a share of what is free once the model is loaded, and a step's "
                                            "activations and sampling work come on top, so leave room.")
    max_model_len: int | None = Field(None, ge=2, description="Prompt + completion cap; empty: the "
                                      "model's context length.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prefixes (hash chain).")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")
    recompute_kv_on_update: bool = Field(False, description="On a weight update, recompute the KV of "
                                         "sequences in flight instead of keeping it.")
    cpu_pack_lm_head: bool = Field(True, description="CPU: compute logits through a "
                                   "oneDNN-reordered copy of the vocabulary projection: fp32 when it is "
                                   "at least 8 MB, bf16 where oneDNN has native bf16 (faster; costs its "
                                   "size in memory once more).")
    cpu_pack_linears: Literal["auto", "always", "never"] = Field(
        "auto", description="CPU: the decoder layers' linears through oneDNN-reordered weight "
        "copies: `auto` for every bf16 one where oneDNN has native bf16, and fp32 ones 256 or more wide "
        "on CPUs where MKL runs its generic kernels (non-Intel x86), `always`, or `never` (costs the "
        "layers' size in memory once more when on).")
    cpu_native_attention: bool = Field(True, description="CPU, fp32: attention, the MLPs' silu(gate) * up "
                                       "and the sampler's weights through C++ kernels compiled for this "
                                       "machine on first use (~40 s once, cached; needs a C++ compiler and "
                                       "ninja, else PyTorch ops serve, with a warning).")
    batch_invariant: bool | Literal["auto"] = Field(
        "auto", description="A token's logits are the same bits however the engine schedules it (alone "
        "or in any batch, in any prefill chunk, from the prefix cache, in a speculative span), so a seeded "
        "request samples the same tokens and log-probs in any batch: `auto` where the path for it is "
        "available (fp32 on the CPU with the compiled kernel: every linear through oneDNN, prefill "
        "queries through the kernel: as fast on the engine benchmark and on prompts of 500-3000 tokens; "
        "tiny models pay oneDNN's ~25 us a call, ~0.6x at batch 1), `true` (an error where it is not), "
        "`false`.")

    @field_validator("batch_invariant", mode="before")
    @classmethod
    def _true_false_or_auto(cls, value: object) -> object:
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError("must be true, false or auto")


class TrainerSection(Section):
    max_steps: int = Field(100, ge=1, description="Optimizer steps (RL steps for GRPO).")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR schedule "
                                                              "after warm-up.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a fraction of `trainer.lr`.")
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient norm; 0 disables clipping.")
    batch_size: int = Field(32, ge=1, description="Sequences per optimizer step (SFT).")
    micro_batch_tokens: int = Field(4096, ge=1, description="Token budget of one forward/backward "
                                    "micro-batch; gradients accumulate across micro-batches.")
    share_prompts: bool = Field(True, description="RL: rows with the same prompt (a GRPO group) share "
                                "one forward over it in the trainer; exact, and n times less prompt "
                                "compute for groups of n.")
    eval_every: int = Field(0, ge=0, description="Evaluate the held-out loss every N steps (0: only at the end); "
                            "the sft recipe, with held-out data (a task's, or data.eval).")
    num_threads: int = Field(0, ge=0, le=MAX_THREADS, description="torch CPU threads (0: leave torch's "
                             "default; in async mode half of the cores, as rollout.generator_threads for the "
                             "generator process).")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas


class LoggingSection(Section):
    run_root: HomePath = Field("runs", description="Where run directories are created.")
    samples_per_step: int = Field(4, ge=0, description="Samples written to samples.jsonl per step.")
    progress: Literal["auto", "rich", "plain", "none"] = Field(
        "auto", description="Terminal progress: rich bar on a TTY, plain lines otherwise.")
    log_every: int = Field(1, ge=1, description="Plain log line every N steps.")


class RewardSpec(Section):
    fn: str = Field(description="A built-in reward name, `module:function`, or `path/file.py:function`; "
                    "called once per sample as f(prompt, completion, **fields) (take `**fields`: every "
                    "field of the data is passed); one that cannot be called so is refused before the run.")
    weight: float = Field(1.0, description="Weight of this reward in the sum.")
    name: str | None = Field(None, description="Its name in metrics (`reward/<name>/mean`) and error reports. "
                             "Default: `fn`; for a file, its stem and the function (`path/checks.py:fmt` -> "
                             "`checks:fmt`).")

    @field_validator("name")
    @classmethod
    def _name_has_no_slash(cls, name: str | None) -> str | None:
        if name is not None and (not name or "/" in name):
            raise ValueError("must be non-empty, without '/' (it separates a reward's sub-scores in metric names)")
        return name

    @property
    def metric_name(self) -> str:
        """``name``, else ``fn`` (a file's path shortened to its stem: its '/' would read as sub-scores)."""
        if self.name is not None:
            return self.name
        file = reward_file(self.fn)
        return f"{PurePath(file[0]).stem}:{file[1]}" if file else self.fn


class ExperimentConfig(Section):
    name: str = Field("tether", description="Run name; the run directory is <run_root>/<name>-<time>.")
    recipe: Literal["sft", "grpo"] = Field("grpo", description="What `tether train` runs.")
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of every random number generator of the run.")
    init_from: HomePath | None = Field(None, description="Start from this checkpoint directory instead of "
                                  "`model.path` (e.g. an SFT run's `final/`).")
    model: ModelSection = Field(default_factory=ModelSection, description="The policy model.")
    data: DataSection = Field(default_factory=DataSection, description="Training and held-out data.")
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection, description="RL math.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Generation.")
    engine: EngineSection = Field(default_factory=EngineSection, description="The rollout engine.")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="Optimisation.")
    logging: LoggingSection = Field(default_factory=LoggingSection, description="Outputs.")
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(fn="task")], min_length=1,
        description="Reward functions summed with weights; `task` is the built-in task's own checker.")

    @field_validator("rewards")
    @classmethod
    def _each_reward_once(cls, rewards: list[RewardSpec]) -> list[RewardSpec]:
        """A reward's name keys its metrics and error counts: listed twice, the two would share them."""
        names = [spec.metric_name for spec in rewards]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice is not None:
            fns = {spec.fn for spec in rewards if spec.metric_name == twice}
            if len(fns) > 1:  # two files of one stem, or a name given twice
                raise ValueError(f"two rewards ({', '.join(sorted(fns))}) are both named {twice!r} in metrics; "
                                 "give each a `name`")
            raise ValueError(f"{twice!r} is listed twice; list it once, with the weights summed (or give "
                             "each a `name`)")
        return rewards

    @field_validator("name")
    @classmethod
    def _name_is_one_path_part(cls, name: str) -> str:
        """The run directory is <run_root>/<name>-<time>: a name with a separator would put it elsewhere."""
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise ValueError("must be a plain name (no '/' or '\\'): it names the run directory inside "
                             "logging.run_root")
        return name

    @model_validator(mode="after")
    def _group_size_fits_the_advantage(self) -> ExperimentConfig:
        """Settings under which every advantage is 0 (nothing would be learned) are refused. Asked of
        the estimator itself, so a new registry entry brings its own rule: it may refuse the group
        size (GRPO's std and RLOO's leave-one-out need G >= 2), and on two groups of distinct rewards
        it must give some advantage that is not 0 (a group baseline over G = 1 gives none)."""
        if self.recipe != "grpo":
            return self
        size, name = self.rollout.group_size, self.algorithm.advantage
        estimator = ADVANTAGES.get(name)
        lengths = torch.ones(2 * size, dtype=torch.long)

        def advantages(rewards: torch.Tensor) -> torch.Tensor:
            try:
                return estimator(rewards, size, lengths=lengths)
            except ConfigError as error:
                raise ValueError(f"rollout.group_size={size} does not suit algorithm.advantage={name!r}: "
                                 f"{error}") from None
            except TypeError as error:  # a registered estimator of another signature: now, not at step 1
                raise ValueError(f"algorithm.advantage={name!r} must take (rewards, group_size, *, lengths): "
                                 f"{error}") from None

        if not advantages(torch.arange(2.0 * size)).any():
            raise ValueError(f"rollout.group_size={size} does not suit algorithm.advantage={name!r}: every "
                             "advantage would be 0 (a group baseline needs G >= 2)")
        # Greedy samples of a group are alike: rewards equal within each group, different across.
        alike = torch.arange(2.0).repeat_interleave(size)
        if size > 1 and self.rollout.temperature == 0 and not advantages(alike).any():
            raise ValueError(f"rollout.temperature=0 samples the {size} completions of a group alike (greedy): "
                             f"their rewards are equal, and {name}'s advantages 0; sample with a temperature > 0")
        return self

    @model_validator(mode="after")
    def _staleness_is_read(self) -> ExperimentConfig:
        if self.recipe == "grpo" and self.rollout.mode == "sync" and self.rollout.max_staleness > 0:
            raise ValueError(f"rollout.max_staleness={self.rollout.max_staleness} is read in async mode only "
                             "(rollout.mode=async); sync mode trains on-policy")
        return self

    @model_validator(mode="after")
    def _settings_not_read_are_refused(self) -> ExperimentConfig:
        """Settings that would be silently ignored are refused, naming the one that is read instead."""
        refuse_unread_settings(self)
        return self
