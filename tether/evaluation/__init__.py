"""Evaluation on held-out data (`tether eval`; trainers call the same functions at eval points).

Layer: below the trainers, above rollout / rewards (it samples and scores) and models / data.
estimators.py is pure (pass@k, preference statistics, perplexity); generation.py and likelihood.py
take a model already in memory; command.py is the CLI's config and driver (runners.py: its modes).
Submodules import each other by module path, so this __init__ may import them all.
"""

from tether.evaluation.estimators import mean_pass_at_k, pass_at_k, perplexity, preference_stats
from tether.evaluation.generation import GenerationSettings, evaluate_generation

__all__ = ["pass_at_k", "mean_pass_at_k", "perplexity", "preference_stats", "GenerationSettings",
           "evaluate_generation"]
