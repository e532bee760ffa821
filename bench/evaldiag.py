"""Diagnosis of the interleaved placement's wrong eval points (RESULTS.md, sessions 15-16): one GRPO
run on the real model with every eval point scored four ways, and the model in memory compared with
itself saved and reloaded.

    python bench/evaldiag.py --model /tmp/smollm2 --data /tmp/arith --out /tmp/diag [--set k=v ...]

At each eval point (HeldOut.evaluate patched): `logged` (what the run logs), `fresh` (a new Sampler
over the same model object), `copy` (a deepcopy of the model, fp32), `bf16` (that copy in bf16), `disk` (save_pretrained, then
from_pretrained as `tether eval` loads it), plus the tie of the LM head to the embeddings and the
largest differences between the model in memory and the reloaded one (parameters and buffers).
Writes one JSON line per eval point to stdout and <out>/diag.jsonl.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch
import yaml


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg: dict = {}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from real_model_rl import recipe  # the runs of bench/gpu_session15.sh evalbug: lr1e5_g16
    sets = {**recipe("lr1e5_g16", []), "model.path": a.model, "data.path": f"{a.data}/train.jsonl", "data.eval_data": f"{a.data}/heldout.jsonl",
            "reward.eval_reward_funcs": ["math"],
            "run.name": "run", "run.runs_dir": str(out), "run.seed": 0, "run.eval_every": a.eval_every,
            "run.progress": False, "run.overwrite": True, "run.log_every": 1, "optim.max_steps": a.steps,
            "queue.placement": "interleaved", "queue.max_staleness": 4, "rollout.sampler_copy": True}
    for kv in a.set:
        k, v = kv.split("=", 1)
        sets[k] = yaml.safe_load(v)
    for k, v in sets.items():
        sec, key = k.split(".", 1)
        cfg.setdefault(sec, {})[key] = v
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))

    from transformers import AutoModelForCausalLM

    from tether.cli import main as cli_main
    from tether.trainers import held_out

    real = held_out.HeldOut.evaluate
    log = open(out / "diag.jsonl", "w")

    def pass1(m):
        return m.get("eval/greedy/pass@1")

    def diag(self, model, tokenizer, sampler=None):
        logged = real(self, model, tokenizer, sampler)
        row = {"logged": pass1(logged), "logged_len": logged.get("eval/greedy/completions/mean_length")}
        keep = self.sampler
        self.sampler = None
        row["fresh"] = pass1(real(self, model, tokenizer, None))
        self.sampler = None
        twin = copy.deepcopy(model)
        row["copy"] = pass1(real(self, twin, tokenizer, None))
        self.sampler = None
        twin.to(torch.bfloat16)  # the weights rounded to bf16, as a bf16 checkpoint holds them
        row["bf16"] = pass1(real(self, twin, tokenizer, None))
        self.sampler = None
        del twin
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            disk = AutoModelForCausalLM.from_pretrained(tmp, dtype=next(model.parameters()).dtype).to(
                next(model.parameters()).device)
        row["disk"] = pass1(real(self, disk, tokenizer, None))
        self.sampler = keep
        m = getattr(model, "_orig_mod", model)
        emb, head = m.get_input_embeddings().weight, m.get_output_embeddings().weight
        row["tied_ptr"] = emb.data_ptr() == head.data_ptr()
        row["head_minus_emb"] = float((emb.float() - head.float()).abs().max())
        ours = {**dict(m.named_parameters(remove_duplicate=False)), **dict(m.named_buffers(remove_duplicate=False))}
        theirs = {**dict(disk.named_parameters(remove_duplicate=False)), **dict(disk.named_buffers(remove_duplicate=False))}
        diffs = []
        for name, v in theirs.items():
            if name not in ours:
                diffs.append((name, "missing in memory"))
                continue
            w = ours[name]
            if w.shape != v.shape:
                diffs.append((name, f"shape {tuple(w.shape)} vs {tuple(v.shape)}"))
                continue
            d = float((w.detach().float() - v.detach().float()).abs().max())
            if d > 0:
                diffs.append((name, d, str(w.dtype), str(v.dtype)))
        row["diffs"] = sorted(diffs, key=lambda x: -x[1] if isinstance(x[1], float) else 0)[:8]
        row["n_diffs"] = len(diffs)
        row["training_mode"] = model.training
        del disk
        print("DIAG", json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()
        return logged

    held_out.HeldOut.evaluate = diag
    sys.exit(cli_main(["grpo", "--config", str(out / "config.yaml")]))


if __name__ == "__main__":
    main()
