"""GRPO's held-out evaluation (`data.eval_data`, `run.eval_every`, `reward.eval_reward_funcs`): greedy
completions of held-out prompts from the policy in memory, scored and reported by
tether.evaluation exactly as `tether eval ... decoding=greedy` reports the saved checkpoint
(logged as `eval/greedy/pass@1`, `eval/greedy/reward`, `eval/greedy/rewards/<fn>/mean`, ...).

The prompts are read, validated and tokenised with the training prompts, before any model loads.
Greedy only: one completion per prompt at temperature 0 is cheap and has no sampling noise, so
successive eval points compare. Under torchrun every rank evaluates every prompt on the whole
replica (the same numbers everywhere; rank 0 writes them).
"""

from __future__ import annotations

from tether.config import ConfigError
from tether.data import encode_prompts, load_data
from tether.evaluation.generation import GenerationSettings, evaluate_generation
from tether.rewards.scoring import fn_name, resolve_reward_funcs


def check_eval(cfg) -> None:
    """eval_every / eval_reward_funcs mean nothing without held-out prompts: refused, not ignored."""
    if not cfg.data.eval_data and (cfg.run.eval_every or cfg.reward.eval_reward_funcs):
        key = "run.eval_every" if cfg.run.eval_every else "reward.eval_reward_funcs"
        raise ConfigError(f"config key '{key}' needs held-out prompts: data.eval_data=<file>")


def load_eval_prompts(cfg, tokenizer) -> list[dict]:
    """The held-out prompt rows (columns renamed as the training data's), or [] without eval_data."""
    d = cfg.data
    if not d.eval_data:
        return []
    rows, _ = encode_prompts(load_data(d.eval_data, expect="prompt-only", rename=d.columns), tokenizer,
                             d.max_prompt_length, d.truncation, source=d.eval_data)
    return rows


def eval_rewards(cfg, funcs, weights):
    """(functions, weights) that score held-out completions: reward.eval_reward_funcs (each weight
    1.0), else the training rewards; resolved now, before any model loads."""
    if cfg.reward.eval_reward_funcs:
        evals = resolve_reward_funcs(cfg.reward.eval_reward_funcs)
        return evals, [1.0] * len(evals)
    return funcs, weights


class HeldOut:
    """Called at eval points: the metrics (prefixed eval/) of the policy the sampler holds."""

    def __init__(self, cfg, rows: list[dict], funcs, weights):
        self.rows, self.funcs, self.weights = rows, funcs, weights
        self.names = [fn_name(f) for f in funcs]
        r = cfg.rollout
        self.settings = GenerationSettings(decoding=("greedy",), max_new_tokens=r.max_new_tokens,
                                           stop=tuple(r.stop), batch_size=cfg.data.batch_size * r.num_generations)
        self.shown: dict = {}  # the last pass@1, for the progress bar

    def __call__(self, t, sampler) -> dict:
        if not self.rows:
            return {}
        t.rollout_model()  # the sampler's copy up to date (torchrun: collective, every rank calls)
        metrics, _ = evaluate_generation(sampler, self.rows, self.funcs, self.weights, self.settings, self.names)
        self.shown = {"eval_pass@1": metrics["greedy/pass@1"]}
        # the prompt / completion counts are constants of the run: not curves
        return {f"eval/{k}": v for k, v in metrics.items() if not k.endswith(("/prompts", "/completions"))}
