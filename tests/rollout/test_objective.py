"""The async objective: decoupled PPO with its proximal modes, through PolicyTrainer."""

from __future__ import annotations

import copy

import torch
from rollout_helpers import tiny_config

from tether.algorithms.registry import ADVANTAGES
from tether.recipes.grpo import build_generator_worker, build_trainer, resolved_policy_loss
from tether.rollout.async_loop import groups_to_batch, merge_scores
from tether.training.batch import RolloutBatch


def stale_batch(tiny_policy) -> RolloutBatch:
    model, tokenizer = tiny_policy
    worker = build_generator_worker(tiny_config("rollout.mode=async", reward="parity"), copy.deepcopy(model),
                                    tokenizer)
    groups = []
    while len(groups) < 3:
        groups.extend(worker.step())
    batch = groups_to_batch(groups, ADVANTAGES.get("grpo"), 4, merge_scores(groups))
    # Behaviour log-probs of an older policy: the engine's, perturbed.
    noise = torch.randn(batch.behaviour_logprobs.shape, generator=torch.Generator().manual_seed(0))
    batch.behaviour_logprobs = torch.where(batch.mask, batch.behaviour_logprobs + 0.3 * noise, 0.0)
    return batch


def params_after_step(tiny_policy, batch: RolloutBatch, *overrides: str) -> dict[str, torch.Tensor]:
    model, tokenizer = tiny_policy
    model = copy.deepcopy(model)
    trainer = build_trainer(tiny_config(*overrides), model)
    trainer.train_on(copy.deepcopy(batch), policy_version=2)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_policy_loss_auto_is_ppo_clip_in_sync_and_decoupled_in_async():
    assert resolved_policy_loss(tiny_config()) == "ppo_clip"
    assert resolved_policy_loss(tiny_config("rollout.mode=async")) == "decoupled_ppo"
    explicit = tiny_config("rollout.mode=async", "algorithm.policy_loss=ppo_clip")
    assert resolved_policy_loss(explicit) == "ppo_clip"


def test_loglinear_equals_recompute_with_one_epoch(tiny_policy):
    batch = stale_batch(tiny_policy)
    decoupled = "algorithm.policy_loss=decoupled_ppo"
    assert_same(params_after_step(tiny_policy, batch, decoupled, "algorithm.proximal=recompute"),
                params_after_step(tiny_policy, batch, decoupled, "algorithm.proximal=loglinear"))


def test_bypass_is_plain_ppo_over_behaviour_logprobs(tiny_policy):
    batch = stale_batch(tiny_policy)
    assert_same(params_after_step(tiny_policy, batch, "algorithm.policy_loss=decoupled_ppo",
                                  "algorithm.proximal=bypass"),
                params_after_step(tiny_policy, batch, "algorithm.policy_loss=ppo_clip",
                                  "algorithm.proximal=bypass"))


def test_decoupled_ppo_weights_stale_samples_by_the_behaviour_ratio(tiny_policy):
    batch = stale_batch(tiny_policy)
    decoupled = params_after_step(tiny_policy, batch, "algorithm.policy_loss=decoupled_ppo")
    plain = params_after_step(tiny_policy, batch, "algorithm.policy_loss=ppo_clip")
    assert not all(torch.equal(decoupled[n], plain[n]) for n in decoupled)
