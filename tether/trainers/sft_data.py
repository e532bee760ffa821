"""SFT's data step: rows -> validated, tokenized examples + eval split + prompts to sample from."""

from __future__ import annotations

import random

from tether.data.collate import pad_batch
from tether.data.pipeline import load_data
from tether.data.tokenize import encode_sft

SFT_FORMATS = ("language-modeling", "prompt-completion")

__all__ = ["load_sft_data", "load_sft_split", "pad_batch", "sample_prompt"]


def sample_prompt(row: dict, tokenizer) -> str | None:
    """The text a model should continue for an eval sample of this row."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    messages = row.get("messages")
    if isinstance(messages, list):
        head = messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages
        return tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
    text = row.get("text")
    if isinstance(text, str):
        return text[: max(1, len(text) // 4)]  # continue the first quarter of a document
    return None


def load_sft_data(cfg, tokenizer):
    """Returns (train_examples, eval_examples, eval_prompts, report_dict); raises DataError.
    `cfg`: the SFT config (its `data` section, `sft.completion_only` and `run.seed`)."""
    return load_sft_split(cfg, tokenizer)[:4]


def load_sft_split(cfg, tokenizer):
    """:func:`load_sft_data` + the held-out rows as read (eval_data's, or those of the
    eval_fraction split; [] without either): their prompts are sampled for eval/greedy/..."""
    d, completion_only, seed = cfg.data, cfg.sft.completion_only, cfg.run.seed
    rows = load_data(d.path, expect=SFT_FORMATS, split=d.split, rename=d.columns)
    eval_rows = load_data(d.eval_data, expect=SFT_FORMATS, rename=d.columns) if d.eval_data else None
    train_ex, rep = encode_sft(rows, tokenizer, d.max_length, d.truncation,
                               completion_only_loss=completion_only)
    report = {"train": rep.summary(), "train_rows": rep.total, "truncated": rep.truncated,
              "dropped": rep.dropped}
    if eval_rows is not None:
        eval_ex, erep = encode_sft(eval_rows, tokenizer, d.max_length, d.truncation,
                                   completion_only_loss=completion_only)
        report["eval"] = erep.summary()
        prompt_rows = held_rows = list(eval_rows)
    elif d.eval_fraction > 0:
        # A seeded split of the *encoded* examples, so the eval set is the same on resume.
        order = list(range(len(train_ex)))
        random.Random(seed).shuffle(order)
        n_eval = max(1, int(len(order) * d.eval_fraction))
        held = set(order[:n_eval])
        eval_ex = [train_ex[i] for i in sorted(held)]
        train_ex = [ex for i, ex in enumerate(train_ex) if i not in held]
        # examples[j] came from rows[kept_index[j]] (rows can be dropped when tokenizing).
        prompt_rows = held_rows = [rows[rep.kept_index[i]] for i in sorted(held)]
    else:
        eval_ex, prompt_rows, held_rows = [], list(rows)[:64], []
    prompts = [p for p in (sample_prompt(r, tokenizer) for r in prompt_rows[:64]) if p]
    return train_ex, eval_ex, prompts, report, held_rows
