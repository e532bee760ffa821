"""The offline trainer's data step (docs/dpo.md): rows -> examples, and their collation.

Preference rows (`prompt`, `chosen`, `rejected`, or implicit-prompt `chosen`/`rejected`)
for DPO / SimPO / ORPO; KTO also takes unpaired rows (`prompt`, `completion`, `label`) and turns
preference rows into two unpaired ones (chosen → desirable, rejected → undesirable), as TRL does.
Examples are token lists; `idx` is an example's position in its split, the key into the
reference cache (reference.py).
"""

from __future__ import annotations

import random

from tether.data import (collate_sequences, encode_preference, encode_unpaired, join_prompt_response,
                         load_data)
from tether.errors import UserError

KL_PAIRING_SEED = 0  # fixed: the mismatched pairs are part of the cached numbers


# ---- rows -> examples -----------------------------------------------------------------------------

def to_unpaired(pairs: list[dict]) -> list[dict]:
    """Each pair → (prompt, chosen, desirable) and (prompt, rejected, undesirable)."""
    out = []
    for ex in pairs:
        out.append({"prompt_ids": ex["prompt_ids"], "completion_ids": ex["chosen_ids"], "label": True})
        out.append({"prompt_ids": ex["prompt_ids"], "completion_ids": ex["rejected_ids"], "label": False})
    return out


def _encode(data, source: str, split: str | None, unpaired_ok: bool, tokenizer):
    expect = ("preference", "unpaired-preference") if unpaired_ok else "preference"
    rows = load_data(source, expect=expect, split=split, rename=data.columns)
    enc = encode_unpaired if rows.format == "unpaired-preference" else encode_preference
    examples, rep = enc(rows, tokenizer, data.max_length, data.truncation,
                        max_prompt_length=data.max_prompt_length, source=source)
    if rows.format == "unpaired-preference":
        for ex in examples:
            if not isinstance(ex["label"], bool):
                raise UserError(f"{source}: `label` must be true/false, got {ex['label']!r}")
    return examples, rep, rows.format == "preference"


def _index(examples: list[dict]) -> list[dict]:
    for i, ex in enumerate(examples):
        ex["idx"] = i
    return examples


def load_offline_data(cfg, tokenizer):
    """Returns (train, eval, train_paired, eval_paired, report). KTO trains on unpaired examples
    (converted from pairs when given pairs); a held-out split of pairs stays paired, so its
    implicit-reward accuracy means the same thing for every method."""
    data, method = cfg.data, cfg.preference.method
    kto = method == "kto"
    train, rep, paired = _encode(data, data.path, data.split, kto, tokenizer)
    report = {"train": rep.summary(), "train_rows": rep.total, "truncated": rep.truncated,
              "dropped": rep.dropped}
    if data.eval_data:
        eval_ex, erep, eval_paired = _encode(data, data.eval_data, None, kto, tokenizer)
        report.update({"eval": erep.summary(), "eval_truncated": erep.truncated,
                       "eval_dropped": erep.dropped})
    elif data.eval_fraction > 0:
        # Seeded split of the encoded examples: the same held-out set on resume.
        order = list(range(len(train)))
        random.Random(cfg.run.seed).shuffle(order)
        held = set(order[:max(1, int(len(order) * data.eval_fraction))])
        eval_ex = [train[i] for i in sorted(held)]
        train = [ex for i, ex in enumerate(train) if i not in held]
        eval_paired = paired
    else:
        eval_ex, eval_paired = [], paired
    if kto and paired:
        train, paired = to_unpaired(train), False
    if not train:
        raise UserError(f"{method}: no training examples left in {data.path}")
    if not paired and not kto:
        raise UserError(f"{method} needs preference pairs (prompt, chosen, rejected)")
    return _index(train), _index(eval_ex), paired, eval_paired, report


# ---- collation ----------------------------------------------------------------------------------

def kl_partners(n: int, seed: int = KL_PAIRING_SEED) -> list[int]:
    """A fixed derangement: example i's prompt is paired with example partner[i]'s completion
    (never its own) to estimate KTO's reference point. Deterministic, so it can be cached."""
    if n < 2:
        return [0] * n
    order = list(range(n))
    random.Random(seed).shuffle(order)
    partner = [0] * n
    for k, i in enumerate(order):
        partner[i] = order[(k + 1) % n]  # next in a random cycle: a derangement
    return partner


def collate(examples: list[dict], paired: bool, pad_id: int, packing: str = "") -> dict:
    """One batch; pairs are [chosen sequences; rejected sequences] (one forward for both).
    Right-padded rows, or packed (`packing`: tether.data.collate_sequences; data.packing)."""
    if paired:
        seqs = [join_prompt_response(ex["prompt_ids"], ex["chosen_ids"]) for ex in examples]
        seqs += [join_prompt_response(ex["prompt_ids"], ex["rejected_ids"]) for ex in examples]
    else:
        seqs = [join_prompt_response(ex["prompt_ids"], ex["completion_ids"]) for ex in examples]
    return collate_sequences(seqs, pad_id, packing)


def collate_mismatched(examples: list[dict], pool: list[dict], partners: list[int], pad_id: int,
                       max_length: int | None, packing: str = "") -> dict:
    """KTO's KL batch: prompt of each example + its partner's completion, cut to max_length."""
    seqs = []
    for ex in examples:
        p, c = ex["prompt_ids"], pool[partners[ex["idx"]]]["completion_ids"]
        if max_length is not None:
            c = c[:max(1, max_length - len(p))]
        seqs.append(join_prompt_response(p, c))
    return collate_sequences(seqs, pad_id, packing)
