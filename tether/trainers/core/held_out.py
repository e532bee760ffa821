"""Held-out evaluation at a trainer's eval points, written once for every trainer:

- `HeldOut`: greedy completions of held-out prompts from the policy in memory, scored and reported
  by tether.evaluation exactly as `tether eval ... decoding=greedy` reports the saved checkpoint
  (`eval/greedy/pass@1`, `eval/greedy/reward`, `eval/greedy/rewards/<fn>/mean`, ...): the GRPO
  family and PPO on `data.eval_data` prompts, SFT on the prompts of its held-out rows when
  `sft.eval_reward_funcs` is given, best-of-n's RFT run on bon's `data.eval_data` prompts (and bon
  on the policy before RFT: `HeldOut.evaluate`). The likelihood metrics (SFT's eval/loss and
  eval/perplexity, the offline family's implicit-reward accuracy and margins, the reward model's
  accuracy) stay with their trainers, since they are the trainers' own forwards on held-out rows.
- `Best`: `run.keep_best=<eval metric>`: after each eval point whose value beats every earlier one,
  the policy is written to `checkpoints/best/` (model + tokenizer, `best.json` = metric, mode, step,
  value); summary.json's `best` says the same. It is not a `step-N` directory, so `keep_last`
  rotation (which deletes old `step-*` only) never removes it and resume never picks it.
- the refusals, before any model loads: eval keys without held-out data, a keep_best metric the
  run never logs, a metric whose direction its name does not tell (`run.keep_best_mode`).

Greedy only for generation: one completion per prompt at temperature 0 is cheap and has no
sampling noise, so successive eval points compare. Under torchrun every rank evaluates every
prompt on the whole replica (the same numbers everywhere; rank 0 writes them), and keep_best's
decision is rank 0's, broadcast, so every rank takes part in the same (collective) writes.
"""

from __future__ import annotations

import json
import math
import time
from typing import Iterable, Optional, Sequence

from tether import distributed
from tether.config import ConfigError
from tether.data import encode_prompts, load_data
from tether.evaluation.generation import GenerationSettings, evaluate_generation
from tether.rewards.scoring import fn_name, resolve_reward_funcs

# What a generation eval point logs (under eval/greedy/), besides eval/greedy/rewards/<fn>/mean.
GENERATION_METRICS = ("pass@1", "reward", "frac_unscored", "completions/mean_length",
                      "completions/clipped_ratio")
# Short names keep_best accepts for the greedy numbers (`keep_best=eval/pass@1`).
ALIASES = {"eval/pass@1": "eval/greedy/pass@1", "eval/reward": "eval/greedy/reward"}
# The metric shown in the progress bar when keep_best names none: the first one logged of these.
SHOWN = ("eval/greedy/pass@1", "eval/rewards/accuracies", "eval/accuracy", "eval/loss")


def generation_metrics(funcs) -> set[str]:
    """The names a HeldOut with these reward functions logs (none without functions)."""
    if not funcs:
        return set()
    return {f"eval/greedy/{k}" for k in GENERATION_METRICS} | \
        {f"eval/greedy/rewards/{fn_name(f)}/mean" for f in funcs}


# -- the refusals ----------------------------------------------------------------------------------

def check_eval(cfg, funcs_need_data: bool = True) -> None:
    """For the trainers that sample prompts (grpo family, ppo): eval_every (and, where they mean
    nothing else, eval_reward_funcs) need held-out prompts: refused, not ignored. PPO also logs
    eval_reward_funcs on its training samples, so there they stand alone (funcs_need_data=False)."""
    if cfg.data.eval_data:
        return
    if cfg.run.eval_every:
        raise ConfigError("config key 'run.eval_every' needs held-out prompts: data.eval_data=<file>")
    if funcs_need_data and cfg.reward.eval_reward_funcs:
        raise ConfigError("config key 'reward.eval_reward_funcs' needs held-out prompts: data.eval_data=<file>")


def best_mode(metric: str, mode: str = "auto") -> str:
    """'max' or 'min' for `metric`: `mode` when given, else from the name's last part: accuracy,
    pass@k, rewards, margins, agreement with gold are better high; loss, perplexity, NLL, KL low."""
    if mode in ("max", "min"):
        return mode
    parts = metric.split("/")
    leaf = parts[-1]
    if leaf.endswith("loss") or leaf in ("perplexity", "nll") or leaf.startswith("kl"):
        return "min"
    if leaf.startswith("pass@") or leaf in ("accuracy", "accuracies", "reward", "margin", "margins",
                                           "gold_agreement") or (leaf == "mean" and "rewards" in parts):
        return "max"
    raise ConfigError(f"config key 'run.keep_best_mode': is {metric} better high or low? "
                      f"set run.keep_best_mode=max or min")


def check_keep_best(cfg, produced: Optional[Iterable[str]], held_out: bool) -> None:
    """`run.keep_best` must name an eval metric this run logs at its eval points. `produced`: the
    eval metric names the run will log (None: not known before it runs, e.g. an SFT eval_hook's;
    then the first eval point checks); `held_out`: the run has held-out data at all."""
    metric = cfg.run.keep_best
    if not metric:
        return
    name = ALIASES.get(metric, metric)
    if not held_out:
        raise ConfigError(f"config key 'run.keep_best': {metric} is never logged: this run has no "
                          f"held-out data (data.eval_data=<file>) to evaluate")
    produced = None if produced is None else sorted(produced)
    if produced is not None and name not in produced:
        raise ConfigError(f"config key 'run.keep_best': {metric} is never logged by this run; its eval "
                          f"metrics are {', '.join(produced)}")
    best_mode(name, cfg.run.keep_best_mode)


def eval_rewards(specs, funcs, weights):
    """(functions, weights) that score held-out completions: `specs` (eval_reward_funcs, each
    weight 1.0), else the training rewards; resolved now, before any model loads."""
    if specs:
        evals = resolve_reward_funcs(specs)
        return evals, [1.0] * len(evals)
    return funcs, weights


def load_eval_prompts(cfg, tokenizer) -> list[dict]:
    """The held-out prompt rows of a prompt trainer (columns renamed as the training data's), or []."""
    d = cfg.data
    if not d.eval_data:
        return []
    rows, _ = encode_prompts(load_data(d.eval_data, expect="prompt-only", rename=d.columns), tokenizer,
                             d.max_prompt_length, d.truncation, source=d.eval_data)
    return rows


# -- generation at eval points ---------------------------------------------------------------------

class HeldOut:
    """Called at eval points: the metrics (prefixed eval/) of the policy the sampler holds; {}
    without rows. `sampler`: the trainer's own (GRPO, PPO: its KV storage is reused); None = one
    made here on first use, over `Training.rollout_model()` (SFT)."""

    def __init__(self, rows: list[dict], funcs, weights, max_new_tokens: int, stop: Sequence[str] = (),
                 batch_size: int = 64):
        self.rows, self.funcs, self.weights = rows, funcs, weights
        self.names = [fn_name(f) for f in funcs]
        self.settings = GenerationSettings(decoding=("greedy",), max_new_tokens=max_new_tokens,
                                           stop=tuple(stop), batch_size=batch_size)
        self.sampler = None

    @classmethod
    def of_prompts(cls, cfg, rows, funcs, weights) -> "HeldOut":
        """The prompt trainers' (grpo family, ppo): their rollout's length and stop strings."""
        r = cfg.rollout
        return cls(rows, funcs, weights, r.max_new_tokens, r.stop, cfg.data.batch_size * r.num_generations)

    def __call__(self, t, sampler=None) -> dict:
        if not self.rows:
            return {}
        # up to date (torchrun: collective, every rank calls)
        return self.evaluate(t.rollout_model(), t.tokenizer, sampler)

    def evaluate(self, model, tokenizer, sampler=None) -> dict:
        """The eval point's metrics of `model` itself, outside a training loop (best-of-n scores
        the policy it sampled from before RFT: the 'before' next to the RFT run's 'after')."""
        if not self.rows:
            return {}
        if sampler is None:
            from tether.rollout import Sampler, SamplingConfig
            if self.sampler is None or self.sampler.model is not model:
                self.sampler = Sampler(model, tokenizer, SamplingConfig(max_new_tokens=self.settings.max_new_tokens))
            sampler = self.sampler
        was = model.training
        model.eval()  # dropout off, as `tether eval` loads the checkpoint
        start = time.perf_counter()
        try:
            metrics, _ = evaluate_generation(sampler, self.rows, self.funcs, self.weights, self.settings,
                                             self.names)
        finally:
            model.train(was)
        # the prompt / completion counts are constants of the run: not curves. eval/seconds lets a
        # curve against wall-clock leave out the time spent evaluating (metrics' `time` includes it).
        return {**{f"eval/{k}": v for k, v in metrics.items() if not k.endswith(("/prompts", "/completions"))},
                "eval/seconds": time.perf_counter() - start}


# -- keep_best -------------------------------------------------------------------------------------

class Best:
    """The best value of `run.keep_best` so far and the step it was logged at; its state goes into
    every checkpoint (Training's carry), so a resumed run compares against what the run had seen."""

    def __init__(self, metric: str, mode: str):
        self.metric, self.mode = ALIASES.get(metric, metric), best_mode(ALIASES.get(metric, metric), mode)
        self.step: Optional[int] = None
        self.value: Optional[float] = None

    def better(self, value) -> bool:
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return False  # NaN never wins (and is logged as null)
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value  # ties: the earlier stays

    def update(self, t, metrics: dict) -> None:
        """After an eval point: write checkpoints/best when `metrics` holds a new best."""
        if self.metric not in metrics:
            if metrics:  # an eval point that logs something else: the metric will never come
                raise ConfigError(f"config key 'run.keep_best': {self.metric} is not logged by this run; "
                                  f"its eval metrics are {', '.join(sorted(metrics))}")
            return
        value = float(metrics[self.metric])
        if not distributed.broadcast_object(self.better(value)):  # rank 0 decides for all
            return
        self.step, self.value = t.step, value
        record = self.state_dict()

        def note(directory):  # inside the atomic write, so best.json always describes the weights
            if distributed.is_main():
                (directory / "best.json").write_text(json.dumps(record, indent=2) + "\n")
        t.checkpoint(name="best", extra=note)

    def state_dict(self) -> dict:
        return {"metric": self.metric, "mode": self.mode, "step": self.step, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if (state.get("metric"), state.get("mode")) == (self.metric, self.mode):  # else a new race
            self.step, self.value = state["step"], state["value"]

    def summary(self, run_path) -> dict:
        return {**self.state_dict(),
                "checkpoint": None if self.step is None else str(run_path / "checkpoints" / "best")}


def shown(metrics: dict, metric: Optional[str]) -> dict:
    """The progress bar's eval entry: keep_best's metric, else the first of SHOWN that was logged."""
    for key in ([metric] if metric else []) + list(SHOWN):
        if isinstance(metrics.get(key), (int, float)):
            return {"eval_" + key.rsplit("/", 1)[-1]: metrics[key]}
    return {}
