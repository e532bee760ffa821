"""Best-of-N sampling and rejection-sampling fine-tuning (`tether bon`), and the BoN identities.

The command, top to bottom:
    load policy + prompts -> sample n completions per prompt -> score them with the proxy reward
    (any reward: built-in, module:function, rm:<path>) and, when given, a gold reward
    -> keep the argmax of the proxy per prompt -> report proxy and gold of the kept ones next to
    KL_BoN = log n − (n − 1)/n and the whole best-of-n' curve for n' = 1, 2, 4, ..., n
    -> `rft=true`: write the kept rows (those with proxy >= `rft_min_reward`, when set) as
       prompt/completion jsonl and SFT the policy on them;
       with `data.eval_data` the policy's greedy pass@1 / rewards on the held-out prompts before
       RFT, and the RFT run's eval points after (core/held_out.py, as every trainer's).

With an environment (`env=`, docs/environments.md) each sample is a multi-turn episode
(tether.envs.rollouts.sample_episodes; data=env draws the prompts from the environment): the
proxy is the environment's reward first, then reward_funcs (which get the transcript), the kept
sample is the episode with the highest proxy, and samples.jsonl holds its transcript.

Under torchrun each rank samples and scores a consecutive block of the prompts with its own whole
copy of the policy (no collective while sampling), drawing what one process draws for them (the
streams are keyed by the whole prompt list: Sampler.sample(only=...)); the blocks are gathered in
prompt order, rank 0 writes the outputs, and RFT is train_sft under the same torchrun.

The curve for n' < n comes from the same samples with the unbiased estimator of Nakano et al. /
Gao et al.: among N samples sorted by proxy, the one of rank i (1 = lowest) is the best of a
uniformly random n'-subset with probability C(i−1, n'−1)/C(N, n'), so
E[gold of best-of-n'] = Σ_i C(i−1, n'−1)/C(N, n') · gold_(i)   (:func:`bon_curve`).

The BoN identities (checked exactly in tests/test_best_of_n.py). For a discrete policy π over
outcomes y_1..y_M sorted by reward with no ties, F(y_i) = Σ_{j≤i} π(y_j):
    π_BoN(y_i) = F(y_i)^n − F(y_{i−1})^n                       (:func:`bon_distribution`)
    KL(π_BoN ‖ π) ≤ log n − (n − 1)/n                           (:func:`bon_kl`)
with equality only in the continuous limit: for a uniform π over M outcomes the gap closes as
M → ∞ (:func:`bon_kl_uniform`; below 1e-6 at M = 1e7).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Optional

import numpy as np

from tether.config import ConfigError, flat_init
from tether.constraints import NonNegativeInt, Positive, PositiveInt
from tether.envs.rollouts import EnvSection, episode_columns
from tether.errors import UserError
from tether.objectives.policy import best_of_n_kl
from tether.rewards.registry import as_completions
from tether.trainers.core.held_out import (HeldOut, check_eval, check_keep_best, eval_rewards, generation_metrics,
                                           load_eval_prompts)
from tether.trainers.core.sections import (check_env, DataSection, ModelSection, PromptSection, RewardSection,
                                           RolloutSection, RunSection)

__all__ = ["BoNConfig", "run_bon", "bon_distribution", "bon_brute_force", "bon_kl", "bon_kl_uniform",
           "bon_curve", "best_of_n_kl", "select_best"]


# -- the identities on an enumerable policy ------------------------------------------------------

def bon_distribution(probs, n: int) -> np.ndarray:
    """π_BoN(y_i) = F_i^n − F_{i−1}^n for `probs` ordered by ascending reward (no ties)."""
    p = np.asarray(probs, dtype=np.float64)
    F = np.cumsum(p)
    F[-1] = min(F[-1], 1.0)
    return F ** n - np.concatenate([[0.0], F[:-1]]) ** n


def bon_brute_force(probs, rewards, n: int) -> np.ndarray:
    """π_BoN by enumerating all M^n n-tuples: P(tuple) = Π π(y_k), winner = argmax reward."""
    p, r = np.asarray(probs, dtype=np.float64), np.asarray(rewards, dtype=np.float64)
    if len(set(r.tolist())) != len(r):
        raise ValueError("bon_brute_force: rewards must have no ties")
    tuples = np.array(list(itertools.product(range(len(p)), repeat=n)))       # [M^n, n]
    weight = p[tuples].prod(1)
    winner = tuples[np.arange(len(tuples)), r[tuples].argmax(1)]
    return np.bincount(winner, weights=weight, minlength=len(p))


def bon_kl(probs, n: int) -> float:
    """KL(π_BoN ‖ π) exactly, for `probs` ordered by ascending reward (no ties)."""
    p = np.asarray(probs, dtype=np.float64)
    q = bon_distribution(p, n)
    nz = q > 0
    return float(np.sum(q[nz] * np.log(q[nz] / p[nz])))


def bon_kl_uniform(M: int, n: int, chunk: int = 1 << 20) -> float:
    """KL(π_BoN ‖ uniform over M outcomes), vectorised in chunks (M ~ 1e7 takes about a second).

    π_BoN(i) = (i/M)^n − ((i−1)/M)^n = (i/M)^n · (1 − (1 − 1/i)^n), computed in log space with
    log1p/expm1 so that the difference of two numbers near 1 loses no digits:
    log(M π_BoN(i)) = log M + n log(i/M) + log(−expm1(n log1p(−1/i)))."""
    if M < 1 or n < 1:
        raise ValueError("M and n must be >= 1")
    total, logM = 0.0, math.log(M)
    for start in range(1, M + 1, chunk):
        i = np.arange(start, min(start + chunk, M + 1), dtype=np.float64)
        with np.errstate(divide="ignore"):
            tail = np.where(i > 1, np.log(-np.expm1(n * np.log1p(-1.0 / np.maximum(i, 2.0)))), 0.0)
        log_mq = logM + n * np.log(i / M) + tail                       # log(M · π_BoN(i))
        total += float(np.sum(np.exp(log_mq - logM) * log_mq))         # Σ π_BoN log(π_BoN / (1/M))
    return total


# -- the estimator and the selection -------------------------------------------------------------

def bon_curve(proxy, gold=None, ns=(1,)) -> dict[int, tuple[float, float | None]]:
    """Expected (proxy, gold) of the proxy-best of n' samples drawn without replacement from one
    prompt's N samples, for each n' in `ns` (≤ N). Ties in proxy break by sample order."""
    proxy = np.asarray(proxy, dtype=np.float64)
    N = len(proxy)
    order = np.argsort(proxy, kind="stable")
    ps = proxy[order]
    gs = None if gold is None else np.asarray(gold, dtype=np.float64)[order]
    i = np.arange(1, N + 1)
    out = {}
    for n in ns:
        if not 1 <= n <= N:
            raise ValueError(f"best-of-{n} needs 1 <= n <= {N} samples")
        # log C(i−1, n−1) − log C(N, n); zero weight where i < n.
        lw = np.full(N, -np.inf)
        ok = i >= n
        lg = np.vectorize(math.lgamma)
        lw[ok] = (lg(i[ok]) - lg(n) - lg(i[ok] - n + 1)) - (lg(N + 1) - lg(n + 1) - lg(N - n + 1))
        w = np.exp(lw)
        out[n] = (float(w @ ps), None if gs is None else float(w @ gs))
    return out


def select_best(rewards, n: int) -> list[int]:
    """Index (within its group) of the highest reward in each consecutive group of n; first wins ties."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, n)
    return r.argmax(1).tolist()


# -- the command -----------------------------------------------------------------------------------

@dataclass
class BoNSection:
    n: PositiveInt = 16
    "samples per prompt; the proxy-best one is kept"
    max_prompts: NonNegativeInt = 0
    "use only the first N prompts (0 = all)"
    gold_reward: Optional[str] = None
    "optional gold reward (same spec forms) reported next to the proxy, e.g. tether.tasks.preference_world:gold_reward"
    rft: bool = False
    "rejection-sampling fine-tuning: SFT the policy on the kept completions (run <name>/rft)"
    rft_lr: Positive = 1e-5
    "RFT learning rate"
    rft_epochs: Positive = 1.0
    "RFT passes over the kept rows"
    rft_batch_size: PositiveInt = 8
    "RFT examples per step"
    rft_min_reward: Optional[float] = None
    "RFT trains only on kept rows whose proxy reward is at least this (1.0 under a 0/1 verifier: a prompt none of whose n samples passed is left out, not trained on its failing best); unset keeps every prompt's best"


@dataclass
class BoNPrompts(PromptSection):
    batch_size: PositiveInt = 256
    "sequences sampled at once (the n completions of every prompt are decoded in waves of this many)"


@flat_init
@dataclass
class BoNConfig:
    model: ModelSection = field(default_factory=lambda: ModelSection(dtype="auto"))
    "the policy to sample from (and, with rft=true, to fine-tune: lora_r etc. apply there)"
    data: BoNPrompts = field(default_factory=lambda: BoNPrompts(max_prompt_length=1024))
    "prompts (any format with a `prompt` column; extra columns go to the reward functions); with rft=true, eval_data = held-out prompts scored before RFT and at the RFT run's eval points"
    rollout: RolloutSection = field(default_factory=lambda: RolloutSection(num_generations=1, max_new_tokens=256))
    "sampling; the samples per prompt are `n` (num_generations stays 1)"
    reward: RewardSection = field(default_factory=RewardSection)
    "the proxy that picks the best: built-in names, module:function, or rm:<path>[,<path>...]"
    run: RunSection = field(default_factory=lambda: RunSection(name="bon", num_samples=0, progress=False))
    "run directory and sampling seed; logging, checkpoints, num_samples, eval_every and keep_best apply to the RFT run"
    bon: BoNSection = field(default_factory=BoNSection)
    "best-of-n and rejection-sampling fine-tuning"
    environment: EnvSection = field(default_factory=EnvSection)
    "multi-turn episodes of an environment instead of one completion per prompt (docs/environments.md)"

    UNUSED: ClassVar[dict] = {"rollout.num_generations": "set the samples per prompt with bon.n",
                              "rollout.sampler_copy": "bon samples from the loaded policy, which does not train",
                              "rollout.release_replica": "bon samples from the loaded policy, which does not train"}
    # Held-out evaluation scores a policy that training changed: only the RFT run has one.
    EVAL_KEYS: ClassVar[tuple] = ("data.eval_data", "run.eval_every", "reward.eval_reward_funcs", "run.keep_best")

    def __post_init__(self):
        if not self.bon.rft:
            for dotted in self.EVAL_KEYS:
                section, key = dotted.split(".")
                if getattr(getattr(self, section), key):
                    raise ConfigError(
                        f"config key '{dotted}' needs bon.rft=true (it evaluates the fine-tuned policy); "
                        f"best-of-n on held-out prompts is `tether bon data=<them> bon.gold_reward=<fn>`, "
                        f"a model's pass@1 is `tether eval`")
            if self.bon.rft_min_reward is not None:
                raise ConfigError("config key 'bon.rft_min_reward' needs bon.rft=true (it filters what RFT trains on)")
        check_eval(self)  # eval_every / eval_reward_funcs need data.eval_data
        check_env(self)
        if self.environment.env and self.bon.rft:
            raise ConfigError("config key 'bon.rft': RFT fine-tunes on single-turn completions; an episode's "
                              "transcript holds the environment's messages too")


def score_samples(cfg: BoNConfig, rows: list[dict], rollout, proxy, gold) -> tuple[list, list | None]:
    """Proxy (and gold) reward of every sample, prompt-major: n consecutive samples per prompt.
    Multi-turn: each function also gets the episode's transcript (`messages`) and the environment's
    reward (`env_reward`)."""
    n = cfg.bon.n
    seq_rows = [r for r in rows for _ in range(n)]
    if rollout.episodes is not None:
        seq_rows = [{**r, **episode_columns(ep)} for r, ep in zip(seq_rows, rollout.episodes)]
    prompts = [r["prompt"] for r in seq_rows]
    columns = {k: [r.get(k) for r in seq_rows] for k in seq_rows[0] if k not in ("prompt", "prompt_ids")}
    ids = rollout.completion_lists()
    completions = as_completions(prompts, rollout.texts)  # chat prompts: message lists, as TRL passes them
    proxies = proxy.score(prompts, completions, ids, columns).total
    golds = gold.score(prompts, completions, ids, columns).total if gold else None
    return proxies, golds


def keep_best(rows: list[dict], texts: list[str], proxies, golds, n: int, ns: list[int],
              episodes: Optional[list[dict]] = None):
    """The proxy-best sample of each prompt, and each prompt's best-of-n' curve (:func:`bon_curve`).
    `episodes`: per sample, what samples.jsonl keeps of its episode (multi-turn), added to the kept."""
    kept, curves = [], []
    for group, best in enumerate(select_best(proxies, n)):
        i = group * n + best
        kept.append({"prompt": rows[group]["prompt"], "completion": texts[i], "reward": proxies[i],
                     **({"gold": golds[i]} if golds else {}), **(episodes[i] if episodes else {})})
        window = slice(group * n, (group + 1) * n)
        curves.append(bon_curve(proxies[window], golds[window] if golds else None, ns))
    return kept, curves


def rejection_sampling_fine_tune(cfg: BoNConfig, run_dir: Path, kept: list[dict], is_main: bool,
                                 held_out: HeldOut) -> dict:
    """SFT (tether.trainers.sft) of the policy on the kept completions, in <run>/rft: the model
    section and the run's logging / checkpoint / eval settings carry over, rft_* set the optimizer
    and batch; `held_out` (bon's held-out prompts) is evaluated at the RFT run's eval points."""
    from tether import distributed
    from tether.trainers.sft import SFTConfig, train_sft
    low = cfg.bon.rft_min_reward
    below = 0 if low is None else sum(r["reward"] < low for r in kept)
    kept = [r for r in kept if low is None or r["reward"] >= low]
    if not kept:
        raise UserError(f"bon: no kept completion has a proxy reward >= rft_min_reward={low}: nothing to fine-tune on")
    data = run_dir / "rft.jsonl"
    if is_main:
        # a chat prompt's completion is an assistant message, so the SFT data is conversational too
        data.write_text("".join(json.dumps({"prompt": r["prompt"],
                                            "completion": as_completions([r["prompt"]], [r["completion"]])[0]},
                                           ensure_ascii=False) + "\n" for r in kept))
    distributed.barrier()  # every rank reads the file rank 0 wrote
    summary = train_sft(SFTConfig(
        model=cfg.model, run=replace(cfg.run, name="rft", runs_dir=str(run_dir)),
        data=DataSection(path=str(data), batch_size=cfg.bon.rft_batch_size,
                         max_length=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens + 2),
        lr=cfg.bon.rft_lr, epochs=cfg.bon.rft_epochs), held_out=held_out)
    return {"data": str(data), "rows": len(kept), "below_min_reward": below, "checkpoint": summary["checkpoint"],
            "final_loss": summary.get("final_loss"),
            "eval": {k: v for k, v in summary.items() if k.startswith("eval/")},
            **({"best": summary["best"]} if "best" in summary else {})}


def run_bon(cfg: BoNConfig, reward_funcs=None, gold_reward=None) -> dict:
    """Best-of-n per `cfg`; returns the summary (also summary.json). `reward_funcs` / `gold_reward`
    (callables) override the config's specs."""
    import torch

    from tether import distributed
    from tether.data import encode_prompts, load_data
    from tether.models import load_model, load_tokenizer
    from tether.rewards import RewardSet, load_reward
    from tether.envs import load_env
    from tether.envs.rollouts import env_data, env_reward, sample_episodes
    from tether.rollout import Sampler
    from tether.run import RunDir, check_lock, refuse_previous_run, seed_everything
    from tether.envs.rollouts import episode_metrics_over_ranks
    from tether.trajectories.episodes import episode_sample

    if not cfg.model.path:
        raise UserError("bon: `model` is required")
    if not cfg.data.path:
        raise UserError("bon: `data` is required (prompts)")
    env = cfg.environment if cfg.environment.env else None  # multi-turn episodes of an environment
    funcs = list(reward_funcs) if reward_funcs is not None else list(cfg.reward.reward_funcs)
    if not funcs and env is None:
        raise UserError("bon: at least one reward function is required (reward_funcs=[...])")
    distributed.init()  # under torchrun: the process group (and each rank's GPU) before any model loads
    weights = cfg.reward.reward_weights or None
    if env is not None:  # the environment's own reward first (weight 1); reward_funcs add to it
        if weights is not None and len(weights) != len(funcs):
            raise UserError(f"bon: {len(weights)} reward_weights for {len(funcs)} reward functions")
        funcs, weights = [env_reward, *funcs], [1.0, *(weights or [1.0] * len(funcs))]
    proxy = RewardSet(funcs, weights)
    gold_spec = gold_reward if gold_reward is not None else cfg.bon.gold_reward
    gold = RewardSet([load_reward(gold_spec)]) if gold_spec else None
    # held-out prompts are scored with eval_reward_funcs (each weight 1.0), else the proxy
    eval_funcs, eval_weights = eval_rewards(cfg.reward.eval_reward_funcs, proxy.funcs, proxy.weights)
    check_keep_best(cfg, generation_metrics(eval_funcs), held_out=bool(cfg.data.eval_data))
    run_path = Path(cfg.run.runs_dir) / cfg.run.name

    def refusals():  # before any model loads; RunDir checks again under the lock. Rank 0 alone:
        check_lock(run_path)  # the others would see its lock (and say it all N times)
        refuse_previous_run(run_path, cfg.run.overwrite)
    distributed.on_main(refusals)
    seed_everything(cfg.run.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    source = env_data(env, cfg.run.seed) if env is not None and cfg.data.path == "env" else \
        load_data(cfg.data.path, expect="prompt-only", split=cfg.data.split, rename=cfg.data.columns)
    rows, _ = encode_prompts(source, tokenizer, cfg.data.max_prompt_length, cfg.data.truncation, source=cfg.data.path)
    rows = rows[:cfg.bon.max_prompts or None]
    if not rows:
        raise UserError(f"bon: no prompts left in {cfg.data.path}")
    held_out = HeldOut.of_prompts(cfg, load_eval_prompts(cfg, tokenizer), eval_funcs, eval_weights)
    model = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device,
                       attn_implementation=cfg.model.attn_implementation)
    run = RunDir(run_path, log_with=cfg.run.log_with, overwrite=cfg.run.overwrite,
                 tracker_project=cfg.run.tracker_project, mlflow_uri=cfg.run.mlflow_uri)
    run.write_config(cfg)

    n, started = cfg.bon.n, time.time()
    sampler = Sampler(model, tokenizer, replace(cfg.rollout.sampling(), max_batch_size=cfg.data.batch_size))
    lo, hi = (len(rows) * distributed.rank() // distributed.world_size(),
              len(rows) * (distributed.rank() + 1) // distributed.world_size())  # this rank's prompts
    texts, proxies, golds, lengths = [], [], None if gold is None else [], torch.zeros(0, dtype=torch.long)
    rollout, mine, episodes = None, list(range(lo, hi)), []  # mine: this rank's prompts that were sampled
    if hi > lo:
        if env is None:
            rollout = sampler.sample([r["prompt_ids"] for r in rows], n=n, seed=cfg.run.seed, only=mine)
        else:  # a prompt whose environment's reset raised is left out (env/reset_errors)
            rollout, mine = sample_episodes(sampler, tokenizer, load_env(env.env), rows, n, env, seed=cfg.run.seed,
                                            only=mine)
            episodes = [episode_sample(rollout, i) for i in range(len(rollout))]
        try:
            proxies, golds = score_samples(cfg, [rows[i] for i in mine], rollout, proxy, gold)
        except UserError as e:  # under torchrun: about this rank's completions, the others may not fail
            raise distributed.rank_local(e)
        texts, lengths = rollout.texts, rollout.lengths.cpu()
    sample_seconds = time.time() - started
    env_metrics = episode_metrics_over_ranks(rollout) if env is not None else {}  # (collective)
    # prompt order: rank order
    parts = distributed.all_gather_object((texts, proxies, golds, lengths, mine, episodes))
    texts, proxies = [x for p in parts for x in p[0]], [x for p in parts for x in p[1]]
    golds = None if gold is None else [x for p in parts for x in p[2]]
    lengths = torch.cat([p[3] for p in parts])
    sampled = [rows[i] for p in parts for i in p[4]]
    ns = [2 ** j for j in range(int(math.log2(n)) + 1)] + ([n] if n & (n - 1) else [])
    kept, curves = keep_best(sampled, texts, proxies, golds, n, ns,
                             [x for p in parts for x in p[5]] if env is not None else None)
    run.add_samples(0, kept)

    curve = []
    for m in ns:
        point = {"n": m, "kl_bon": best_of_n_kl(m), "d": math.sqrt(best_of_n_kl(m)),
                 "proxy": float(np.mean([c[m][0] for c in curves]))}
        if golds:
            point["gold"] = float(np.mean([c[m][1] for c in curves]))
        curve.append(point)
        run.log(m, {k: v for k, v in point.items() if k != "n"})
    summary = {"n": n, "prompts": len(sampled), "kl_bon": best_of_n_kl(n), "d": math.sqrt(best_of_n_kl(n)),
               "proxy/best_mean": float(np.mean([r["reward"] for r in kept])),
               "proxy/mean": float(np.mean(proxies)), "sample_seconds": round(sample_seconds, 2),
               "completions/mean_length": float(lengths.float().mean()), "curve": curve, **env_metrics}
    if golds:
        summary["gold/best_mean"] = float(np.mean([r["gold"] for r in kept]))
        summary["gold/mean"] = float(np.mean(golds))
    if cfg.bon.rft:
        # the policy before RFT on the held-out prompts: what the RFT run's eval points move from
        before = held_out.evaluate(model, tokenizer, sampler)
        summary["rft"] = rejection_sampling_fine_tune(cfg, run.path, kept, run.is_main, held_out)
        after = summary["rft"].pop("eval")  # its last eval point: the RFT policy
        if held_out.rows:
            summary["eval"] = {"before": before, "after": after}
    run.write_summary(summary)
    run.close()
    return summary
