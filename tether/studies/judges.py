"""`tether study judges`: AI-judge biases measured against known truth (docs/ai-feedback.md).

(a) The gold-reward preference world (tether.tasks.preference_world). The pairs the gold
Bradley–Terry labeller labels are labelled again by judges with known biases, each a probability
of "the first shown is better" for a presentation (u first, v second), g the gold reward, τ its
temperature, P_BT = σ((g_u − g_v)/τ):

    gold        P = P_BT                                              the gold BT labeller itself
    position    P = w + (1 − w)·P_BT,  w = 2p − 1                     prefers the first shown w.p. p
    verbosity   P = q·[L_u > L_v] + (1 − q)·P_BT   (½ at equal L)     prefers the longer w.p. q

read raw (one order: the pair as sampled) or swap-debiased (tether.feedback.judge.swap_debiased),
and turned into labels by `sample` (a Bernoulli draw with the gold labeller's own uniforms: common
random numbers, so label differences are the bias alone) or `argmax`. Each judge's labels train a
proxy RM (`tether rm`, as the over-optimization study does), scored against gold on pairs of unseen
prompts, and PPO then optimizes that proxy (one β) with gold and length logged: the over-
optimization curve per judge. (b) An instruct model (SmolLM2-135M-Instruct in the benchmark) as
judge on HH-RLHF pairs against the human labels, raw and swap-debiased, with and without a rationale.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tether.config import ConfigError, check_values
from tether.constraints import DirPath, Fraction, NonNegative, NonNegativeInt, Positive, PositiveInt, Seed
from tether.feedback.judge import choose, judge_pairs, preference_rows
from tether.run import RunDir, read_jsonl
from tether.studies.lab import plot_gold_proxy, prepare_world
from tether.studies.overoptimization import pair_accuracy, ppo_curve


@dataclass
class JudgesConfig:
    name: str = "judges"
    "run name: everything is written to <runs_dir>/<name>/"
    runs_dir: DirPath = "runs"
    "parent directory of run directories"
    seed: Seed = 0
    "seed of the world, its SFT policy and pairs, the labels, the RMs and PPO"
    n_pairs: PositiveInt = 4000
    "preference pairs every judge labels (the proxy RMs' training data)"
    position_p: Fraction = 0.7
    "the position-biased judge prefers the first shown with probability p (raw P(A) = p)"
    verbosity_q: list[Fraction] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    "verbosity-biased judges: prefer the longer response with probability q whatever the gold says"
    rm_epochs: Positive = 2.0
    "reward-model training epochs"
    rm_lr: Positive = 1e-3
    "reward-model learning rate"
    ppo_beta: NonNegative = 0.02
    "PPO KL coefficient for every judge's proxy"
    ppo_seeds: list[Seed] = field(default_factory=lambda: [0])
    "PPO runs per judge, one per seed; curves and numbers are their means (the per-seed finals are kept)"
    ppo_steps: PositiveInt = 60
    "PPO steps per judge"
    ppo_batch_size: PositiveInt = 64
    "prompts per PPO step"
    ppo_lr: Positive = 1e-3
    "PPO learning rate"
    hh_judge: str = ""
    "part (b): the judge model (HF folder or .gguf; e.g. SmolLM2-135M-Instruct); empty skips (b)"
    hh_data: str = ""
    "part (b): HH-RLHF-style preference rows (chosen/rejected) the judge relabels"
    hh_pairs: NonNegativeInt = 0
    "part (b): judge only the first N pairs (0 = all)"
    hh_cot_pairs: NonNegativeInt = 20
    "part (b): pairs also judged with a chain-of-thought rationale (0 = none)"
    constitution: str = ""
    "part (b): principles file (default: one principle, 'more helpful, honest and harmless')"
    publish_dir: str = ""
    "also copy figures, report and summary here (benchmarks/judges)"
    progress: bool = False
    "progress bars of the inner trainers"

    def __post_init__(self):
        check_values(self)
        if not 0.5 <= self.position_p <= 1:
            raise ConfigError(f"config key 'position_p' must be in [0.5, 1] (a bias towards the first); got {self.position_p}")
        if not self.ppo_seeds:
            raise ConfigError("config key 'ppo_seeds' must list at least one seed")
        if bool(self.hh_judge) != bool(self.hh_data):
            raise ConfigError("config keys 'hh_judge' and 'hh_data' go together (part b needs both)")


# -- synthetic judges ---------------------------------------------------------------------------------

def synthetic_p_first(kind: str, strength: float, g_u, g_v, len_u, len_v, tau: float = 1.0) -> np.ndarray:
    """P(first shown ≻ second) of a judge with a known bias (module docstring)."""
    bt = 1.0 / (1.0 + np.exp(-(np.asarray(g_u, float) - np.asarray(g_v, float)) / tau))
    if kind == "gold":
        return bt
    if kind == "position":
        w = 2 * strength - 1
        return w + (1 - w) * bt
    if kind == "verbosity":
        longer = np.sign(np.asarray(len_u, float) - np.asarray(len_v, float)) * 0.5 + 0.5
        return strength * longer + (1 - strength) * bt
    raise ValueError(f"unknown synthetic judge {kind!r}")


def world_judge(world, kind: str, strength: float):
    """A synthetic judge as a `p_first(presentations)` callable (the LM judge's interface)."""
    def p_first(shown):
        xs, us, vs = [s[0] for s in shown], [s[1] for s in shown], [s[2] for s in shown]
        return synthetic_p_first(kind, strength, world.gold_reward(xs, us), world.gold_reward(xs, vs),
                                 world.spurious_feature(us), world.spurious_feature(vs), world.temperature)
    return p_first


def conditions(cfg: JudgesConfig) -> list[dict]:
    p = cfg.position_p
    out = [dict(label="gold BT", kind="gold", strength=0.0, debias=False, rule="sample"),
           dict(label="gold argmax", kind="gold", strength=0.0, debias=False, rule="argmax")]
    for rule in ("sample", "argmax"):
        for debias in (False, True):
            out.append(dict(label=f"position p={p:g} {'swap' if debias else 'raw'}"
                            + (" argmax" if rule == "argmax" else ""),
                            kind="position", strength=p, debias=debias, rule=rule))
    out += [dict(label=f"verbosity q={q:g}", kind="verbosity", strength=q, debias=True, rule="sample")
            for q in cfg.verbosity_q]
    return out


def label_stats(world, prompts, a, b, picks, j) -> dict:
    """Labels against the truth: agreement with the gold order (pairs of unequal gold), share of
    chosen responses that were shown first, share that are the longer (unequal lengths)."""
    ga, gb = np.array(world.gold_reward(prompts, a)), np.array(world.gold_reward(prompts, b))
    la, lb = np.array(world.spurious_feature(a)), np.array(world.spurious_feature(b))
    gc, gr = np.where(picks, ga, gb), np.where(picks, gb, ga)
    lc, lr = np.where(picks, la, lb), np.where(picks, lb, la)
    return {"gold_order_agreement": float((gc > gr)[gc != gr].mean()), "chosen_first": float(picks.mean()),
            "chosen_longer": float((lc > lr)[lc != lr].mean()), **j.stats()}


def rm_vs_gold(proxy, world, held: list[dict]) -> dict:
    """The proxy RM on held-out pairs of unseen prompts: accuracy on the gold BT labels, on the
    gold order (pairs of unequal gold), and how often it prefers the longer of two equally good."""
    ps = [r["prompt"] for r in held]
    c, r = np.array(proxy(ps, [x["chosen"] for x in held])), np.array(proxy(ps, [x["rejected"] for x in held]))
    gc, gr = np.array([x["gold_chosen"] for x in held]), np.array([x["gold_rejected"] for x in held])
    lc = np.array(world.spurious_feature([x["chosen"] for x in held]))
    lr = np.array(world.spurious_feature([x["rejected"] for x in held]))
    d = gc != gr
    same = (gc == gr) & (lc != lr)
    longer_wins = np.where(lc > lr, c > r, r > c)
    return {"accuracy_gold_labels": pair_accuracy(proxy, held),
            "accuracy_gold_order": float((np.where(gc > gr, c > r, r > c) + 0.5 * (c == r))[d].mean()),
            "prefers_longer_at_equal_gold": float(longer_wins[same].mean()), "equal_gold_pairs": int(same.sum())}


# -- part (a) -------------------------------------------------------------------------------------------

def run_world(cfg: JudgesConfig, root: Path) -> dict:
    from tether.rewards.learned import LearnedReward
    from tether.tasks.preference_world import PreferenceWorld
    from tether.trainers.ppo import PPOConfig, train_ppo
    from tether.trainers.rm import RMConfig, train_rm

    world = PreferenceWorld(seed=cfg.seed)
    lab = prepare_world(root, world, cfg.seed, cfg.n_pairs)
    held = read_jsonl(lab["test_pairs"])
    # The gold labeller's pairs, back in a sampled order: a coin per pair says which was drawn first
    # (a and b are i.i.d. samples of the SFT policy, so this is the order they came in, in law).
    rows = read_jsonl(lab["train_pairs"])
    coin = choose(np.full(len(rows), 0.5), "sample", cfg.seed + 99)
    prompts = [r["prompt"] for r in rows]
    a = [r["chosen"] if k else r["rejected"] for r, k in zip(rows, coin)]
    b = [r["rejected"] if k else r["chosen"] for r, k in zip(rows, coin)]
    prompt_file = root / "data" / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in world.prompts(None, "train")))

    def gold_reward(prompts, completions, **kw):
        return world.gold_reward(prompts, completions)

    results = {}
    for c in conditions(cfg):
        slug = c["label"].replace(" ", "_").replace("=", "")
        j = judge_pairs(world_judge(world, c["kind"], c["strength"]), prompts, a, b, [[]] * len(a))
        p = j.p if c["debias"] else j.p_ab
        picks = choose(p, c["rule"], cfg.seed + 1)  # the same uniforms for every judge
        data = root / "data" / f"labels_{slug}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in preference_rows(prompts, a, b, j, picks)))
        stats = label_stats(world, prompts, a, b, picks, j)
        stats["max_abs_swap_change"] = float(np.abs(j.p - j.p_ab).max())
        rm = train_rm(RMConfig(model=str(lab["policy"]), data=str(data), eval_fraction=0.1, name=f"rm_{slug}",
                               runs_dir=str(root), epochs=cfg.rm_epochs, lr=cfg.rm_lr, batch_size=32,
                               device="cpu", seed=cfg.seed, progress=cfg.progress, overwrite=True))
        proxy = LearnedReward(rm["checkpoint"], device="cpu")
        rm_stats = {"accuracy_own_labels": rm.get("eval/accuracy"), **rm_vs_gold(proxy, world, held)}
        curves = []
        for ppo_seed in cfg.ppo_seeds:
            name = f"ppo_{slug}" + (f"_s{ppo_seed}" if len(cfg.ppo_seeds) > 1 else "")
            train_ppo(PPOConfig(model=str(lab["policy"]), data=str(prompt_file), name=name, runs_dir=str(root),
                                batch_size=cfg.ppo_batch_size, max_new_tokens=world.max_new_tokens,
                                max_steps=cfg.ppo_steps, lr=cfg.ppo_lr, kl_coef=cfg.ppo_beta, ppo_epochs=2,
                                num_minibatches=2, vf_coef=0.5, device="cpu", seed=ppo_seed,
                                value_model=str(rm["checkpoint"]), progress=cfg.progress,
                                save_every=cfg.ppo_steps, keep_last=0, overwrite=True),
                      reward_funcs=[proxy], eval_reward_funcs=[gold_reward])
            curve = ppo_curve(root / name, "eval_rewards/gold_reward/mean", "objective/scores")
            # mean words of the sampled responses per step (the logged length counts EOS)
            lengths = [r["completions/mean_length"] - 1 for r in read_jsonl(root / name / "metrics.jsonl")]
            curve.update(length=lengths, final_length=float(np.mean(lengths[-5:])), start_length=float(lengths[0]))
            curves.append(curve)
        curve = mean_curve(curves)
        results[c["label"]] = {**c, "labels": stats, "rm": rm_stats, "ppo": curve}
        print(f"judges: {c['label']}: gold-order agreement {stats['gold_order_agreement']:.3f}, RM acc vs gold "
              f"{rm_stats['accuracy_gold_labels']:.3f}, PPO gold gain {curve['gold_final_gain']:.2f}, "
              f"length {curve['start_length']:.1f}->{curve['final_length']:.1f}", flush=True)
    return {"bayes_optimal_accuracy": lab["bayes"], "judges": results}


def mean_curve(curves: list[dict]) -> dict:
    """Element-wise mean of PPO curves of several seeds (same steps); per-seed finals kept."""
    out = dict(curves[0])
    for k, v in curves[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(np.mean([c[k] for c in curves]))
        elif isinstance(v, list) and v and isinstance(v[0], (int, float)):
            out[k] = np.mean([c[k] for c in curves], 0).tolist()
    for k in ("gold_final_gain", "gold_peak_gain", "final_length", "proxy_final_gain"):
        out[f"{k}_per_seed"] = [c[k] for c in curves]
    return out


# -- part (b) -------------------------------------------------------------------------------------------

def run_hh(cfg: JudgesConfig) -> dict:
    from tether.feedback.constitution import load_constitution
    from tether.feedback.judge import LMJudge
    from tether.feedback.label import agreement_stats, read_pairs
    from tether.models.load import load_model, load_tokenizer

    principles = (load_constitution(cfg.constitution) if cfg.constitution
                  else ["Choose the response that is more helpful, honest and harmless."])
    pairs, _ = read_pairs(cfg.hh_data, cfg.hh_pairs)
    if pairs is None or not pairs.labelled:
        raise ConfigError(f"config key 'hh_data': {cfg.hh_data} holds no chosen/rejected pairs")
    tok = load_tokenizer(cfg.hh_judge)
    model = load_model(cfg.hh_judge, dtype="fp32", device="cpu").eval()
    out = {"data": cfg.hh_data, "judge": cfg.hh_judge, "principles": principles}
    for cot, n in ((False, len(pairs.prompts)), (True, min(cfg.hh_cot_pairs, len(pairs.prompts)))):
        if not n:
            continue
        t = time.time()
        judge = LMJudge(model, tok, cot=cot, seed=cfg.seed, batch_size=8)
        j = judge_pairs(judge, pairs.prompts[:n], pairs.first[:n], pairs.second[:n], [principles] * n)
        res = {**j.stats(), **agreement_stats(j.p_ab, j.p_ba, j.p), "seconds": round(time.time() - t, 1)}
        # the same pairs without a rationale, for a like-for-like comparison with the CoT subset
        if cot:
            base = out["direct"]
            res["direct_on_same_pairs"] = agreement_stats(np.array(base["p_ab"][:n]), np.array(base["p_ba"][:n]),
                                                          np.array(base["p"][:n]))
            res["rationale_examples"] = judge.rationales[:2]
        res.update(p_ab=j.p_ab.tolist(), p_ba=j.p_ba.tolist(), p=j.p.tolist())
        out["cot" if cot else "direct"] = res
        print(f"judges (b): {'CoT' if cot else 'direct'} on {n} pairs: position bias {res['position_bias']:.3f}, "
              f"agreement raw {res['agreement_raw']:.3f} debiased {res['agreement_debiased']:.3f}", flush=True)
    return out


# -- the study --------------------------------------------------------------------------------------

def run_judges(cfg: JudgesConfig) -> dict:
    t0 = time.time()
    root = Path(cfg.runs_dir) / cfg.name
    run = RunDir(root, overwrite=True)  # regenerated from its seed, sub-runs included
    run.write_config(cfg)
    summary = {"world": run_world(cfg, root)}
    summary["world_seconds"] = round(time.time() - t0, 1)
    if cfg.hh_judge:
        t = time.time()
        summary["hh"] = run_hh(cfg)
        summary["hh_seconds"] = round(time.time() - t, 1)
    summary["seconds"] = round(time.time() - t0, 1)
    run.write_summary(summary)
    figures = plot_judges(summary, root / "plots")
    report = _report(cfg, summary)
    (root / "report.md").write_text(report)
    if cfg.publish_dir:
        pub = Path(cfg.publish_dir)
        pub.mkdir(parents=True, exist_ok=True)
        for f in figures:
            shutil.copy(f, pub / f.name)
        (pub / "README.md").write_text(report)
        (pub / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    run.close()
    return summary


def plot_judges(summary: dict, plots: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    judges = summary["world"]["judges"]
    names = list(judges)
    out = []
    # 1. labels and RM against the truth, per judge
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=110)
    x = np.arange(len(names))
    for k, (key, lab) in enumerate([("gold_order_agreement", "labels agree with gold order"),
                                    ("chosen_first", "chosen was shown first"),
                                    ("chosen_longer", "chosen is the longer")]):
        ax1.bar(x + (k - 1) * 0.27, [judges[n]["labels"][key] for n in names], 0.27, label=lab)
    for k, (key, lab) in enumerate([("accuracy_gold_labels", "RM acc. on gold BT labels (unseen prompts)"),
                                    ("prefers_longer_at_equal_gold", "RM prefers longer at equal gold")]):
        ax2.bar(x + (k - 0.5) * 0.4, [judges[n]["rm"][key] for n in names], 0.4, label=lab)
    ax2.axhline(summary["world"]["bayes_optimal_accuracy"], color="k", ls=":", lw=1, label="Bayes-optimal acc.")
    for ax, title in ((ax1, "labels vs truth"), (ax2, "proxy RM vs truth")):
        ax.axhline(0.5, color="grey", lw=0.5)
        ax.set_xticks(x, names, rotation=35, ha="right", fontsize=7)
        ax.set(title=title, ylim=(0, 1))
        ax.legend(fontsize=7)
    fig.tight_layout()
    plots.mkdir(parents=True, exist_ok=True)
    fig.savefig(plots / "labels_rm.png")
    plt.close(fig)
    out.append(plots / "labels_rm.png")
    # 2. PPO against each judge's proxy: gold/proxy vs d, position and verbosity families apart
    for fam in ("position", "verbosity"):
        sel = [n for n in names if judges[n]["kind"] == fam or n == "gold BT"
               or (fam == "position" and n == "gold argmax")]
        path = plots / f"ppo_{fam}.png"
        plot_gold_proxy(path, {n: (judges[n]["ppo"]["d"], judges[n]["ppo"]["gold"], judges[n]["ppo"]["proxy"])
                               for n in sel}, f"PPO vs {fam}-biased judges' RMs")
        out.append(path)
    # 3. length hacking: mean response length over PPO steps
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for n in names:
        if judges[n]["kind"] != "position":
            ax.plot(judges[n]["ppo"]["length"], label=n)
    ax.axhline(12, color="grey", ls=":", lw=1, label="L* (gold's length limit)")
    ax.set(title="PPO response length (words) by the RM's judge", xlabel="PPO step", ylabel="mean words")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(plots / "length.png")
    plt.close(fig)
    out.append(plots / "length.png")
    return out


def _report(cfg: JudgesConfig, s: dict) -> str:
    w = s["world"]
    cmd = "tether study judges publish_dir=benchmarks/judges"
    default = JudgesConfig()
    for key in ("seed", "n_pairs", "position_p", "verbosity_q", "ppo_beta", "ppo_steps", "ppo_seeds",
                "hh_judge", "hh_data", "hh_pairs", "hh_cot_pairs", "constitution"):
        value = getattr(cfg, key)
        if value != getattr(default, key):  # the settings that differ from the defaults
            cmd += f" {key}=" + (",".join(map(str, value)) if isinstance(value, list) else str(value))
    lines = ["# AI judges with known biases, measured against the truth", "",
             f"Regenerate: `{cmd}` (seed {cfg.seed}; part (a) {s['world_seconds']:.0f} s"
             + (f", part (b) {s['hh_seconds']:.0f} s" if "hh" in s else "") + " on this machine, 2 CPU cores shared).", "",
             f"## (a) Gold-reward preference world: {cfg.n_pairs} pairs, PPO β = {cfg.ppo_beta:g}, {cfg.ppo_steps} steps, "
             f"{len(cfg.ppo_seeds)} PPO seed(s) per judge (PPO columns: their mean)", "",
             "Labels: agreement with the gold order (pairs of unequal gold), share of chosen shown first / longer; "
             "`P(A)`: the judge's mean probability for the first shown over both orders, before debiasing. RM: "
             f"accuracy on 1000 gold-BT-labelled pairs of unseen prompts (Bayes-optimal {w['bayes_optimal_accuracy']:.3f}), "
             "on their gold order, and how often it prefers the longer of two equally good responses. PPO: gold "
             "and proxy gain over the SFT policy (smoothed), final KL, mean words at the start and end (L* = 12).", "",
             "| judge | P(A) raw | labels: gold order | chosen first | chosen longer | RM acc (gold BT) | RM acc (gold order) "
             "| RM longer @ equal gold | PPO gold peak | PPO gold final | PPO proxy final | KL | words start→end |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in w["judges"].items():
        la, rm, pp = r["labels"], r["rm"], r["ppo"]
        lines.append(f"| {n} | {la['position_bias']:.3f} | {la['gold_order_agreement']:.3f} | {la['chosen_first']:.3f} | "
                     f"{la['chosen_longer']:.3f} | {rm['accuracy_gold_labels']:.3f} | {rm['accuracy_gold_order']:.3f} | "
                     f"{rm['prefers_longer_at_equal_gold']:.3f} | {pp['gold_peak_gain']:.2f} | {pp['gold_final_gain']:.2f} | "
                     f"{pp['proxy_final_gain']:.2f} | {pp['final_kl']:.2f} | {pp['start_length']:.1f}→{pp['final_length']:.1f} |")
    if len(cfg.ppo_seeds) > 1:
        lines += ["", "PPO per seed (seeds " + ", ".join(map(str, cfg.ppo_seeds)) + "): gold final gain; words at the end.", "",
                  "| judge | gold final gain per seed | words at the end per seed |", "|---|---|---|"]
        for n, r in w["judges"].items():
            pp = r["ppo"]
            lines.append(f"| {n} | " + ", ".join(f"{x:.2f}" for x in pp["gold_final_gain_per_seed"]) + " | "
                         + ", ".join(f"{x:.1f}" for x in pp["final_length_per_seed"]) + " |")
    verb = [r for r in w["judges"].values() if r["kind"] == "verbosity"]
    if verb:
        lines += ["", "Swap debiasing on the verbosity judges changed no probability: max |P̂ − P_raw| = "
                  + ", ".join(f"{r['labels']['max_abs_swap_change']:.1e} (q={r['strength']:g})" for r in verb) + "."]
    if "hh" in s:
        h = s["hh"]
        lines += ["", f"## (b) {Path(h['judge']).name} as judge on HH-RLHF vs the human labels", "",
                  f"Data: `{h['data']}`; principle(s): {'; '.join(h['principles'])}", "",
                  "| mode | pairs | P(A) raw | first-choice rate | order-consistent | agreement raw (one order) "
                  "| agreement debiased | P(A) after debiasing | seconds |", "|---|---|---|---|---|---|---|---|---|"]
        for mode in ("direct", "cot"):
            if mode in h:
                r = h[mode]
                lines.append(f"| {'direct answer' if mode == 'direct' else 'chain of thought'} | {r['pairs']} | "
                             f"{r['position_bias']:.3f} | {r['first_choice_rate']:.3f} | {r['order_consistency']:.3f} | "
                             f"{r['agreement_raw']:.3f} | {r['agreement_debiased']:.3f} | {r['debiased_position_bias']:.3f} | "
                             f"{r['seconds']:.0f} |")
        if "cot" in h:
            d = h["cot"]["direct_on_same_pairs"]
            lines.append(f"\nOn the CoT pairs, the direct judge agreed raw {d['agreement_raw']:.3f}, debiased "
                         f"{d['agreement_debiased']:.3f}.")
        n = h["direct"]["pairs"]
        lines.append(f"\nChance is 0.5; with {n} pairs one standard error of an agreement near 0.5 is "
                     f"{0.5 / math.sqrt(n):.3f}.")
    lines += ["", "Figures: labels_rm.png, ppo_position.png, ppo_verbosity.png, length.png.", ""]
    return "\n".join(lines)
