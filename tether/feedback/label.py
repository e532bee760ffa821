"""`tether label pairs judge=<instruct model> constitution=principles.md data=pairs.jsonl`: AI feedback
as preference data (RLAIF, Lee et al. 2023; the feedback model of Constitutional AI, Bai et al. 2022).

    read the constitution and the pairs (bad input: one line naming file, row and field)
    -> [prompt-only data: sample two responses per prompt from `policy` with the fast sampler]
    -> per pair: its principles (one sampled, or all)
    -> the judge reads every pair in both orders: P(A) from the answer tokens' log-probs, one
       forward per batch ([cot: a rationale sampled first, the answer read after it])
    -> P̂ = swap-debiased probability; chosen = the response with P̂ ≥ ½
    -> `out`: TRL preference JSONL (prompt, chosen, rejected, judge_prob, ...) that `tether rm`,
       `tether dpo` and the rest of the offline family read as is; `<out stem>.summary.json`:
       the raw position bias, order consistency and, for relabelled preference data, the agreement
       with its labels before and after debiasing.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from tether.constraints import NonNegative, NonNegativeInt, Positive, PositiveInt, Seed
from tether.data.errors import DataError, show
from tether.data.load import load_rows
from tether.data.pipeline import prepare
from tether.errors import UserError
from tether.feedback.constitution import load_constitution, pick_principles
from tether.feedback.judge import LMJudge, choose, judge_pairs, preference_rows
from tether.feedback.lm import generate


@dataclass
class LabelPairsConfig:
    judge: str = ""
    "the judge: an HF instruct model folder or a .gguf file (its chat template renders the judge prompt)"
    constitution: str = ""
    "markdown file of principles, one per '- ' list item"
    data: str = ""
    "pairs: prompt + completions (two responses); or preference rows (prompt/chosen/rejected, or HH-style chosen/rejected) to relabel; or prompt-only rows with policy="
    out: str = ""
    "output preference JSONL (default: <data stem>.judged.jsonl next to the data); a summary goes to <out stem>.summary.json"
    principles: Literal["sample", "all"] = "sample"
    "one principle drawn per pair (Constitutional AI) or all of them in every judgment"
    cot: bool = False
    "chain-of-thought judging: sample a rationale first, then read the answer after it"
    cot_max_new_tokens: PositiveInt = 96
    "longest rationale (tokens)"
    cot_temperature: NonNegative = 0.7
    "temperature of the rationale (0 = greedy)"
    policy: str = ""
    "for prompt-only data: the model whose two sampled responses per prompt are judged"
    policy_max_new_tokens: PositiveInt = 128
    "longest sampled response (tokens)"
    policy_temperature: Positive = 1.0
    "temperature of the sampled responses"
    max_pairs: NonNegativeInt = 0
    "judge only the first N rows (0 = all)"
    max_chars: NonNegativeInt = 1500
    "longer conversations and responses are shown by their last N characters (0 = whole)"
    batch_size: PositiveInt = 8
    "contexts per judge forward"
    dtype: str = "auto"
    "model dtype: auto | fp32 | bf16 | fp16"
    device: str = "auto"
    "auto | cpu | cuda"
    seed: Seed = 0
    "seed of the principle draws, rationales and sampled responses"
    overwrite: bool = False
    "replace `out` if it exists"


@dataclass
class PairData:
    prompts: list
    first: list
    second: list
    labelled: bool  # first = the data's chosen response (agreement with it is reported)
    source: str


def _check_completions(value, src: str, n: int) -> None:
    if not isinstance(value, list) or len(value) != 2:
        raise DataError(src, n, "completions", f"expected a list of exactly two responses, got {show(value)}")
    for i, c in enumerate(value):
        if not (isinstance(c, str) and c.strip()) and not (isinstance(c, list) and c):
            raise DataError(src, n, f"completions[{i}]", f"expected a non-empty response, got {show(c)}")


def read_pairs(source: str, max_pairs: int = 0) -> tuple[PairData | None, list | None]:
    """(pairs, None) for data holding two responses per prompt; (None, prompts) for prompt-only rows."""
    rows = load_rows(source)
    cols = set(rows.columns)
    if "chosen" in cols or "rejected" in cols:
        rows = prepare(rows, "preference", source=source)  # HH-style implicit prompts extracted
        rows = list(rows)[:max_pairs or None]
        return PairData([r["prompt"] for r in rows], [r["chosen"] for r in rows],
                        [r["rejected"] for r in rows], True, source), None
    rows = prepare(rows, "prompt-only", source=source)
    numbered = list(rows.numbered())[:max_pairs or None]
    if "completions" in cols:
        for n, r in numbered:
            _check_completions(r.get("completions"), source, n)
        return PairData([r["prompt"] for _, r in numbered], [r["completions"][0] for _, r in numbered],
                        [r["completions"][1] for _, r in numbered], False, source), None
    return None, [r["prompt"] for _, r in numbered]


def sample_pairs(policy, tokenizer, prompts: list, cfg: LabelPairsConfig) -> tuple[PairData, int]:
    """Two sampled responses per prompt; pairs with an empty response are dropped (counted)."""
    convs = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
    texts = generate(policy, tokenizer, [c for c in convs for _ in range(2)],
                     max_new_tokens=cfg.policy_max_new_tokens, temperature=cfg.policy_temperature,
                     seed=cfg.seed, batch_size=64)
    keep = [(p, a, b) for p, a, b in zip(prompts, texts[0::2], texts[1::2]) if a and b]

    def styled(p, t):  # a conversational prompt keeps conversational responses (one style per file)
        return [{"role": "assistant", "content": t}] if isinstance(p, list) else t
    return PairData([p for p, _, _ in keep], [styled(p, a) for p, a, _ in keep],
                    [styled(p, b) for p, _, b in keep], False, "<sampled>"), len(prompts) - len(keep)


def default_out(cfg: LabelPairsConfig) -> Path:
    if cfg.out:
        return Path(cfg.out)
    name = Path(cfg.data).name.split(".")[0] or "pairs"
    return Path(cfg.data).with_name(f"{name}.judged.jsonl")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tmp.replace(path)


def label_pairs(cfg: LabelPairsConfig) -> dict:
    from tether.models.load import load_model, load_tokenizer

    t0 = time.time()
    if not cfg.judge:
        raise UserError("label pairs: `judge` is required (an HF instruct model folder or a .gguf file)")
    if not cfg.data:
        raise UserError("label pairs: `data` is required")
    principles = load_constitution(cfg.constitution)  # every input is checked before a model loads
    out = default_out(cfg)
    if out.exists() and not cfg.overwrite:
        raise UserError(f"{out}: exists; pass overwrite=true or another out=")
    pairs, prompts = read_pairs(cfg.data, cfg.max_pairs)
    if pairs is None and not cfg.policy:
        raise UserError(f"{cfg.data}: prompt-only rows need policy=<model> to sample two responses per "
                        f"prompt (or give `completions` with two responses, or chosen/rejected)")
    dropped = 0
    if pairs is None:
        ptok = load_tokenizer(cfg.policy)
        policy = load_model(cfg.policy, dtype=cfg.dtype, device=cfg.device).eval()
        pairs, dropped = sample_pairs(policy, ptok, prompts, cfg)
        del policy
    if not pairs.prompts:
        raise UserError(f"{cfg.data}: no pairs to judge")
    tok = load_tokenizer(cfg.judge)
    model = load_model(cfg.judge, dtype=cfg.dtype, device=cfg.device).eval()
    judge = LMJudge(model, tok, cot=cfg.cot, cot_max_new_tokens=cfg.cot_max_new_tokens,
                    cot_temperature=cfg.cot_temperature, seed=cfg.seed, batch_size=cfg.batch_size,
                    max_chars=cfg.max_chars)
    shown = pick_principles(principles, len(pairs.prompts), cfg.principles, cfg.seed)
    t1 = time.time()
    j = judge_pairs(judge, pairs.prompts, pairs.first, pairs.second, shown)
    judge_s = time.time() - t1
    picks = choose(j.p, "argmax", cfg.seed)
    extra = None
    if cfg.cot:
        n = len(pairs.prompts)
        extra = [{"rationale_first": judge.rationales[i], "rationale_second": judge.rationales[n + i]}
                 for i in range(n)]
    rows = preference_rows(pairs.prompts, pairs.first, pairs.second, j, picks, shown, extra)
    write_jsonl(out, rows)
    summary = {"out": str(out), "data": cfg.data, "judge": cfg.judge, "principles": cfg.principles,
               "cot": cfg.cot, "n_principles": len(principles), "dropped_empty": dropped,
               **j.stats(), "judge_seconds": round(judge_s, 2), "seconds": round(time.time() - t0, 2)}
    if pairs.labelled:  # the data's chosen is y₁: agreement of the judge with those labels
        summary.update(agreement_stats(j.p_ab, j.p_ba, j.p))
    (out.with_name(out.name.split(".")[0] + ".summary.json")).write_text(json.dumps(summary, indent=1) + "\n")
    msg = (f"label pairs: {len(rows)} pairs -> {out}; raw position bias P(A) = {summary['position_bias']:.3f}, "
           f"order-consistent {summary['order_consistency']:.3f}")
    if pairs.labelled:
        msg += (f"; agreement with the data's labels: raw {summary['agreement_raw']:.3f}, "
                f"debiased {summary['agreement_debiased']:.3f}")
    print(msg, file=sys.stderr)
    return summary


def agreement_stats(p_ab, p_ba, p) -> dict:
    """Agreement with labels when y₁ is the labelled-chosen response. raw: a single judgment's
    argmax, averaged over the two orders (each order is one way of asking once); debiased: the
    swap-averaged verdict; exact ties (P = ½) count half."""
    def right(x):
        return np.where(x == 0.5, 0.5, (x > 0.5).astype(float))
    return {"agreement_raw": float(np.concatenate([right(p_ab), right(1 - p_ba)]).mean()),
            "agreement_debiased": float(right(p).mean()),
            "agreement_raw_first_shown": float(right(p_ab).mean()),
            "agreement_raw_second_shown": float(right(1 - p_ba).mean()),
            "mean_prob_of_labelled": float(np.mean(p))}
