"""Reward functions: resolution from config names, and the single place rewards are computed."""

from tether.rewards.compute import RewardComputer, RewardResult, WeightedReward
from tether.rewards.loader import BUILTIN_REWARDS, exact_match, resolve_reward

__all__ = ["BUILTIN_REWARDS", "RewardComputer", "RewardResult", "WeightedReward", "exact_match",
           "resolve_reward"]
