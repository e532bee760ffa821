"""DPO part of bench/parity.py: HH-RLHF pairs, sigmoid loss, beta 0.1, reference log-probs
precomputed on both sides."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from parity_common import (COMMON, _fixed_order, _Recorder, compare_tokens, load_fp32, make_cfg, mask_from,
                           pair_rows, tether_common, tether_metrics, tether_order, trl_args, write_jsonl)


DPO_METRICS = {"loss": "loss", "rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
               "rewards/margins": "rewards/margins", "rewards/accuracies": "rewards/accuracies",
               "logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected"}


def run_dpo(model: str, work: Path, steps: int, align: bool = True) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig as TRLDPOConfig, DPOTrainer
    from tether.trainers.preference.offline import DPOConfig, train_offline
    from tether.trainers.preference.data import load_offline_data

    tok = AutoTokenizer.from_pretrained(model)
    rows = pair_rows(steps * COMMON["batch"], tok, COMMON["max_length"])
    path = write_jsonl(rows, work / "pairs.jsonl")
    cfgd = tether_common(model, path, str(work / "runs"), steps, "dpo")
    cfgd["data"] = {"path": path, "max_length": COMMON["max_length"], "batch_size": COMMON["batch"]}
    cfgd["preference"] = {"method": "dpo", "loss": "sigmoid", "beta": 0.1}
    cfg = make_cfg(DPOConfig, cfgd)
    order = tether_order(len(rows), steps, COMMON["batch"], COMMON["seed"])
    notes, trl_rows, trl_order = [], rows, order
    if align:
        # TRL's precompute pass batches the dataset in its stored order, not in the training
        # sampler's; tether's runs the training batches themselves (preference.reference.training_forwards).
        # A row's log-prob depends on its batch's padding at the ~1e-7 level, so only when the
        # reference saw the same batch as the policy is step 1's log-ratio exactly 0. Giving TRL the
        # rows stored in training order (its sampler then 0..n-1: the same rows per step) makes
        # its precompute batches its training batches, as tether's are.
        assert sorted(order) == list(range(len(rows))), "one epoch: every row once"
        trl_rows, trl_order = [rows[i] for i in order], list(range(len(order)))
        notes.append("TRL's dataset stored in training order, so its reference precompute batches are its "
                     "training batches, as tether's are (--as-tokenized: dataset order)")
    rec = _Recorder()
    torch.manual_seed(COMMON["seed"])
    trainer = _fixed_order(DPOTrainer, trl_order)(
        model=load_fp32(model), processing_class=tok, train_dataset=Dataset.from_list(trl_rows), callbacks=[rec.cb],
        args=trl_args(TRLDPOConfig, str(work / "trl_dpo"), steps, beta=0.1, loss_type=["sigmoid"],
                      precompute_ref_log_probs=True, precompute_ref_batch_size=COMMON["batch"],
                      truncation_mode="keep_start", dataset_num_proc=None))
    ours_ex = load_offline_data(cfg, tok)[0]
    ours = [{"seqs": {s: list(ex["prompt_ids"]) + list(ex[f"{s}_ids"]) for s in ("chosen", "rejected")},
             "masks": {s: mask_from(list(ex["prompt_ids"]) + list(ex[f"{s}_ids"]), len(ex["prompt_ids"]))
                       for s in ("chosen", "rejected")}} for ex in ours_ex]
    ours = [ours[i] for i in order] if align else ours  # TRL's rows, in its dataset's order
    theirs = [{"seqs": {s: list(r["prompt_ids"]) + list(r[f"{s}_ids"]) for s in ("chosen", "rejected")},
               "masks": {s: mask_from(list(r["prompt_ids"]) + list(r[f"{s}_ids"]), len(r["prompt_ids"]))
                         for s in ("chosen", "rejected")}} for r in trainer.train_dataset]
    tokens = compare_tokens("dpo", ours, theirs)
    t0 = time.perf_counter()
    trainer.train()
    trl_time = time.perf_counter() - t0
    del trainer
    t0 = time.perf_counter()
    train_offline(cfg)
    ours_time = time.perf_counter() - t0
    return {"tokens": tokens, "tether": tether_metrics(str(work / "runs"), "dpo"), "trl": rec.rows,
            "metrics": DPO_METRICS, "seconds": {"tether": ours_time, "trl": trl_time}, "notes": notes}

