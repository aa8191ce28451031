"""Datasets for tether: typed records, loading and validation, synthetic tasks, tokenisation, packing.

Flow: ``load_*`` (or a built-in ``get_task(...)``) -> records -> ``tokenize_sft`` / ``tokenize_prompt``
-> ``pack_by_token_budget`` -> ``PackedBatch`` -> ``shift_targets`` in the trainer.
"""

from tether.data.batching import PackedBatch, TokenExample, pack, pack_by_token_budget, shift_targets
from tether.data.loading import load_preferences, load_prompts, load_sft, read_rows
from tether.data.records import PreferenceRecord, PromptRecord, SFTRecord
from tether.data.tasks import ArithTask, CopyTask, Task, get_task, task_names
from tether.data.tokenize import SFTExample, Tokenizer, tokenize_preference, tokenize_prompt, tokenize_sft

__all__ = [
    "ArithTask",
    "CopyTask",
    "PackedBatch",
    "PreferenceRecord",
    "PromptRecord",
    "SFTExample",
    "SFTRecord",
    "Task",
    "TokenExample",
    "Tokenizer",
    "get_task",
    "load_preferences",
    "load_prompts",
    "load_sft",
    "pack",
    "pack_by_token_budget",
    "read_rows",
    "shift_targets",
    "task_names",
    "tokenize_preference",
    "tokenize_prompt",
    "tokenize_sft",
]
