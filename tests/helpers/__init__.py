"""Test helpers shared across the suite (tiny Hugging Face checkpoints)."""
