"""Reward functions the rollout tests name in config as ``path/reward_fns.py:function``."""


def count_digits(prompt: str, completion: str, **fields: object) -> float:
    """Varies across samples of a random model, so GRPO advantages are non-zero."""
    return float(sum(ch.isdigit() for ch in completion))


def flaky(prompt: str, completion: str, **fields: object) -> float:
    """Raises on about half of the completions (odd character-code sum): the run must go on."""
    if sum(map(ord, completion)) % 2:
        raise RuntimeError("flaky reward failed")
    return 1.0


def constant(prompt: str, completion: str, **fields: object) -> float:
    return 1.0


def parity(prompt: str, completion: str, **fields: object) -> float:
    """0 or 1, about half each: most groups have reward variance, some do not."""
    return float(sum(map(ord, completion)) % 2)


def broken(prompt: str, completion: str, **fields: object) -> float:
    """Raises on every call."""
    raise ValueError("broken reward")
