"""Generation evaluation: sample completions of held-out prompts, score them with reward functions,
report pass@k (unbiased, Chen et al. 2021), mean rewards, lengths and truncation.

    metrics, records = evaluate_generation(sampler, rows, funcs, weights, GenerationSettings(n=8))
    metrics["greedy/pass@1"], metrics["sampled/pass@8"], metrics["sampled/rewards/arithmetic/mean"]

`rows` are encoded prompt rows (`tether.data.encode_prompts`: every column kept + `prompt_ids`),
scored exactly as the online trainers score them (`tether.rewards.scoring.score_rollout`: the
data's extra columns reach reward functions as keyword lists; chat prompts get message-list
completions). A trainer passes its own Sampler (the model in memory, its KV storage) at eval points.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from tether.evaluation.estimators import mean_pass_at_k
from tether.rewards.scoring import fn_name, score_rollout

DECODINGS = ("greedy", "sampled")


@dataclass
class GenerationSettings:
    """What is sampled and how it is judged; recorded whole in eval.json."""
    decoding: Sequence[str] = DECODINGS
    "greedy (temperature 0, one completion: pass@1 = accuracy) and/or sampled (n per prompt)"
    n: int = 8
    "completions per prompt when sampled"
    k: Sequence[int] = ()
    "the k of pass@k when sampled (each <= n; default: 1, 2, 4, ... up to n, and n)"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: Sequence[str] = ()
    seed: int = 0
    "the sampler's seed (each sequence's random stream is a function of it, its prompt and occurrence)"
    threshold: float = 1.0
    "a completion passes when its reward >= threshold (an unscored one never passes)"
    pass_reward: Optional[str] = None
    "the reward function whose score decides passing (default: the weighted total)"
    batch_size: int = 64
    "prompts per sampler call"

    def ks(self) -> list[int]:
        if self.k:
            return sorted(set(int(k) for k in self.k))
        out, k = [], 1
        while k < self.n:
            out.append(k)
            k *= 2
        return out + [self.n]

    def record(self) -> dict:
        return {**asdict(self), "decoding": list(self.decoding), "k": self.ks(), "stop": list(self.stop)}


def check_settings(s: GenerationSettings, names: Sequence[str]) -> None:
    """ValueError (one line) for settings no run could satisfy; before anything is sampled."""
    bad = [d for d in s.decoding if d not in DECODINGS]
    if bad or not s.decoding:
        raise ValueError(f"decoding must be one or both of {', '.join(DECODINGS)}; got {list(s.decoding)}")
    if "sampled" in s.decoding and any(not 1 <= k <= s.n for k in s.ks()):
        raise ValueError(f"pass@k needs 1 <= k <= n (k of the n samples per prompt); got k={list(s.ks())}, n={s.n}")
    if s.pass_reward is not None and s.pass_reward not in names:
        raise ValueError(f"pass_reward {s.pass_reward!r} is not one of the reward functions ({', '.join(names)})")


def _decode(sampler, rows: list[dict], funcs, weights, s: GenerationSettings, greedy: bool):
    """Sample every prompt (n per prompt), score: (per-function [N, F], total [N], rollout pieces)."""
    n = 1 if greedy else s.n
    opts = dict(temperature=0.0 if greedy else s.temperature, top_p=s.top_p, top_k=s.top_k,
                max_new_tokens=s.max_new_tokens, stop=list(s.stop))
    prompt_ids = [r["prompt_ids"] for r in rows]
    per_fn, total, texts, lengths, finish = [], [], [], [], []
    for start in range(0, len(rows), s.batch_size):
        chunk = list(range(start, min(start + s.batch_size, len(rows))))
        # `only`: a chunk draws what one call over all prompts draws for them (the random streams
        # are keyed by prompt occurrence in the whole list), so batch_size never changes a result
        rollout = sampler.sample(prompt_ids, n=n, seed=s.seed, only=chunk, **opts)
        seq_rows = [rows[chunk[int(g)]] for g in rollout.group]
        f, t = score_rollout(funcs, weights, seq_rows, rollout, max_new_tokens=s.max_new_tokens)
        per_fn.append(f), total.append(t), texts.extend(rollout.texts)
        lengths.append(rollout.lengths.cpu()), finish.extend(rollout.finish_reasons)
    return torch.cat(per_fn), torch.cat(total), texts, torch.cat(lengths), finish


def evaluate_generation(sampler, rows: list[dict], funcs, weights: Sequence[float],
                        settings: GenerationSettings, names: Optional[Sequence[str]] = None
                        ) -> tuple[dict, list[dict]]:
    """Metrics `<decoding>/...` for each decoding in `settings`, and one record per completion.

    Metrics: pass@k for each k (greedy: pass@1 only), `reward` (mean weighted total over scored
    completions), `rewards/<fn>/mean` (each function's mean where it scored), `frac_unscored`
    (no function scored it: it never passes), `completions/mean_length` (tokens, EOS included),
    `completions/clipped_ratio` (cut at max_new_tokens), and the counts."""
    names = list(names or [fn_name(f) for f in funcs])
    check_settings(settings, names)
    which = None if settings.pass_reward is None else names.index(settings.pass_reward)
    metrics: dict = {}
    records: list[dict] = []
    for decoding in settings.decoding:
        greedy = decoding == "greedy"
        n = 1 if greedy else settings.n
        per_fn, total, texts, lengths, finish = _decode(sampler, rows, funcs, weights, settings, greedy)
        judged = total if which is None else per_fn[:, which]
        passed = (judged >= settings.threshold) & ~judged.isnan()  # NaN >= x is False anyway: explicit
        counts = [(n, int(passed[i * n:(i + 1) * n].sum())) for i in range(len(rows))]
        scored = ~total.isnan()
        out = {f"pass@{k}": mean_pass_at_k(counts, k) for k in ([1] if greedy else settings.ks())}
        out.update({"reward": float(total[scored].mean()) if scored.any() else float("nan"),
                    **{f"rewards/{name}/mean": float(per_fn[:, j].nanmean()) for j, name in enumerate(names)},
                    "frac_unscored": float((~scored).float().mean()),
                    "completions/mean_length": float(lengths.float().mean()),
                    "completions/clipped_ratio": sum(f == "length" for f in finish) / len(finish),
                    "prompts": len(rows), "completions": len(texts)})
        metrics.update({f"{decoding}/{k}": v for k, v in out.items()})
        for i, text in enumerate(texts):
            row = rows[i // n]
            records.append({"decoding": decoding, "prompt_index": i // n, "sample": i % n,
                            "prompt": row["prompt"], "completion": text,
                            "reward": None if not scored[i] else float(total[i]),
                            "rewards": {name: None if per_fn[i, j].isnan() else float(per_fn[i, j])
                                        for j, name in enumerate(names)},
                            "passed": bool(passed[i]), "length": int(lengths[i]), "finish_reason": finish[i]})
    return metrics, records
