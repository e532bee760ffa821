"""SFT part of bench/parity.py: GSM8K question -> answer as chat messages, completion-only loss."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from parity_common import (COMMON, _fixed_order, _Recorder, compare_tokens, gsm_rows_fitting, ids_only_masks_differ,
                           load_fp32, make_cfg, tether_common, tether_metrics, tether_order, trl_args, write_jsonl)


def run_sft(model: str, work: Path, steps: int, align: bool = True) -> dict:
    from transformers import AutoTokenizer
    from trl import SFTConfig as TRLSFTConfig, SFTTrainer
    from tether.trainers.sft import SFTConfig, train_sft
    from tether.trainers.sft import load_sft_data

    tok = AutoTokenizer.from_pretrained(model)
    n = steps * COMMON["batch"]
    rows = gsm_rows_fitting(n, tok, COMMON["max_length"])
    path = write_jsonl(rows, work / "sft.jsonl")
    cfgd = tether_common(model, path, str(work / "runs"), steps, "sft")
    cfgd["data"] = {"path": path, "max_length": COMMON["max_length"], "batch_size": COMMON["batch"]}
    cfgd["sft"] = {"completion_only": True}
    cfg = make_cfg(SFTConfig, cfgd)

    order = tether_order(len(rows), steps, COMMON["batch"], COMMON["seed"])
    from datasets import Dataset
    ds = Dataset.from_list(rows)
    rec = _Recorder()
    torch.manual_seed(COMMON["seed"])
    trainer = _fixed_order(SFTTrainer, order)(
        model=load_fp32(model), processing_class=tok, train_dataset=ds, callbacks=[rec.cb],
        args=trl_args(TRLSFTConfig, str(work / "trl_sft"), steps, completion_only_loss=True,
                      packing=False, padding_free=False, dataset_num_proc=None))
    ours_ex = load_sft_data(cfg, tok)[0]
    ours = [{"seqs": {"seq": list(ex["input_ids"])}, "masks": {"seq": [int(v) for v in ex["completion_mask"]]}}
            for ex in ours_ex]
    # TRL 1.16 keeps `labels` (-100 outside the completion); the first trained token is the
    # first label that is not -100
    theirs = [{"seqs": {"seq": list(r["input_ids"])}, "masks": {"seq": [int(v != -100) for v in r["labels"]]}}
              for r in trainer.train_dataset]
    tokens = compare_tokens("sft", ours, theirs)
    notes = []
    if ids_only_masks_differ(tokens) and align:
        # Same ids, different trained tokens (TRL also trains the template's "\n" after
        # <|im_end|>): train TRL on tether's mask, so the table compares the arithmetic. The
        # as-tokenized difference is measured by --as-tokenized and documented.
        masks = [o["masks"]["seq"] for o in ours]
        trainer.train_dataset = trainer.train_dataset.map(
            lambda r, i: {"labels": [t if m else -100 for t, m in zip(r["input_ids"], masks[i])]},
            with_indices=True)
        notes.append("TRL trained on tether's completion mask (see tokens.differing for the as-tokenized difference)")

    t0 = time.perf_counter()
    trainer.train()
    trl_time = time.perf_counter() - t0
    del trainer
    t0 = time.perf_counter()
    train_sft(cfg)
    ours_time = time.perf_counter() - t0
    return {"tokens": tokens, "tether": tether_metrics(str(work / "runs"), "sft"), "trl": rec.rows,
            "metrics": {"loss": "loss"}, "seconds": {"tether": ours_time, "trl": trl_time}, "notes": notes}

