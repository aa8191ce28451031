"""Builders: translate config sections into plain components (model, tokenizer, data, rewards).

Components never see ``ExperimentConfig``; these functions are the only place that reads it.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tether.config.schema import DataSection, EngineSection, ExperimentConfig, ModelSection, ScratchModelConfig
from tether.data.loading import load_prompts, load_sft
from tether.data.records import PromptRecord, SFTRecord
from tether.data.tasks import Task, get_task
from tether.engine.config import EngineConfig
from tether.engine.engine import LLMEngine
from tether.errors import CheckpointError, ConfigError, DataError
from tether.models.checkpoint import generation_eos_ids, load_model
from tether.models.config import ModelConfig
from tether.models.decoder import Decoder
from tether.models.tokenizer import build_char_tokenizer, check_tokenizer_fits, load_tokenizer
from tether.rewards import RewardComputer, WeightedReward, resolve_reward

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, where: str = "device") -> torch.device:
    """``auto`` (the first CUDA device where torch sees one, else the CPU), ``cpu``, ``cuda`` or
    ``cuda:N``; one-line error for anything else or a GPU that is not there."""
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{where} {name!r}: not a device (auto, cpu, cuda or cuda:N)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{where} {name!r}: torch sees no CUDA device here (use cpu or auto)")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{where} {name!r}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
        if device.index is None:
            device = torch.device("cuda", 0)
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """torch's CPU threads set to ``num_threads`` inside the block (0: left as they are), restored after."""
    before = torch.get_num_threads()
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def scratch_hf_config(spec: ScratchModelConfig, tokenizer: Any) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict for a model built from scratch (same path as a real one)."""
    return {
        "model_type": spec.family, "vocab_size": len(tokenizer), "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": spec.tie_word_embeddings, "hidden_act": "silu",
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def build_model_and_tokenizer(section: ModelSection, init_from: str | None, seed: int) -> tuple[Decoder, Any]:
    dtype = DTYPES[section.dtype]
    path = init_from or section.path
    if init_from is not None and not (Path(init_from) / "config.json").is_file() \
            and (Path(init_from) / "final" / "config.json").is_file():  # a run directory, not its checkpoint
        raise ConfigError(f"init_from={init_from!r} is a run directory; its checkpoint is {Path(init_from) / 'final'}")
    if path is not None:
        key = "init_from" if init_from is not None else "model.path"
        if not Path(path).exists():  # the key's name tells which of the two to fix
            raise CheckpointError(f"{key}: checkpoint directory {path} does not exist")
        model = load_model(path, dtype=dtype)
        tokenizer = load_tokenizer(path)
        check_tokenizer_fits(tokenizer, model.config.vocab_size, path)
        return model, tokenizer
    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    model = Decoder(ModelConfig.from_hf(scratch_hf_config(section.scratch, tokenizer), source="model.scratch"))
    init_weights(model, seed)
    return model.to(dtype), tokenizer


def init_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """GPT-2 style init for a model built from scratch: N(0, std) matrices, scaled residual outputs."""
    gen = torch.Generator().manual_seed(seed)
    num_layers = sum(1 for name, _ in model.named_parameters() if name.endswith("o_proj.weight"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                scale = std / (2 * max(num_layers, 1)) ** 0.5 if name.endswith(("o_proj.weight",
                                                                              "down_proj.weight")) else std
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
            elif name.endswith("bias"):
                param.zero_()


@dataclass(slots=True)
class PromptData:
    train: list[PromptRecord]
    eval: list[PromptRecord]
    task: Task | None


def build_task(section: DataSection) -> Task | None:
    if section.task is None:
        return None
    return get_task(section.task, **section.task_options)


def build_prompt_data(section: DataSection, seed: int) -> PromptData:
    task = build_task(section)
    if task is not None:
        return PromptData(task.prompts(section.num_train, seed, "train"),
                          task.prompts(section.num_eval, seed + 1, "test"), task)
    if section.train is None:
        raise ConfigError("data.train: required when data.task is null")
    evaluation = _load(load_prompts, section.eval, section.eval_split, "eval") if section.eval else []
    return PromptData(_load(load_prompts, section.train, section.train_split, "train"), evaluation, None)


def build_sft_data(section: DataSection, seed: int) -> tuple[list[SFTRecord], list[SFTRecord], Task | None]:
    task = build_task(section)
    if task is not None:
        return task.sft(section.num_train, seed, "train"), task.sft(section.num_eval, seed + 1, "test"), task
    if section.train is None:
        raise ConfigError("data.train: required when data.task is null")
    evaluation = _load(load_sft, section.eval, section.eval_split, "eval") if section.eval else []
    return _load(load_sft, section.train, section.train_split, "train"), evaluation, None


def _load(loader: Any, source: str, split: str, role: str) -> list[Any]:
    """``loader(source, split=split)``; a missing split names the setting that chose it."""
    try:
        return loader(source, split=split)
    except DataError as error:
        # load_from_disk's DatasetDict names it one way, load_dataset on a data directory another
        if f"no split '{split}'" in str(error) or f'Unknown split "{split}"' in str(error):
            raise DataError(f"{error} (data.{role}_split)") from None
        raise


def build_rewards(config: ExperimentConfig, task: Task | None) -> RewardComputer:
    builtins = {"task": task.reward} if task is not None else {}
    if task is None and any(spec.fn == "task" for spec in config.rewards):
        raise ConfigError("rewards: 'task' needs a built-in data.task; name a reward function instead")
    return RewardComputer([WeightedReward(spec.metric_name, resolve_reward(spec.fn, builtins), spec.weight)
                           for spec in config.rewards])


def eos_token_ids(tokenizer: Any, checkpoint: str | Path | None = None) -> tuple[int, ...]:
    """The engine's stop ids: the tokenizer's eos (none when it has no eos) and the ones the
    checkpoint's generation_config.json names (``generation_eos_ids``), as vLLM stops."""
    ids = [i for i in (tokenizer.eos_token_id,) if i is not None]
    return tuple(dict.fromkeys([*ids, *generation_eos_ids(checkpoint)]))


def build_generator(model: torch.nn.Module, tokenizer: Any, engine: EngineSection | None = None,
                    checkpoint: str | Path | None = None, *, owns_model: bool = False,
                    max_kv_tokens: int | None = None) -> LLMEngine:
    """The rollout engine for a policy (loaded from ``checkpoint``, if from one): its own copy of the
    weights, synced by ``update_weights`` (``owns_model``: ``model`` is that copy already);
    ``max_kv_tokens`` caps its KV pool at what the caller's workload can hold."""
    # Every ``engine.*`` config key is an ``EngineConfig`` field of the same name.
    config = EngineConfig(**(engine or EngineSection()).model_dump(),
                          stop_token_ids=eos_token_ids(tokenizer, checkpoint), max_kv_tokens=max_kv_tokens)
    own = model if owns_model else copy.deepcopy(model)
    return LLMEngine(own.eval().requires_grad_(False), tokenizer=tokenizer, config=config)
