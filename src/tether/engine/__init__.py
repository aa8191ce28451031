"""The rollout engine: paged KV cache, prefix caching, continuous batching, per-token log-probs."""

from tether.engine.config import EngineConfig
from tether.engine.engine import LLMEngine
from tether.engine.types import Completion, EngineStats, FinishReason, Generator, IncrementalGenerator, SamplingParams

__all__ = [
    "Completion",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "Generator",
    "IncrementalGenerator",
    "LLMEngine",
    "SamplingParams",
]
