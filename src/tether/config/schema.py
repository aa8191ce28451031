"""The typed experiment config: one nested, validated object, every field with a default and help.

YAML files only supply values; the schema here is the single source of truth (the config reference
in the docs is generated from it). Components never receive this object whole: builders translate
the relevant section into plain arguments.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    path: str | None = Field(
        None, description="Hugging Face-format model directory (config.json + safetensors + tokenizer). "
        "When empty, a model is built from `model.scratch` with the built-in character tokenizer.")
    scratch: ScratchModelConfig = Field(default_factory=ScratchModelConfig,
                                        description="Shape of a model built from scratch.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype for training and generation.")


class DataSection(Section):
    train: str | None = Field(
        None, description="Training data: a JSONL or Parquet file, a `datasets` directory or name. "
        "Unused when `data.task` is set.")
    eval: str | None = Field(None, description="Held-out data in the same formats as `data.train`.")
    task: str | None = Field(
        "arith", description="Built-in synthetic task generated from `seed` (e.g. `arith`, `copy`); "
        "set to null to read `data.train`.")
    task_options: dict[str, int | float | str | bool] = Field(
        default_factory=dict, description="Keyword options of the built-in task (e.g. num_digits).")
    num_train: int = Field(2000, gt=0, description="Training examples drawn from a built-in task.")
    num_eval: int = Field(200, gt=0, description="Held-out examples drawn from a built-in task.")
    max_seq_len: int = Field(256, gt=0, description="Longest tokenised example (prompt + completion).")


class AlgorithmSection(Section):
    advantage: str = Field("grpo", description="Advantage estimator, by registry name.")
    policy_loss: str = Field("ppo_clip", description="Policy loss, by registry name.")
    loss_agg: str = Field("token_mean", description="How per-token losses become a scalar, by name.")
    clip_low: float = Field(0.2, ge=0, description="PPO clip range below 1 (ratio >= 1 - clip_low).")
    clip_high: float = Field(0.2, ge=0, description="PPO clip range above 1 (ratio <= 1 + clip_high).")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL-to-reference loss term; 0 disables.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator for the loss term.")
    epochs_per_batch: int = Field(1, ge=1, description="Optimizer passes over each rollout batch.")
    correction: str = Field("none", description="Off-policy correction (tis_token, tis_seq, mis_token, "
                            "mis_seq, geo_mask, none), by registry name.")
    correction_cap: float = Field(2.0, gt=0, description="Cap (truncation or mask threshold) of the "
                                  "importance weight used by the correction.")


class RolloutSection(Section):
    group_size: int = Field(8, ge=1, description="Samples per prompt (the GRPO group, G).")
    prompts_per_step: int = Field(16, ge=1, description="Prompts per RL step.")
    max_new_tokens: int = Field(32, ge=1, description="Longest completion.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 disables).")
    mode: Literal["sync", "async"] = Field("sync", description="Synchronous (on-policy) or "
                                           "asynchronous generation.")
    max_staleness: int = Field(0, ge=0, description="Most policy versions a consumed sample may lag "
                               "the trainer (S); 0 is on-policy.")


class TrainerSection(Section):
    max_steps: int = Field(100, ge=1, description="Optimizer steps (RL steps for GRPO).")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR schedule "
                                                              "after warm-up.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a fraction of `trainer.lr`.")
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient norm; 0 disables clipping.")
    batch_size: int = Field(32, ge=1, description="Sequences per optimizer step (SFT).")
    micro_batch_tokens: int = Field(4096, ge=1, description="Token budget of one forward/backward "
                                    "micro-batch; gradients accumulate across micro-batches.")
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (0: only at the end).")
    num_threads: int = Field(0, ge=0, description="torch CPU threads (0: leave torch's default).")


class LoggingSection(Section):
    run_root: str = Field("runs", description="Where run directories are created.")
    samples_per_step: int = Field(4, ge=0, description="Samples written to samples.jsonl per step.")
    progress: Literal["auto", "rich", "plain", "none"] = Field(
        "auto", description="Terminal progress: rich bar on a TTY, plain lines otherwise.")
    log_every: int = Field(1, ge=1, description="Plain log line every N steps.")


class RewardSpec(Section):
    fn: str = Field(description="A built-in reward name, `module:function`, or `path/file.py:function`.")
    weight: float = Field(1.0, description="Weight of this reward in the sum.")


class ExperimentConfig(Section):
    name: str = Field("tether", description="Run name; the run directory is <run_root>/<name>-<time>.")
    recipe: Literal["sft", "grpo"] = Field("grpo", description="What `tether train` runs.")
    seed: int = Field(0, description="Seed of every random number generator of the run.")
    init_from: str | None = Field(None, description="Start from this checkpoint directory instead of "
                                  "`model.path` (e.g. an SFT run's `final/`).")
    model: ModelSection = Field(default_factory=ModelSection, description="The policy model.")
    data: DataSection = Field(default_factory=DataSection, description="Training and held-out data.")
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection, description="RL math.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Generation.")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="Optimisation.")
    logging: LoggingSection = Field(default_factory=LoggingSection, description="Outputs.")
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(fn="task")],
        description="Reward functions summed with weights; `task` is the built-in task's own checker.")
