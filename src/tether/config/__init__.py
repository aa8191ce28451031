"""Typed experiment configuration: schema, YAML loading, command-line overrides."""

from tether.config.loader import load_config, parse_override, save_resolved
from tether.config.schema import ExperimentConfig

__all__ = ["ExperimentConfig", "load_config", "parse_override", "save_resolved"]
