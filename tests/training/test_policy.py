"""The policy trainer: its log-probs equal the engine's, micro-batching is exact, learning happens."""

import copy

import pytest
import torch

from helpers.hf_tiny import make_hf_checkpoint
from tether.algorithms import AGGREGATIONS
from tether.engine.config import EngineConfig
from tether.engine.engine import LLMEngine
from tether.engine.types import SamplingParams
from tether.models.checkpoint import load_model
from tether.rollout.sync_loop import build_rollout_batch
from tether.training.optim import build_optimizer, build_scheduler
from tether.training.policy import (
    PROXIMAL_MODES,
    PolicyLossSettings,
    PolicyTrainer,
    ProximalMode,
    aggregation_weights,
)
from tether.training.scoring import SamplingView, completion_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen2", hidden_size=32, num_layers=2)


def _sample(model, params, prompts):
    engine = LLMEngine(copy.deepcopy(model), config=EngineConfig(num_kv_blocks=64, seed=3))
    return engine.generate(prompts, params)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 0.9)])
def test_trainer_logprobs_equal_engine_logprobs(model_dir, top_k, top_p):
    """The quantity the engine reports is the one the trainer recomputes (fp32, within 1e-5)."""
    model = load_model(model_dir)
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, max_new_tokens=12, n=3, seed=1)
    prompts = [[1, 5, 9, 13], [1, 40, 41], [1, 7, 7, 7, 7, 7]]
    completions = _sample(model, params, prompts)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, [prompts[c.prompt_index] for c in completions],
                                      [c.token_ids for c in completions], SamplingView(0.8, top_k, top_p))
    for row, c in enumerate(completions):
        expected = torch.tensor(c.logprobs)
        assert torch.allclose(logp[row, : c.num_tokens], expected, atol=1e-5), row


def _batch(model, group_size=4):
    prompts = [[1, 5, 9, 13, 17], [1, 40, 41]]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=group_size, seed=7)
    completions = _sample(model, params, prompts)
    rewards = torch.arange(len(completions), dtype=torch.float32) % 3
    advantages = rewards - rewards.mean()
    return build_rollout_batch(prompts, completions, rewards, advantages, group_size)


def _grads_after_step(model, batch, micro_batch_tokens, loss_agg, share_prompts=True):
    model = copy.deepcopy(model)
    optimizer = build_optimizer(model.parameters(), lr=1e-3)
    scheduler = build_scheduler(optimizer, warmup_steps=0, max_steps=10, schedule="constant")
    settings = PolicyLossSettings(micro_batch_tokens=micro_batch_tokens, loss_agg=loss_agg, grad_clip=0.0,
                                  share_prompts=share_prompts)
    trainer = PolicyTrainer(model, optimizer, scheduler, settings, SamplingView(1.0))
    metrics = trainer.train_on(batch)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, metrics


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(model_dir, loss_agg):
    model = load_model(model_dir)
    batch = _batch(model)
    full, full_metrics = _grads_after_step(model, batch, micro_batch_tokens=10_000, loss_agg=loss_agg)
    split, split_metrics = _grads_after_step(model, batch, micro_batch_tokens=20, loss_agg=loss_agg)
    for name in full:
        assert torch.allclose(full[name], split[name], atol=1e-6), name
    assert full_metrics["loss/policy"] == pytest.approx(split_metrics["loss/policy"], abs=1e-6)


@pytest.mark.parametrize("micro_batch_tokens", [10_000, 20])
def test_sharing_prompts_leaves_the_update_unchanged(model_dir, micro_batch_tokens):
    """A group's prompt scored once (the default) gives the gradient of scoring it per sample."""
    model = load_model(model_dir)
    batch = _batch(model)
    shared, shared_metrics = _grads_after_step(model, batch, micro_batch_tokens, "token_mean")
    separate, separate_metrics = _grads_after_step(model, batch, micro_batch_tokens, "token_mean",
                                                   share_prompts=False)
    for name in shared:
        torch.testing.assert_close(shared[name], separate[name], atol=1e-6, rtol=1e-5, msg=name)
    assert shared_metrics["mismatch/k3"] == pytest.approx(separate_metrics["mismatch/k3"], abs=1e-7)


def test_a_micro_batch_of_empty_completions_adds_no_gradient(model_dir):
    """Rows without completion tokens split off into a micro-batch of their own: it has no graph to
    backpropagate, and the update equals the one of the whole batch in one pass."""
    model = load_model(model_dir)
    batch = _batch(model)
    empty = torch.arange(batch.num_seqs) >= 4  # the second group's samples
    batch.mask = batch.mask & ~empty[:, None]
    full, _ = _grads_after_step(model, batch, micro_batch_tokens=10_000, loss_agg="token_mean")
    split, _ = _grads_after_step(model, batch, micro_batch_tokens=3, loss_agg="token_mean")
    for name in full:
        torch.testing.assert_close(full[name], split[name], atol=1e-6, rtol=1e-5, msg=name)


def test_aggregation_weights_reproduce_the_aggregation():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    losses = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    for name in AGGREGATIONS.names():
        fn = AGGREGATIONS.get(name)
        weights = aggregation_weights(fn, mask)
        assert torch.allclose((weights * losses).sum(), fn(losses, mask)), name


def test_positive_advantage_raises_its_samples_logprob(model_dir):
    """One step on a batch moves the policy toward high-advantage samples."""
    model = load_model(model_dir)
    batch = _batch(model)
    before, _ = completion_logprobs(model, batch.prompt_ids, [
        batch.completion_ids[r, : int(batch.mask[r].sum())].tolist() for r in range(batch.num_seqs)],
        SamplingView(1.0))
    optimizer = build_optimizer(model.parameters(), lr=1e-2)
    scheduler = build_scheduler(optimizer, warmup_steps=0, max_steps=10, schedule="constant")
    PolicyTrainer(model, optimizer, scheduler, PolicyLossSettings(), SamplingView(1.0)).train_on(batch)
    after, _ = completion_logprobs(model, batch.prompt_ids, [
        batch.completion_ids[r, : int(batch.mask[r].sum())].tolist() for r in range(batch.num_seqs)],
        SamplingView(1.0))
    delta = ((after - before) * batch.mask).sum(dim=1).detach()
    best, worst = batch.advantages.argmax(), batch.advantages.argmin()
    assert delta[best] > 0 > delta[worst]


def _decoupled_grads(model, batch, correction: str, cap: float = 2.0):
    model = copy.deepcopy(model)
    optimizer = build_optimizer(model.parameters(), lr=1e-3)
    scheduler = build_scheduler(optimizer, warmup_steps=0, max_steps=10, schedule="constant")
    settings = PolicyLossSettings(policy_loss="decoupled_ppo", correction=correction, correction_cap=cap,
                                  grad_clip=0.0)
    PolicyTrainer(model, optimizer, scheduler, settings, SamplingView(1.0)).train_on(batch)
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("correction,expected_weight", [
    ("none", 1.35),  # the loss keeps decoupled PPO's raw behaviour weight pi_prox / pi_behav
    ("geo_mask", 1.35),  # a mask only (every sequence inside the band here): the same raw weight
    ("tis_token", 1.2),  # truncated at the cap
])
def test_decoupled_ppo_behaviour_weight_under_each_correction(model_dir, correction, expected_weight):
    """Behaviour log-probs lowered by log(1.35) on every token scale decoupled PPO's gradient by the
    weight the correction leaves it (at the first epoch pi / pi_prox = 1, so nothing is clipped)."""
    model = load_model(model_dir)
    batch = _batch(model)
    reference = _decoupled_grads(model, batch, "none")  # engine and trainer agree: weight ~1
    batch.behaviour_logprobs = batch.behaviour_logprobs - torch.where(batch.mask, torch.tensor(1.35).log(), 0.0)
    grads = _decoupled_grads(model, batch, correction, cap=1.2 if correction == "tis_token" else 2.0)
    torch.testing.assert_close(grads, expected_weight * reference, rtol=1e-3, atol=1e-6)


def _train(model, batch, sampling=None, policy_version=0, **settings):
    model = copy.deepcopy(model)
    optimizer = build_optimizer(model.parameters(), lr=1e-3)
    scheduler = build_scheduler(optimizer, warmup_steps=0, max_steps=10, schedule="constant")
    trainer = PolicyTrainer(model, optimizer, scheduler, PolicyLossSettings(grad_clip=0.0, **settings),
                            sampling or SamplingView(1.0))
    metrics = trainer.train_on(batch, policy_version=policy_version)
    return torch.cat([p.grad.flatten() for p in model.parameters()]), metrics


def _noisy_behaviour(model, seed=0):
    """A batch whose engine log-probs are off by N(0, 1) per token: masked IS drops some tokens."""
    batch = _batch(model)
    noise = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(seed))
    batch.behaviour_logprobs = torch.where(batch.mask, batch.behaviour_logprobs + noise, 0.0)
    return batch


@pytest.mark.parametrize("micro_batch_tokens", [10_000, 12])
def test_masked_is_averages_the_loss_over_the_kept_tokens_of_the_whole_batch(model_dir, micro_batch_tokens):
    """corrections.py: aggregate over ``keep_mask``. Token-mean PPO with masked IS is the mean over
    kept tokens of -w * ratio * A, by hand, and micro-batches add up to it."""
    model = load_model(model_dir)
    batch = _noisy_behaviour(model)
    grads, metrics = _train(model, batch, correction="mis_token", correction_cap=2.0,
                            micro_batch_tokens=micro_batch_tokens)
    reference = copy.deepcopy(model)
    lens = batch.mask.sum(1).tolist()
    logp, _ = completion_logprobs(reference, batch.prompt_ids,
                                  [ids[:n] for ids, n in zip(batch.completion_ids.tolist(), lens)],
                                  SamplingView(1.0), num_cols=batch.mask.shape[1])
    log_ratio = torch.where(batch.mask, logp.detach() - batch.behaviour_logprobs, 0.0)
    keep = batch.mask & (log_ratio <= torch.tensor(2.0).log())
    assert 0 < keep.sum() < batch.mask.sum()  # the case at hand: some tokens dropped, some kept
    advantages = batch.advantages[:, None].expand_as(logp)
    per_token = -log_ratio.exp() * torch.exp(logp - logp.detach()) * advantages
    (torch.where(keep, per_token, 0.0).sum() / keep.sum()).backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
    torch.testing.assert_close(grads, expected, rtol=1e-4, atol=1e-7)
    assert metrics["is/masked_frac"] == pytest.approx(1 - float(keep.sum() / batch.mask.sum()), abs=1e-6)


@pytest.mark.parametrize("correction", ["tis_token", "mis_token"])
def test_is_metrics_of_a_batch_do_not_depend_on_its_micro_batches(model_dir, correction):
    """ESS and kept-token means are ratios of batch sums: computed once over the batch, not averaged."""
    model = load_model(model_dir)
    batch = _noisy_behaviour(model)
    _, whole = _train(model, batch, correction=correction, micro_batch_tokens=10_000)
    _, split = _train(model, batch, correction=correction, micro_batch_tokens=12)
    for key in ("is/mean", "is/ess", "is/clip_frac", "is/masked_frac", "mismatch/k1", "mismatch/k3"):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key


def test_ppo_metrics_under_masked_is_do_not_depend_on_micro_batches(model_dir):
    """ppo/* are means over kept tokens: a micro-batch whose tokens were all dropped adds nothing."""
    model = load_model(model_dir)
    batch = _noisy_behaviour(model)
    settings = {"correction": "geo_mask", "correction_cap": 1.2, "epochs_per_batch": 2}  # drops whole rows
    _, whole = _train(model, batch, micro_batch_tokens=10_000, **settings)
    _, split = _train(model, batch, micro_batch_tokens=1, **settings)  # a row per micro-batch
    assert 0 < whole["is/masked_frac"] < 1
    for key in ("ppo/clip_frac", "ppo/ratio_mean", "ppo/approx_kl"):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key


def test_ppo_metrics_with_tokens_outside_top_k_do_not_depend_on_micro_batches(model_dir):
    """A token outside the trainer's top-k set has no ratio and is left out of ppo/*: a micro-batch of
    such tokens reports its means over none of them, and weighs nothing in the batch's."""
    model = load_model(model_dir)
    batch = _batch(model)
    settings = {"epochs_per_batch": 2, "sampling": SamplingView(1.0, 5, 1.0)}
    _, whole = _train(model, batch, micro_batch_tokens=10_000, **settings)
    _, split = _train(model, batch, micro_batch_tokens=12, **settings)
    assert 0 < whole["mismatch/outside_support_frac"] < 1
    for key in ("ppo/clip_frac", "ppo/ratio_mean", "ppo/approx_kl"):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key


def test_dr_grpo_divides_by_the_generation_budget_not_the_batch_padding(model_dir):
    """seq_mean_token_sum_norm with ``max_completion_len``: a row's per-token weight is 1 / (B * budget),
    whatever length the batch happens to be padded to."""
    model = load_model(model_dir)
    batch = _batch(model)
    budget = 32  # above the batch's padded length (10)
    trainer = PolicyTrainer(model, *_optimizer_and_scheduler(model), PolicyLossSettings(
        loss_agg="seq_mean_token_sum_norm", max_completion_len=budget), SamplingView(1.0))
    weights = aggregation_weights(trainer.aggregate, batch.mask)
    assert batch.mask.shape[1] < budget
    torch.testing.assert_close(weights[batch.mask], torch.full_like(weights[batch.mask], 1 / (batch.num_seqs * budget)))


def _optimizer_and_scheduler(model, warmup_steps=0):
    optimizer = build_optimizer(model.parameters(), lr=1e-3)
    return optimizer, build_scheduler(optimizer, warmup_steps=warmup_steps, max_steps=10, schedule="constant")


def test_lr_metric_is_the_rate_the_step_used(model_dir):
    """Warm-up over 2 steps: the first batch trains at half the peak rate, and says so."""
    model = copy.deepcopy(load_model(model_dir))
    optimizer, scheduler = _optimizer_and_scheduler(model, warmup_steps=2)
    trainer = PolicyTrainer(model, optimizer, scheduler, PolicyLossSettings(), SamplingView(1.0))
    batch = _batch(model)
    assert [trainer.train_on(batch)["lr"] for _ in range(3)] == pytest.approx([5e-4, 1e-3, 1e-3])


@pytest.mark.parametrize("proximal", ["recompute", "loglinear", "bypass"])
def test_mismatch_is_measured_against_the_pre_update_weights_over_several_epochs(model_dir, proximal):
    """Engine and trainer share the weights: every proximal mode reports no mismatch, even after
    the batch's later epochs have moved the weights."""
    model = load_model(model_dir)
    _, metrics = _train(model, _batch(model), proximal=proximal, epochs_per_batch=3, policy_loss="decoupled_ppo")
    assert metrics["mismatch/k3"] < 1e-6 and metrics["mismatch/abs_logp_diff"] < 1e-4


def test_lag0_mismatch_leaves_out_samples_continued_across_a_weight_update(model_dir):
    """A sample whose first tokens version 2 sampled and whose later ones version 3 did (a partial
    rollout) computed those later tokens over KV of version 2's weights: their engine log-probs carry
    that drift, so the engine/trainer numerics (lag0) leave the whole sample out."""
    model = load_model(model_dir)
    batch = _batch(model)
    batch.versions = torch.full_like(batch.versions, 3)
    batch.versions[0, :2] = 2
    batch.behaviour_logprobs[0] = torch.where(batch.mask[0], batch.behaviour_logprobs[0] - 0.5, 0.0)
    _, metrics = _train(model, batch, policy_loss="decoupled_ppo", policy_version=3)
    assert metrics["mismatch/k3"] > 1e-3  # the drift is there...
    assert metrics["mismatch/lag0_k3"] < 1e-6  # ...and not in the numerics
    lengths = batch.mask.sum(dim=1)
    assert metrics["mismatch/lag0_frac"] == pytest.approx(float(lengths[1:].sum() / lengths.sum()))


def test_loglinear_measures_the_epochs_of_a_batch_in_policy_versions(model_dir):
    """Versions count batches; with E optimizer steps per batch the weights at epoch e are e / E of
    a version past the proximal ones (not e versions), so alpha = dv / (dv + e / E)."""
    model = copy.deepcopy(load_model(model_dir))
    optimizer = build_optimizer(model.parameters(), lr=1e-3)
    scheduler = build_scheduler(optimizer, warmup_steps=0, max_steps=10, schedule="constant")
    trainer = PolicyTrainer(model, optimizer, scheduler,
                            PolicyLossSettings(proximal="loglinear", epochs_per_batch=4, policy_loss="decoupled_ppo"),
                            SamplingView(1.0))
    seen = []
    loglinear = PROXIMAL_MODES["loglinear"]

    def spy(logp, logp_old_all, logp_behav, versions, version, progress):
        seen.append(progress)
        return loglinear.logprobs(logp, logp_old_all, logp_behav, versions, version, progress)

    trainer.proximal = ProximalMode(spy, is_pre_update=False, reads_current=True)
    trainer.train_on(_batch(model), policy_version=3)
    assert sorted(set(seen)) == [0.0, 0.25, 0.5, 0.75]
    behav, current = torch.zeros(1, 1), torch.ones(1, 1)
    out = loglinear.logprobs(current, None, behav, torch.tensor([[1]]), 3, 0.5)  # dv = 2
    assert out.item() == pytest.approx(2 / 2.5)


def test_a_batch_with_a_non_finite_gradient_skips_its_step_and_the_next_batch_trains(model_dir, capsys):
    """A NaN in the loss (here one advantage) would write NaN into every weight through AdamW: the
    step is skipped instead (weights and moments unchanged, warned once, counted), as verl does."""
    model = copy.deepcopy(load_model(model_dir))
    optimizer, scheduler = _optimizer_and_scheduler(model)
    trainer = PolicyTrainer(model, optimizer, scheduler, PolicyLossSettings(), SamplingView(1.0))
    clean = _batch(model)
    poisoned = copy.deepcopy(clean)
    poisoned.advantages[0] = float("nan")
    before = copy.deepcopy(model.state_dict())
    for _ in range(2):
        metrics = trainer.train_on(poisoned)
        assert metrics["optim/skipped_steps"] == 1 and metrics["grad_norm"] != metrics["grad_norm"]  # NaN
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert not optimizer.state or all(not s for s in optimizer.state.values())  # no moments written
    assert capsys.readouterr().err.count("optimizer step skipped") == 1

    metrics = trainer.train_on(clean)
    assert metrics["optim/skipped_steps"] == 0 and metrics["grad_norm"] > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_kl_to_the_reference_compares_unfiltered_distributions_under_top_k(model_dir):
    """Under top-k, a token outside the reference's kept set has log-prob -inf there: the KL the
    policy owes must not vanish on exactly those tokens. KL and its gradient are the same whatever
    top-k/top-p the samples were drawn with (temperature only, as verl and OpenRLHF compute it)."""
    reference = load_model(model_dir)
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    batch = _batch(policy)
    batch.advantages.zero_()  # the KL term alone

    def kl_and_grad(top_k):
        model = copy.deepcopy(policy)
        optimizer = build_optimizer(model.parameters(), lr=0.0)  # the gradient is compared, not an update
        scheduler = build_scheduler(optimizer, warmup_steps=0, max_steps=10, schedule="constant")
        settings = PolicyLossSettings(kl_coef=0.5, grad_clip=0.0)
        trainer = PolicyTrainer(model, optimizer, scheduler, settings, SamplingView(1.0, top_k=top_k),
                                ref_model=copy.deepcopy(reference).eval().requires_grad_(False))
        batch_k = copy.deepcopy(batch)
        with torch.no_grad():  # behaviour log-probs as the engine would report them under this top-k
            batch_k.behaviour_logprobs, _ = completion_logprobs(
                policy, batch.prompt_ids, [ids[:n] for ids, n in zip(batch.completion_ids.tolist(),
                                                                     batch.mask.sum(1).tolist())],
                SamplingView(1.0, top_k=top_k), num_cols=batch.mask.shape[1])
        metrics = trainer.train_on(batch_k)
        return metrics["kl/ref"], torch.cat([p.grad.flatten() for p in model.parameters()])

    kl_full, grad_full = kl_and_grad(0)
    kl_top2, grad_top2 = kl_and_grad(2)
    assert kl_full > 0.05
    assert kl_top2 == pytest.approx(kl_full, rel=1e-5)
    torch.testing.assert_close(grad_top2, grad_full, rtol=1e-4, atol=1e-7)


def test_advantage_metrics_weigh_each_sample_by_its_tokens(model_dir):
    model = copy.deepcopy(load_model(model_dir))
    optimizer, scheduler = _optimizer_and_scheduler(model)
    trainer = PolicyTrainer(model, optimizer, scheduler, PolicyLossSettings(), SamplingView(1.0))
    batch = _batch(model)
    batch.advantages = torch.tensor([1.0, -1.0, 0.0, 0.0, 2.0, 0.0, 0.0, -2.0])
    metrics = trainer.train_on(batch)
    lengths = batch.mask.sum(dim=1).double()
    mean = float((batch.advantages.double() * lengths).sum() / lengths.sum())
    std = float((((batch.advantages.double() - mean) ** 2 * lengths).sum() / lengths.sum()).sqrt())
    assert metrics["advantage/mean"] == pytest.approx(mean) and metrics["advantage/std"] == pytest.approx(std)
    assert (metrics["advantage/max"], metrics["advantage/min"], metrics["advantage/zero_frac"]) == (2.0, -2.0, 0.5)
