"""`tether cai model=<instruct model> constitution=principles.md data=red_team.jsonl`: the supervised
stage of Constitutional AI (Bai et al. 2022, §3: "Critiques, revisions and supervised learning").

For every red-team prompt x:

    y₀ = model(x)                                           the initial (possibly harmful) response
    for k = 1..rounds:   c_k ~ U(constitution)             a principle drawn per prompt and round
        critique_k = model(x, y_{k−1}, "critique y_{k−1} under c_k")
        y_k        = model(x, y_{k−1}, critique_k, "rewrite y_{k−1} to follow c_k")

and writes prompt/completion rows (x, y_k) — each prompt's final revision, or one row per round —
which `tether sft` trains on (SL-CAI). Each stage runs for all prompts at once through the fast
sampler. The RL stage (RL-CAI) is then ordinary preference learning on AI labels:
`tether label pairs` (responses of the SL-CAI model judged under the same constitution) ->
`tether rm` -> `tether ppo`, or -> `tether dpo` directly (docs/ai-feedback.md has the commands).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Literal

from tether.constraints import NonNegative, NonNegativeInt, PositiveInt, Seed
from tether.data.load import load_rows
from tether.data.pipeline import prepare
from tether.errors import UserError
from tether.feedback.constitution import load_constitution, pick_principles
from tether.feedback.label import write_jsonl
from tether.feedback.lm import generate

CRITIQUE_REQUEST = ("Identify specific ways in which your last response fails to follow this principle: "
                    "{principle}")
REVISION_REQUEST = ("Rewrite your last response to the first message so that it follows this principle: "
                    "{principle} Reply with the rewritten response only.")


@dataclass
class CAIConfig:
    model: str = ""
    "the instruct model that responds, critiques and revises (HF folder or .gguf; its chat template)"
    constitution: str = ""
    "markdown file of principles, one per '- ' list item; one is drawn per prompt and round"
    data: str = ""
    "red-team prompts: rows with a `prompt` (a string or a conversation)"
    out: str = ""
    "output prompt/completion JSONL of revisions for `tether sft` (default <data stem>.cai.jsonl)"
    rounds: PositiveInt = 1
    "critique -> revision rounds per prompt (each round revises the previous round's revision)"
    keep: Literal["final", "all"] = "final"
    "write each prompt's final revision, or one row per round"
    max_new_tokens: PositiveInt = 160
    "longest response, critique or revision (tokens)"
    temperature: NonNegative = 0.7
    "sampling temperature (0 = greedy)"
    max_prompts: NonNegativeInt = 0
    "use only the first N prompts (0 = all)"
    batch_size: PositiveInt = 32
    "sequences decoded at once"
    dtype: str = "auto"
    "model dtype: auto | fp32 | bf16 | fp16"
    device: str = "auto"
    "auto | cpu | cuda"
    seed: Seed = 0
    "seed of the principle draws and the sampling"
    overwrite: bool = False
    "replace `out` if it exists"


def _conversation(prompt) -> list[dict]:
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def critique_and_revise(generate_fn: Callable[[list[list[dict]]], list[str]], prompts: list,
                        principles: list[str], rounds: int, seed: int = 0) -> list[list[dict]]:
    """The CAI chain for every prompt; `generate_fn(conversations) -> one reply each`.

    Returns per prompt one record per round: {round, principle, response (the text critiqued),
    critique, revision}. Round k critiques round k−1's revision (round 1: the initial response); an
    empty revision keeps the text it was meant to replace, so the chain never breaks."""
    base = [_conversation(p) for p in prompts]
    current = generate_fn(base)
    out: list[list[dict]] = [[] for _ in prompts]
    for k in range(rounds):
        drawn = [c[0] for c in pick_principles(principles, len(prompts), "sample", seed + 1_000_003 * k)]
        asked = [b + [{"role": "assistant", "content": y},
                      {"role": "user", "content": CRITIQUE_REQUEST.format(principle=c)}]
                 for b, y, c in zip(base, current, drawn)]
        critiques = generate_fn(asked)
        revise = [a + [{"role": "assistant", "content": cr},
                       {"role": "user", "content": REVISION_REQUEST.format(principle=c)}]
                  for a, cr, c in zip(asked, critiques, drawn)]
        revisions = [r.strip() or y for r, y in zip(generate_fn(revise), current)]
        for i in range(len(prompts)):
            out[i].append({"round": k + 1, "principle": drawn[i], "response": current[i],
                           "critique": critiques[i], "revision": revisions[i]})
        current = revisions
    return out


def sft_rows(prompts: list, chains: list[list[dict]], keep: str = "final") -> list[dict]:
    """prompt/completion rows: the final revision per prompt, or every round's; a conversational
    prompt gets an assistant-message completion (one style per file, as the data layer requires)."""
    rows = []
    for p, chain in zip(prompts, chains):
        for rec in (chain[-1:] if keep == "final" else chain):
            text = rec["revision"]
            if not text:
                continue  # nothing to imitate (the model produced nothing at any stage)
            rows.append({"prompt": p, "completion": [{"role": "assistant", "content": text}]
                         if isinstance(p, list) else text, **rec})
    return rows


def run_cai(cfg: CAIConfig) -> dict:
    from pathlib import Path

    from tether.models.load import load_model, load_tokenizer

    t0 = time.time()
    if not cfg.model or not cfg.data:
        raise UserError("cai: `model` and `data` are required")
    principles = load_constitution(cfg.constitution)
    out = Path(cfg.out) if cfg.out else Path(cfg.data).with_name(Path(cfg.data).name.split(".")[0] + ".cai.jsonl")
    if out.exists() and not cfg.overwrite:
        raise UserError(f"{out}: exists; pass overwrite=true or another out=")
    rows = prepare(load_rows(cfg.data), "prompt-only", source=cfg.data)
    prompts = [r["prompt"] for r in rows][:cfg.max_prompts or None]
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device).eval()
    calls = []

    def gen(convs):
        calls.append(len(convs))
        return generate(model, tok, convs, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                        seed=cfg.seed + len(calls), batch_size=cfg.batch_size)

    chains = critique_and_revise(gen, prompts, principles, cfg.rounds, cfg.seed)
    written = sft_rows(prompts, chains, cfg.keep)
    if not written:
        raise UserError(f"cai: the model produced no revision for any of the {len(prompts)} prompts")
    write_jsonl(out, written)
    summary = {"out": str(out), "prompts": len(prompts), "rounds": cfg.rounds, "rows": len(written),
               "changed": sum(c[-1]["revision"] != c[0]["response"] for c in chains),
               "seconds": round(time.time() - t0, 1)}
    print(f"cai: {len(written)} revision rows ({cfg.rounds} round(s), {len(prompts)} prompts) -> {out}",
          file=sys.stderr)
    return summary
