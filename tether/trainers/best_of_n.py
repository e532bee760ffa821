"""Best-of-N sampling and rejection-sampling fine-tuning (`tether bon`), and the BoN identities.

The command, top to bottom:
    load policy + prompts -> sample n completions per prompt -> score them with the proxy reward
    (any reward: built-in, module:function, rm:<path>) and, when given, a gold reward
    -> keep the argmax of the proxy per prompt -> report proxy and gold of the kept ones next to
    KL_BoN = log n − (n − 1)/n and the whole best-of-n' curve for n' = 1, 2, 4, ..., n
    -> `rft=true`: write the kept rows as prompt/completion jsonl and SFT the policy on them.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from tether.errors import UserError
from tether.objectives.policy import best_of_n_kl

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
class BoNConfig:
    model: str = ""
    "policy to sample from: a local HF directory or a hub id"
    data: str = ""
    "prompts (any format with a `prompt` column; extra columns go to the reward functions)"
    split: str = "train"
    "split to read when `data` is a dataset directory or hub name"
    max_prompts: int = 0
    "use only the first N prompts (0 = all)"
    reward_funcs: list[str] = field(default_factory=list)
    "the proxy that picks the best: built-in names, module:function, or rm:<path>[,<path>...]"
    reward_weights: Optional[list[float]] = None
    "weights of reward_funcs in the proxy (default all 1)"
    gold_reward: Optional[str] = None
    "optional gold reward (same spec forms) reported next to the proxy, e.g. tether.tasks.preference_world:gold_reward"
    n: int = 16
    "samples per prompt; the proxy-best one is kept"
    temperature: float = 1.0
    "sampling temperature"
    top_p: float = 1.0
    "nucleus sampling threshold (1 = off)"
    max_new_tokens: int = 256
    "longest completion"
    max_prompt_length: int = 1024
    "longer prompts keep their end"
    batch_size: int = 256
    "sequences sampled at once"
    name: str = "bon"
    "run name: everything is written to <runs_dir>/<name>/"
    runs_dir: str = "runs"
    "parent directory of run directories"
    rft: bool = False
    "rejection-sampling fine-tuning: SFT the policy on the kept completions (run <name>/rft)"
    rft_lr: float = 1e-5
    "RFT learning rate"
    rft_epochs: float = 1.0
    "RFT passes over the kept rows"
    rft_batch_size: int = 8
    "RFT examples per step"
    dtype: str = "auto"
    "weight dtype: fp32 | bf16 | fp16 | auto"
    device: str = "auto"
    "cuda | cpu | auto"
    seed: int = 0
    "sampling seed"

    def __post_init__(self):
        if self.n < 1:
            raise ValueError("n must be >= 1")


def run_bon(cfg: BoNConfig, reward_funcs=None, gold_reward=None) -> dict:
    """Best-of-n per `cfg`; returns the summary (also summary.json). `reward_funcs` / `gold_reward`
    (callables) override the config's specs."""
    from tether.data import encode_prompts, load_data
    from tether.models import load_model, load_tokenizer
    from tether.rewards import RewardSet, load_reward
    from tether.rollout import sample
    from tether.run import RunDir, seed_everything

    if not cfg.model:
        raise UserError("bon: `model` is required")
    if not cfg.data:
        raise UserError("bon: `data` is required (prompts)")
    funcs = list(reward_funcs) if reward_funcs is not None else list(cfg.reward_funcs)
    if not funcs:
        raise UserError("bon: at least one reward function is required (reward_funcs=[...])")
    proxy = RewardSet(funcs, cfg.reward_weights)
    gold_spec = gold_reward if gold_reward is not None else cfg.gold_reward
    gold = RewardSet([load_reward(gold_spec)]) if gold_spec else None
    seed_everything(cfg.seed)
    tok = load_tokenizer(cfg.model)
    rows, _ = encode_prompts(load_data(cfg.data, expect="prompt-only", split=cfg.split), tok,
                             cfg.max_prompt_length, source=cfg.data)
    if cfg.max_prompts:
        rows = rows[:cfg.max_prompts]
    model = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    run = RunDir(Path(cfg.runs_dir) / cfg.name)
    run.write_config(cfg)

    t0 = time.time()
    ro = sample(model, tok, [r["prompt_ids"] for r in rows], n=cfg.n, seed=cfg.seed,
                temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                max_batch_size=cfg.batch_size)
    sample_s = time.time() - t0
    prompts = [r["prompt"] for r in rows for _ in range(cfg.n)]
    extra = [k for k in rows[0] if k not in ("prompt", "prompt_ids")]
    columns = {k: [r.get(k) for r in rows for _ in range(cfg.n)] for k in extra}
    ids = [ro.completion_ids[i][ro.completion_mask[i]].tolist() for i in range(len(ro))]
    scored = proxy.score(prompts, ro.texts, ids, columns)
    golds = gold.score(prompts, ro.texts, ids, columns).total if gold else None

    best = select_best(scored.total, cfg.n)
    kept, curves = [], []
    ns = [m for m in (2 ** j for j in range(int(math.log2(cfg.n)) + 1))] + \
        ([cfg.n] if cfg.n & (cfg.n - 1) else [])
    for g, b in enumerate(best):
        i = g * cfg.n + b
        row = {"prompt": rows[g]["prompt"], "completion": ro.texts[i], "reward": scored.total[i]}
        if golds:
            row["gold"] = golds[i]
        kept.append(row)
        sl = slice(g * cfg.n, (g + 1) * cfg.n)
        curves.append(bon_curve(scored.total[sl], golds[sl] if golds else None, ns))
    run.add_samples(0, kept)

    curve = []
    for m in ns:
        pt = {"n": m, "kl_bon": best_of_n_kl(m), "d": math.sqrt(best_of_n_kl(m)),
              "proxy": float(np.mean([c[m][0] for c in curves]))}
        if golds:
            pt["gold"] = float(np.mean([c[m][1] for c in curves]))
        curve.append(pt)
        run.log(m, {k: v for k, v in pt.items() if k != "n"})
    summary = {"n": cfg.n, "prompts": len(rows), "kl_bon": best_of_n_kl(cfg.n),
               "d": math.sqrt(best_of_n_kl(cfg.n)),
               "proxy/best_mean": float(np.mean([r["reward"] for r in kept])),
               "proxy/mean": float(np.mean(scored.total)), "sample_seconds": round(sample_s, 2),
               "completions/mean_length": float(ro.lengths.float().mean()), "curve": curve}
    if golds:
        summary["gold/best_mean"] = float(np.mean([r["gold"] for r in kept]))
        summary["gold/mean"] = float(np.mean(golds))
    if cfg.rft:
        from tether.trainers.sft import SFTConfig, train_sft
        data = run.path / "rft.jsonl"
        if run.is_main:
            data.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["completion"]},
                                               ensure_ascii=False) + "\n" for r in kept))
        sft = train_sft(SFTConfig(model=cfg.model, data=str(data), name="rft", runs_dir=str(run.path),
                                  lr=cfg.rft_lr, epochs=cfg.rft_epochs, batch_size=cfg.rft_batch_size,
                                  dtype=cfg.dtype, device=cfg.device, seed=cfg.seed, num_samples=0,
                                  max_length=cfg.max_prompt_length + cfg.max_new_tokens + 2,
                                  progress=False))
        summary["rft"] = {"data": str(data), "rows": len(kept), "checkpoint": sft["checkpoint"],
                          "final_loss": sft.get("final_loss")}
    run.write_summary(summary)
    run.close()
    return summary
