"""Reward-model part of bench/parity.py: HH-RLHF pairs, Bradley-Terry loss, both sides from one
SequenceClassification checkpoint (the same seeded score head)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from parity_common import (COMMON, _fixed_order, _Recorder, compare_tokens, load_fp32, make_cfg, mask_from,
                           pair_rows, rm_init_dir, tether_common, tether_metrics, tether_order, trl_args, write_jsonl)


RM_METRICS = {"loss": "loss", "accuracy": "accuracy", "margin": "margin"}


def run_rm(model: str, work: Path, steps: int, cache: Path, align: bool = True) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer
    from tether.trainers.rm import RMConfig, load_rm_data, train_rm

    init = str(rm_init_dir(Path(model), cache))
    tok = AutoTokenizer.from_pretrained(model)
    rows = pair_rows(steps * COMMON["batch"], tok, COMMON["max_length"])
    path = write_jsonl(rows, work / "rm_pairs.jsonl")
    cfgd = tether_common(init, path, str(work / "runs"), steps, "rm")
    cfgd["data"] = {"path": path, "max_length": COMMON["max_length"], "batch_size": COMMON["batch"],
                    "eval_fraction": 0.0}
    cfgd["rm"] = {"center": False, "center_rewards_coefficient": 0.0}
    cfg = make_cfg(RMConfig, cfgd)
    order = tether_order(len(rows), steps, COMMON["batch"], COMMON["seed"])
    rec = _Recorder()
    torch.manual_seed(COMMON["seed"])
    trl_tok, trl_model, notes = tok, load_fp32(init, AutoModelForSequenceClassification), []
    if align and tok.pad_token_id == tok.eos_token_id:
        # HF's SequenceClassification head reads the rightmost token that is not the pad id; with
        # pad == EOS (<|im_end|>) that is the token *before* the EOS every sequence ends with,
        # while tether reads the last attended token (the EOS). Padding TRL's batches with
        # another id that never occurs in the data makes both read the same position; the
        # sequences themselves are unchanged (checked below).
        trl_tok = AutoTokenizer.from_pretrained(model)
        trl_tok.pad_token = "<|endoftext|>"
        trl_model.config.pad_token_id = trl_tok.pad_token_id
        notes.append("TRL pads with <|endoftext|> (not <|im_end|> = EOS) so HF's head reads the EOS position "
                     "as tether does (--as-tokenized: the token before it)")
    trainer = _fixed_order(RewardTrainer, order)(
        model=trl_model, processing_class=trl_tok,
        train_dataset=Dataset.from_list(rows), callbacks=[rec.cb],
        args=trl_args(RewardConfig, str(work / "trl_rm"), steps, center_rewards_coefficient=None,
                      dataset_num_proc=None))
    ours_ex = load_rm_data(cfg, tok).train
    ours = [{"seqs": {s: list(ex[f"{s}_ids"]) for s in ("chosen", "rejected")},
             "masks": {s: mask_from(list(ex[f"{s}_ids"]), 0) for s in ("chosen", "rejected")}} for ex in ours_ex]
    theirs = [{"seqs": {s: list(r[f"{s}_ids"]) for s in ("chosen", "rejected")},
               "masks": {s: mask_from(list(r[f"{s}_ids"]), 0) for s in ("chosen", "rejected")}}
              for r in trainer.train_dataset]
    tokens = compare_tokens("rm", ours, theirs)
    t0 = time.perf_counter()
    trainer.train()
    trl_time = time.perf_counter() - t0
    del trainer
    t0 = time.perf_counter()
    train_rm(cfg)
    ours_time = time.perf_counter() - t0
    return {"tokens": tokens, "tether": tether_metrics(str(work / "runs"), "rm"), "trl": rec.rows,
            "metrics": RM_METRICS, "seconds": {"tether": ours_time, "trl": trl_time}, "notes": notes}

