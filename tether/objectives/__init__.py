"""tether.objectives: every loss and estimator as a pure tensor function (no model calls).

Losses return ``(loss, metrics)`` with metrics a dict of detached 0-d tensors; estimators return
tensors. Conventions (alignment of :func:`token_logps`, population std, signs, aggregation
constants) are documented in ``docs/objectives.md`` and in each docstring.
"""
from ._masks import AGG_MODES, aggregate_loss, as_bool, masked_mean, masked_sum, masked_var, masked_whiten
from .advantages import (
    ADVANTAGE_ESTIMATORS,
    Estimator,
    compute_advantages,
    discounted_returns,
    gae,
    group_stats,
    grpo_advantages,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
)
from .importance import IS_CORRECTIONS, IS_LEVELS, Correction, importance_weights, is_metrics, masked_is, truncated_is
from .logprobs import entropy_from_logits, sequence_logps, sft_loss, token_entropy, token_logps
from .policy import (
    KL_ESTIMATORS,
    SURROGATES,
    AdaptiveKLController,
    Surrogate,
    FixedKLController,
    best_of_n_kl,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalized_rewards,
    last_token_index,
    policy_loss,
    value_loss,
)
from .preference import (
    PREFERENCE_LOSSES,
    PairLogps,
    bradley_terry_loss,
    chosen_nll,
    kto_kl_reference_point,
    kto_loss,
    log1mexp,
    log_odds,
    orpo_loss,
    pairwise_preference_loss,
    preference_loss,
    simpo_loss,
)

__all__ = [
    "AGG_MODES", "aggregate_loss", "as_bool", "masked_mean", "masked_sum", "masked_var", "masked_whiten",
    "ADVANTAGE_ESTIMATORS", "Estimator", "compute_advantages", "discounted_returns", "gae", "group_stats",
    "grpo_advantages", "reinforce_pp_advantages", "remax_advantages", "rloo_advantages",
    "IS_CORRECTIONS", "IS_LEVELS", "Correction", "importance_weights", "is_metrics", "masked_is", "truncated_is",
    "entropy_from_logits", "sequence_logps", "sft_loss", "token_entropy", "token_logps",
    "KL_ESTIMATORS", "SURROGATES", "Surrogate", "AdaptiveKLController", "FixedKLController", "best_of_n_kl", "kl_k1", "kl_k2",
    "kl_k3", "kl_penalized_rewards", "last_token_index", "policy_loss", "value_loss",
    "PREFERENCE_LOSSES", "PairLogps", "bradley_terry_loss", "chosen_nll", "kto_kl_reference_point", "kto_loss", "log1mexp",
    "log_odds", "orpo_loss", "pairwise_preference_loss", "preference_loss", "simpo_loss",
]
