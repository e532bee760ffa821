"""Shared instruments of the gold-reward studies: evaluate a policy against known truth, the
best-of-n curve from one batch of samples, and the functional forms of Gao et al. (2023).

Distances follow Gao et al.: d = √KL(π ‖ π_init), KL in nats per completion (sequence KL).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tether.objectives import best_of_n_kl, token_logps


def prepare_world(root: Path, world, seed: int, n_pairs: int, n_test_pairs: int = 1000) -> dict:
    """The lab's fixed ingredients under root/: the SFT policy (root/world/policy), N labelled
    train pairs and held-out pairs on test prompts, and the held-out Bayes-optimal accuracy.
    Reused when already there (the frontier study shares the over-optimization study's world)."""
    import json

    from tether.studies.world import build_sft_policy, make_preference_data
    from tether.tasks.preference_world import bayes_optimal_accuracy

    root = Path(root)
    policy = build_sft_policy(root / "world", seed=seed, world=world)
    # The sizes and seed are in the names, so a changed setting never reuses stale pairs.
    train_pairs = root / "data" / f"pairs_train_n{n_pairs}_s{seed}.jsonl"
    test_pairs = root / "data" / f"pairs_test_n{n_test_pairs}_s{seed}.jsonl"
    if not train_pairs.exists():
        make_preference_data(world, policy, n_pairs, seed=seed, out_path=train_pairs, split="train")
    if not test_pairs.exists():
        make_preference_data(world, policy, n_test_pairs, seed=seed + 1, out_path=test_pairs, split="test")
    held = [json.loads(line) for line in test_pairs.read_text().splitlines()]
    bayes = bayes_optimal_accuracy([r["gold_chosen"] for r in held], [r["gold_rejected"] for r in held],
                                   world.temperature)
    return {"policy": policy, "train_pairs": train_pairs, "test_pairs": test_pairs, "bayes": bayes}


@torch.no_grad()
def sequence_kl(policy, ref, rollout) -> torch.Tensor:
    """Per-completion k1 estimate of KL(π ‖ π_ref) on samples from π: Σ_t log π_t − log π_ref,t.
    Its mean over samples is unbiased for the sequence KL (each term alone can be negative)."""
    tb = rollout.training_batch()
    out = []
    for m in (policy, ref):
        logits = m(input_ids=tb["input_ids"], attention_mask=tb["attention_mask"],
                   position_ids=tb["position_ids"]).logits
        out.append(token_logps(logits, tb["input_ids"], rollout.logprob_temperature))
    mask = tb["completion_mask"]
    return torch.where(mask, out[0] - out[1], 0.0).sum(1)


@torch.no_grad()
def evaluate_policy(policy_path, ref_path, world, prompts: list[str], n: int = 8, seed: int = 0,
                    proxy=None) -> dict:
    """Sample n completions per prompt from the policy at T = 1; gold (and proxy) reward means,
    KL to the reference, mean length, and the gold win-rate against reference samples."""
    from tether.models import load_model, load_tokenizer
    from tether.rollout import sample

    tok = load_tokenizer(str(ref_path))
    pol = load_model(str(policy_path), dtype="fp32", device="cpu").eval()
    ref = load_model(str(ref_path), dtype="fp32", device="cpu").eval()
    ro = sample(pol, tok, prompts, n=n, seed=seed, temperature=1.0, max_new_tokens=world.max_new_tokens)
    ref_ro = sample(ref, tok, prompts, n=n, seed=seed + 1, temperature=1.0,
                    max_new_tokens=world.max_new_tokens)
    ps = [p for p in prompts for _ in range(n)]
    gold = np.array(world.gold_reward(ps, ro.texts))
    ref_gold = np.array(world.gold_reward(ps, ref_ro.texts))
    kl = sequence_kl(pol, ref, ro)
    out = {"gold": float(gold.mean()), "kl": float(kl.mean().clamp(min=0)),
           "length": float(np.mean(world.spurious_feature(ro.texts))),
           # P(policy's sample beats the reference's on gold), ties count half
           "win_rate": float(((gold > ref_gold) + 0.5 * (gold == ref_gold)).mean()),
           "samples": [{"prompt": p, "completion": c, "gold": float(g)}
                       for p, c, g in list(zip(ps, ro.texts, gold))[:: max(1, len(ps) // 8)]]}
    if proxy is not None:
        out["proxy"] = float(np.mean(proxy(ps, ro.texts)))
    return out


def best_of_n_curve(proxy: np.ndarray, gold: np.ndarray, ns: list[int]) -> dict[int, dict]:
    """Expected proxy and gold reward of best-of-n (selected by proxy) for each n, averaged over
    prompts: arrays [prompts, K], K ≥ n samples each. Exact over all n-subsets of the K samples
    (tether.trainers.best_of_n.bon_curve), so one sampling pass gives the whole curve."""
    from tether.trainers.best_of_n import bon_curve

    if max(ns) > proxy.shape[1]:
        raise ValueError(f"best_of_n_curve: n={max(ns)} needs at least n samples per prompt, have {proxy.shape[1]}")
    per_prompt = [bon_curve(p, g, ns) for p, g in zip(proxy, gold)]
    return {n: {"proxy": float(np.mean([c[n][0] for c in per_prompt])),
                "gold": float(np.mean([c[n][1] for c in per_prompt])), "kl": best_of_n_kl(n)} for n in ns}


def _fit(features: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares without intercept; R² against the mean (the usual coefficient of determination)."""
    coef, *_ = np.linalg.lstsq(features, y, rcond=None)
    pred = features @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return coef, (1.0 - ss_res / ss_tot) if ss_tot > 0 else float("nan")


def fit_bon(d, R) -> dict:
    """Gao et al. (2023) best-of-n form R(d) = d(α − βd), R the reward gain over the initial policy."""
    d, R = np.asarray(d, float), np.asarray(R, float)
    (a, b), r2 = _fit(np.stack([d, -d * d], 1), R)
    return {"alpha": float(a), "beta": float(b), "r2": r2, "form": "d(alpha - beta d)"}


def fit_rl(d, R) -> dict:
    """Gao et al. (2023) RL form R(d) = d(α − β log d) (d > 0; the term is 0 at d = 0)."""
    d, R = np.asarray(d, float), np.asarray(R, float)
    dlogd = np.where(d > 0, d * np.log(np.where(d > 0, d, 1.0)), 0.0)
    (a, b), r2 = _fit(np.stack([d, -dlogd], 1), R)
    return {"alpha": float(a), "beta": float(b), "r2": r2, "form": "d(alpha - beta log d)"}


def plot_gold_proxy(path: Path, curves: dict[str, tuple[list, list, list]], title: str,
                    fits: dict[str, dict] | None = None, xlabel: str = "d = sqrt(KL) (nats^1/2)") -> None:
    """One figure: for each label, gold (solid) and proxy (dashed) reward gain vs d; fitted forms dotted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_g, ax_p) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    for k, (label, (d, gold, proxy)) in enumerate(curves.items()):
        color = f"C{k}"
        ax_g.plot(d, gold, "o-", ms=3, color=color, label=label)
        ax_p.plot(d, proxy, "s--", ms=3, color=color, label=label)
        fit = (fits or {}).get(label)
        if fit and len(d):
            xs = np.linspace(1e-3, max(d), 100)
            ys = xs * (fit["alpha"] - fit["beta"] * (xs if "log" not in fit["form"] else np.log(xs)))
            ax_g.plot(xs, ys, ":", color=color, lw=1)
    ax_g.set(title=f"{title}: gold reward gain", xlabel=xlabel)
    ax_p.set(title=f"{title}: proxy (RM) reward gain", xlabel=xlabel)
    for ax in (ax_g, ax_p):
        ax.axhline(0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
