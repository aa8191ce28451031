"""Settings a run would never read, refused in one line each, naming what is read instead
(``ExperimentConfig`` calls ``refuse_unread_settings`` after its fields are validated)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def changed(config: BaseModel, dotted: str) -> str | None:
    """``dotted=value`` where the setting ``dotted`` of ``config`` (``data.max_seq_len``, or a whole
    section such as ``rollout``: its first field that differs) is not its default; else None."""
    *parents, key = dotted.split(".")
    section = config
    for part in parents:
        section = getattr(section, part)
    value, default = getattr(section, key), type(section).model_fields[key].get_default(call_default_factory=True)
    if value == default:
        return None
    if isinstance(value, BaseModel):
        return next(changed(config, f"{dotted}.{field}") for field in type(value).model_fields
                    if getattr(value, field) != getattr(default, field))
    if isinstance(value, list):
        value = [item.model_dump() if isinstance(item, BaseModel) else item for item in value]
    return f"{dotted}={value!r}"


def refuse_unread_settings(c: Any) -> None:
    """Raises ValueError for the first setting of ``c`` (an ``ExperimentConfig``) its recipe ignores."""
    if c.data.task is not None and c.data.eval is not None:
        raise ValueError(f"data.eval={c.data.eval!r} is not read when data.task={c.data.task!r} is set "
                         "(the task draws its own held-out set: data.num_eval); set one of them")
    if c.recipe == "grpo" and c.trainer.eval_every > 0:
        raise ValueError(f"trainer.eval_every={c.trainer.eval_every}: the grpo recipe does not evaluate "
                         "during training (the sft recipe does); leave it 0")
    if c.recipe == "sft" and c.trainer.eval_every > 0 and c.data.task is None and c.data.eval is None:
        raise ValueError(f"trainer.eval_every={c.trainer.eval_every}: there is no held-out data to evaluate "
                         "on; set data.eval")
    if c.recipe == "grpo" and c.data.eval is not None:
        raise ValueError(f"data.eval={c.data.eval!r}: the grpo recipe does not evaluate during training "
                         "(the sft recipe does); leave it empty")
    if c.recipe == "grpo" and (setting := changed(c, "data.max_seq_len")):
        raise ValueError(f"{setting} is not read by the grpo recipe: its sequences are capped by "
                         "rollout.max_new_tokens and engine.max_model_len")
    for key in ("num_train", "num_eval", "task_options") if c.data.task is None else ():
        if setting := changed(c, f"data.{key}"):
            raise ValueError(f"{setting} is read by built-in tasks only, not with data.train={c.data.train!r}: "
                             "leave it out (a file is read whole)")
    if c.recipe == "grpo" and (setting := changed(c, "trainer.batch_size")):
        raise ValueError(f"{setting} is not read by the grpo recipe: a step trains on rollout.prompts_per_step "
                         "x rollout.group_size samples")
    for key in ("rollout", "algorithm", "rewards") if c.recipe == "sft" else ():  # a GRPO config made SFT
        if setting := changed(c, key):
            raise ValueError(f"{setting} is not read by the sft recipe (it trains on the data's completions): "
                             "leave it out")
    source = f"init_from={c.init_from!r}" if c.init_from is not None else f"model.path={c.model.path!r}"
    if (c.init_from is not None or c.model.path is not None) and (setting := changed(c, "model.scratch")):
        raise ValueError(f"{setting} is not read with {source}: the model's shape is the checkpoint's "
                         "(model.scratch shapes a model built from scratch); leave it out, or reset it with "
                         "'model.scratch={}'")
    if c.trainer.schedule == "constant" and c.trainer.min_lr_ratio > 0:
        raise ValueError(f"trainer.min_lr_ratio={c.trainer.min_lr_ratio} is not read by trainer.schedule=constant: "
                         "set trainer.schedule=cosine or linear to decay to it")
