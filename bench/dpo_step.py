"""Our DPO training step vs TRL's `DPOTrainer`: same model, same pairs, same lengths, one run.

    python bench/dpo_step.py                   # CPU: tiny model, 8 pairs × (32 prompt + 63 completion)
    python bench/dpo_step.py --device cuda     # GPU: random-init Qwen2.5-0.5B shape, 8 × (128 + 255), bf16

A step = forward of chosen + rejected (one concatenated batch), sigmoid DPO loss (β = 0.1), backward,
clip, AdamW step. Both sides: fp32 master weights, bf16 autocast on CUDA, no gradient checkpointing,
SDPA attention. Ours is `tether.trainers.offline.train_step` with the reference log-probs
precomputed (as `tether dpo` runs: the cache); TRL runs with its defaults (a reference model held
in memory and run every step) and, with --trl-precompute, also with precompute_ref_log_probs=True.
Every sequence is exactly prompt + completion tokens (random characters of a char tokenizer; TRL
tokenizes the same texts and appends EOS the same way), so no padding on either side.
Timed: the median of --steps warm steps after --warmup; tokens/s = 2·pairs·(prompt + completion) /
step time. Peak memory (CUDA only): the allocator's peak allocated and reserved bytes over the
warm steps (weights, gradients and AdamW state included). TRL runs only if `import trl` works.
Prints a markdown section and appends it to benchmarks/RESULTS.md (--results).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tether.models import char_tokenizer  # noqa: E402
from tether.trainers.common import autocast_context, make_optimizer, make_scheduler  # noqa: E402
from tether.trainers.offline import DPOConfig, train_step  # noqa: E402
from tether.trainers.offline_reference import reference_logps  # noqa: E402

QWEN05 = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
              rope_theta=1e6, max_position_embeddings=32768)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def build_model(kind: str, device: str, tok):
    torch.manual_seed(0)
    if kind == "tiny":
        from tether.models import make_tiny_model
        model, _ = make_tiny_model(None)  # Llama: hidden 128, 4 layers, 4 heads / 2 KV heads
        return model.to(device)
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(**QWEN05, bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # fp32 master weights
    return model


def make_pairs(tok, n: int, prompt_len: int, completion_len: int):
    """Texts (for TRL) and the identical token ids (for us): prompt_len tokens of prompt,
    completion_len tokens of response including the EOS both sides append."""
    rng = random.Random(0)
    text = lambda k: "".join(rng.choice(LETTERS) for _ in range(k))  # noqa: E731 — 1 char = 1 token
    rows = [{"prompt": text(prompt_len), "chosen": text(completion_len - 1),
             "rejected": text(completion_len - 1)} for _ in range(n)]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    examples = [{"prompt_ids": enc(r["prompt"]), "chosen_ids": enc(r["chosen"]) + [tok.eos_token_id],
                 "rejected_ids": enc(r["rejected"]) + [tok.eos_token_id], "idx": i}
                for i, r in enumerate(rows)]
    assert all(len(e["prompt_ids"]) == prompt_len and len(e["chosen_ids"]) == completion_len for e in examples)
    return rows, examples


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak(device):
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak(device):
    if device != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated() / 1e9, torch.cuda.max_memory_reserved() / 1e9


def bench_ours(model, tok, examples, device, warmup, steps):
    cfg = DPOConfig(model="bench", data="bench", beta=0.1, lr=1e-6, batch_size=len(examples))
    dev = torch.device(device)
    amp = autocast_context(dev, "auto")
    t = time.perf_counter()
    ref = reference_logps(model, {"train": examples}, {"train": True}, cfg, tok.pad_token_id, dev, amp)
    sync(device)
    ref_s = time.perf_counter() - t
    model.train()
    opt = make_optimizer(model, cfg.optim.lr, 0.0)
    sched = make_scheduler(opt, "constant", 0, warmup + steps)
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            reset_peak(device)
        sync(device)
        t = time.perf_counter()
        out = train_step(cfg, model, opt, sched, [examples], True, ref, tok.pad_token_id, dev, amp)
        sync(device)
        times.append(time.perf_counter() - t)
    alloc, reserved = peak(device)
    del opt, sched
    return {"step_s": statistics.median(times[warmup:]), "first_s": times[0], "peak_alloc_gb": alloc,
            "peak_reserved_gb": reserved, "ref_precompute_s": ref_s, "loss": out["loss"]}


def bench_trl(model, tok, rows, device, warmup, steps, max_length, precompute):
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    times, marks = [], {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warmup:
                reset_peak(device)
            sync(device)
            marks["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync(device)
            times.append(time.perf_counter() - marks["t"])

    with tempfile.TemporaryDirectory() as out_dir:
        args = trl.DPOConfig(
            output_dir=out_dir, per_device_train_batch_size=len(rows), max_length=max_length,
            learning_rate=1e-6, beta=0.1, loss_type=["sigmoid"], max_steps=warmup + steps,
            bf16=device == "cuda", use_cpu=device == "cpu", gradient_checkpointing=False,
            logging_steps=10**6, save_strategy="no", report_to=[], dataloader_num_workers=0,
            precompute_ref_log_probs=precompute, lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=1.0, seed=0)
        ref = None if precompute else copy.deepcopy(model).eval().requires_grad_(False)
        trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args, processing_class=tok,
                                 train_dataset=Dataset.from_list(rows), callbacks=[Clock()])
        trainer.train()
        alloc, reserved = peak(device)
        del trainer, ref
    return {"step_s": statistics.median(times[warmup:]), "first_s": times[0], "peak_alloc_gb": alloc,
            "peak_reserved_gb": reserved, "version": trl.__version__}


def free(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="tiny | qwen0.5b (default: tiny on CPU, qwen0.5b on CUDA)")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--completion-len", type=int, default=None, help="response tokens including EOS")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--trl-precompute", action="store_true",
                    help="also run TRL with precompute_ref_log_probs=True (no reference model held)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 on CPU)")
    ap.add_argument("--results", default=str(Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    ap.add_argument("--full-logits", action="store_true", help="also time ours with the HF forward's full logits")
    args = ap.parse_args(argv)
    dev = args.device
    kind = args.model or ("qwen0.5b" if dev == "cuda" else "tiny")
    P = args.prompt_len or (128 if dev == "cuda" else 32)
    C = args.completion_len or (255 if dev == "cuda" else 63)
    warmup = args.warmup if args.warmup is not None else (3 if dev == "cuda" else 2)
    steps = args.steps or (10 if dev == "cuda" else 5)
    if args.threads or dev == "cpu":
        torch.set_num_threads(args.threads or 1)
    tok = char_tokenizer()
    rows, examples = make_pairs(tok, args.pairs, P, C)
    tokens = 2 * args.pairs * (P + C)

    results = {}
    model = build_model(kind, dev, tok)
    results["ours"] = bench_ours(model, tok, examples, dev, warmup, steps)
    print("ours:", json.dumps(results["ours"]), flush=True)
    del model
    free(dev)
    if args.full_logits:  # A/B: the HF forward's [B, T, V] logits instead of our chunked LM head
        from tether.models import logprobs as common
        split, common._split_head = common._split_head, (lambda m: None)
        model = build_model(kind, dev, tok)
        results["ours (full logits)"] = bench_ours(model, tok, examples, dev, warmup, steps)
        common._split_head = split
        print("ours (full logits):", json.dumps(results["ours (full logits)"]), flush=True)
        del model
        free(dev)
    trl_note = None
    if args.skip_trl:
        trl_note = "TRL skipped (--skip-trl)."
    else:
        try:
            import trl  # noqa: F401
        except ImportError:
            trl_note = "TRL not installed here (`import trl` failed): ours alone."
    if trl_note is None:
        variants = [("trl", False)] + ([("trl (precomputed ref)", True)] if args.trl_precompute else [])
        for name, pre in variants:
            model = build_model(kind, dev, tok)
            results[name] = bench_trl(model, tok, rows, dev, warmup, steps, P + C, pre)
            print(f"{name}:", json.dumps(results[name]), flush=True)
            del model
            free(dev)
    for r in results.values():
        r["tokens_per_s"] = tokens / r["step_s"]
    section = render(results, kind, args.pairs, P, C, dev, warmup, steps, trl_note)
    print(section)
    with open(args.results, "a") as f:
        f.write(section + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def render(results, kind, pairs, P, C, dev, warmup, steps, trl_note) -> str:
    cmd = ("python bench/dpo_step.py " + " ".join(sys.argv[1:])).strip()
    prec = "fp32 weights + bf16 autocast" if dev == "cuda" else "fp32"
    lines = [f"## dpo_step: ours vs TRL DPOTrainer — {kind}, {pairs} pairs × ({P} prompt + {C} completion) tokens",
             "", f"Card: {device_name(dev)}. Date: {datetime.date.today().isoformat()}. torch {torch.__version__}, "
             f"transformers {__import__('transformers').__version__}"
             + (f", trl {results['trl']['version']}" if "trl" in results else "")
             + f". {prec}, no gradient checkpointing. Median of {steps} steps after {warmup} warm-up. "
             f"Command: `{cmd}`", "",
             "| trainer | step (s) | tokens/s | first step (s) | peak alloc (GB) | peak reserved (GB) | speed-up |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = results.get("trl")
    for name, r in results.items():
        up = f"{base['step_s'] / r['step_s']:.2f}×" if base and name.startswith("ours") else ""
        gb = lambda v: f"{v:.2f}" if v is not None else "—"  # noqa: E731
        lines.append(f"| {name} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['first_s']:.2f} | "
                     f"{gb(r['peak_alloc_gb'])} | {gb(r['peak_reserved_gb'])} | {up} |")
    notes = [f"- ours: reference log-probs precomputed once ({results['ours']['ref_precompute_s']:.2f} s for "
             f"{pairs} pairs, not in the step time), as `tether dpo` does; TRL default holds a reference "
             "model and runs it every step."]
    if trl_note:
        notes.append(f"- {trl_note}")
    return "\n".join(lines + [""] + notes + [""])


if __name__ == "__main__":
    main()
