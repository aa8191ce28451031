"""Generator and trainer in separate processes (spawn): the few slow tests of the rollout package."""

from __future__ import annotations

import copy
import time

import pytest
import yaml
from rollout_helpers import REWARDS, TINY

from tether.metrics import read_metrics
from tether.recipes import run_train
from tether.recipes.grpo import run_grpo
from tether.rollout.generator_worker import GeneratorCounters
from tether.rollout.local_backend import GeneratorCrashedError, ProcessTransport
from tether.rollout.weights import SharedWeights


def write_config(tmp_path, rewards: list[str]) -> str:
    overrides = dict(item.split("=", 1) for item in TINY)
    config: dict = {"recipe": "grpo", "trainer": {"max_steps": 4},
                    "rewards": [{"fn": f"{REWARDS}:{r}"} for r in rewards]}
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        node = config.setdefault(section, {})
        for part in field.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[field.split(".")[-1]] = yaml.safe_load(value)
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow
def test_async_train_from_the_cli_path_stays_within_staleness_and_survives_a_raising_reward(tmp_path):
    path = write_config(tmp_path, ["count_digits", "flaky"])
    run_train(path, ["rollout.mode=async", "rollout.max_staleness=2"], out=str(tmp_path / "run"))
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert m["staleness/max"] <= 2
        for key in ("staleness/mean", "staleness/hist", "mismatch/k1", "mismatch/k3",
                    "mismatch/abs_logp_diff", "is/mean", "is/ess", "is/clip_frac", "is/masked_frac"):
            assert key in m, key
        assert sum(m["staleness/hist"].values()) == 12  # one lag per sample
    assert sum(m["reward/errors"] for m in metrics) > 0  # the flaky reward raised; the run went on
    assert (tmp_path / "run" / "final" / "config.json").exists()


@pytest.mark.slow
def test_weights_reach_the_generator_process_on_policy(tmp_path, tiny_policy):
    from rollout_helpers import tiny_config

    model, tokenizer = tiny_policy
    config = tiny_config("rollout.mode=async", "rollout.max_staleness=0", "trainer.max_steps=4",
                         "rollout.weight_bucket_mb=0.01", "rollout.generator_threads=1",
                         "trainer.num_threads=1",
                         reward="parity")
    result = run_grpo(config, tmp_path, copy.deepcopy(model), tokenizer)
    assert [m["staleness/max"] for m in result.history] == [0, 0, 0, 0]
    assert all(m["grad_norm"] > 0 for m in result.history)  # the weights changed every step
    # On-policy log-probs agree between trainer and engine only if every version arrived intact.
    assert all(m["mismatch/abs_logp_diff"] < 1e-4 for m in result.history), [
        m["mismatch/abs_logp_diff"] for m in result.history]


def _failing_worker():
    raise RuntimeError("engine could not be built")


@pytest.mark.slow
def test_a_generator_that_dies_is_reported_with_its_traceback(tiny_policy):
    model, _ = tiny_policy
    transport = ProcessTransport(_failing_worker, SharedWeights(model.named_parameters()), num_threads=1)
    try:
        with pytest.raises(GeneratorCrashedError, match="engine could not be built"):
            for _ in range(60):
                transport.poll(1.0)
    finally:
        transport.close()


class _FloodingWorker:
    """Finishes eight 1 MB "groups", then idles: far more than a pipe (64 KB) holds while nobody polls."""

    def __init__(self) -> None:
        self.counters = GeneratorCounters()
        self.num_left = 8

    @property
    def is_idle(self) -> bool:
        return self.num_left == 0

    def step(self) -> list[bytes]:
        if self.num_left == 0:
            return []
        self.num_left -= 1
        return [b"x" * (1 << 20)]


@pytest.mark.slow
def test_close_stops_a_generator_that_ran_ahead_without_killing_it(tiny_policy):
    """A generator that ran ahead leaves results nobody will read; its process must still exit on
    its own when stopped (it used to hang flushing them into a full pipe until ``close`` timed out
    after 10 s and terminated it, on every async run with S >= 2)."""
    model, _ = tiny_policy
    transport = ProcessTransport(_FloodingWorker, SharedWeights(model.named_parameters()), num_threads=1)
    assert transport.poll(30.0)  # running, and producing
    time.sleep(1.0)  # never polled again: the queue's pipe fills up
    transport.close(timeout_s=10.0)
    assert transport._process.exitcode == 0  # exited by itself, not terminated (-15)
