"""One GRPO step, ours (`tether grpo`) vs TRL's `GRPOTrainer`: same model, same prompts, same config.

    python bench/grpo_step.py                   # CPU: tiny Qwen2 model, 2 prompts x 4 generations x 16 tokens
    python bench/grpo_step.py --device cuda     # GPU: random-init Qwen2.5-0.5B shape, 8 x 8, 128 + 256 tokens

The benchmark row (one GPU, TRL 1.16 installed; bench/gpu.sh grpo runs it):

    python bench/grpo_step.py --device cuda --ours-micro-batches 16c,32ch
        # ours compiled at micro-batch 16, and 32 with the saved activations in host memory
        # (model.offload_activations), vs TRL at micro-batch 8
    python bench/grpo_step.py --device cuda --ours-micro-batches 16co,16c,32co,32c --skip-trl
        # A/B: the layers' checkpoint around their compiled call (o) against inside it (the default)
    python bench/grpo_step.py --device cuda --ours-micro-batches 16c,32c --skip-trl --compile-options mode=reduce-overhead
        # A/B: the compiled layers in CUDA graphs (the update is launch-bound); dynamic=sequence or
        # dynamic=False: the layers' other compile modes (models/load.compile_layers)
    python bench/grpo_step.py --device cuda --ours-micro-batches 16c --skip-trl --inductor cpp_wrapper=True
        # A/B: Inductor's C++ wrapper (launches from C++, not from the generated Python)

A step = sample `generations` completions of each of `prompts` prompts, score them, one optimizer
update (token-mean loss: ours `loss_agg=token-mean`, TRL `loss_type="dapo"`; group-std advantages;
β = 0 so no reference model on either side; micro-batches of `--micro-batch` sequences, TRL as
per_device_train_batch_size with gradient_accumulation_steps = prompts·generations / micro-batch,
which makes it generate the whole batch once per optimizer step). Weights are bf16 on CUDA on both
sides (TRL with `bf16=True`), fp32 on CPU.

Lengths are forced equal: the tokenizer's EOS is an id outside the model's vocabulary, so it is
never sampled and every completion runs to --new-tokens on both sides (checked from the logged
mean lengths). Prompts are --prompt-len random word-level tokens ("<123> <9> ..."), no BOS.
Timing: wall time of each optimizer step (TRL: on_step_begin -> on_step_end, CUDA-synchronized;
ours: `step_time` from metrics.jsonl, measured the same way around the whole step), median over
the steps after --warmup. Peak memory (CUDA) is the allocator's peak *reserved* bytes over the whole
training call (model already on the GPU for TRL; loaded inside the call for ours), cache emptied
first. Prints a markdown section (--results FILE also appends it there).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import QWEN05, device_name  # noqa: E402

TINY = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True, rope_theta=1e6,
            max_position_embeddings=4096)


def build(kind: str, out: Path) -> int:
    """Save a random-init Qwen2 model (bf16 for qwen0.5b) and a word-level tokenizer over its
    vocabulary ("<0>" ... "<V-1>", plus an EOS outside it) to `out`; returns the vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    shape = QWEN05 if kind == "qwen0.5b" else TINY
    V = shape["vocab_size"]
    cfg = Qwen2Config(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if kind == "qwen0.5b" else torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    # "<i>", not "ti": special tokens are matched as substrings first, and "t1" is inside "t15"
    vocab = {f"<{i}>": i for i in range(V)}
    vocab["<eos>"] = V  # never sampled: the model has V logits
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<1>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<0>", unk_token="<1>")
    fast.model_max_length = 1 << 20
    fast.save_pretrained(out)
    return V


def make_prompts(n: int, length: int, vocab: int) -> list[str]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, vocab, (n, length), generator=g)
    return [" ".join(f"<{i}>" for i in row.tolist()) for row in ids]


def reward(completions, **_):
    """Cheap and varied (so advantages are non-zero): the completion's text length mod 7."""
    return [float(len(c) % 7) for c in completions]


def reset_peak(device):
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device):
    return torch.cuda.max_memory_reserved() / 1e9 if device == "cuda" else None


def peak_alloc_gb(device):
    return torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None


def load_tok(model_dir: Path):
    """The word-level tokenizer itself: AutoTokenizer would see model_type qwen2 in config.json and
    rebuild it as a (byte-level BPE) Qwen2Tokenizer, which cannot encode "<123>"."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tok.padding_side = "right"
    return tok


def compile_options(text: str) -> dict:
    """'mode=reduce-overhead,dynamic=False' -> {'mode': 'reduce-overhead', 'dynamic': False}."""
    words = {"True": True, "False": False, "None": None}
    return {k: words.get(v, v) for k, v in (item.split("=", 1) for item in text.split(",") if item)}


def run_ours(a, model_dir: Path, prompts: list[str], work: Path, micro_batch: int, full_logits=False,
             compile=False, checkpoint_outside=False, offload_activations=False, head_chunk=None) -> dict:
    import functools

    from tether.models import load
    from tether.models import logprobs as common
    from tether.trainers.core import setup
    from tether.trainers.grpo import GRPOConfig, train_grpo

    split, tokenizer, chunk = common._split_head, setup.load_tokenizer, common.HEAD_CHUNK_ELEMENTS
    common.HEAD_CHUNK_ELEMENTS = head_chunk or chunk  # A/B: logits held at once by the chunked head
    compile_layers = setup.compile_layers
    if full_logits:  # A/B: the HF forward's [B, T, V] logits instead of our chunked LM head
        common._split_head = lambda model: None
    if getattr(a, "compile_options", None):  # A/B: the compiled layers' torch.compile options
        setup.compile_layers = functools.partial(compile_layers, **compile_options(a.compile_options))

    checkpoint_inside = load.checkpoint_inside
    if checkpoint_outside:  # A/B: the layer's own checkpoint around the compiled call (transformers 5.17's)
        load.checkpoint_inside = lambda layer: False
    setup.load_tokenizer = lambda path, **_: load_tok(model_dir)  # see load_tok (every trainer's tokenizer loads in setup)

    work.mkdir(parents=True, exist_ok=True)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    cfg = GRPOConfig(model=str(model_dir), data=str(data), name="ours", runs_dir=str(work / "runs"),
                     batch_size=a.prompts, num_generations=a.generations, max_new_tokens=a.new_tokens,
                     max_prompt_length=a.prompt_len, max_steps=a.warmup + a.steps, lr=1e-6,
                     loss_agg="token-mean", advantage="grpo", beta=0.0, temperature=1.0,
                     micro_batch_size=micro_batch, dtype="bf16" if a.device == "cuda" else "fp32",
                     gradient_checkpointing=a.grad_ckpt == "on", compile=compile,
                     offload_activations=offload_activations,
                     device=a.device, progress=False, log_entropy=True, keep_last=1, seed=0)
    reset_peak(a.device)
    t0 = time.perf_counter()
    try:
        with torch._inductor.config.patch(compile_options(getattr(a, "inductor", None) or "")):
            train_grpo(cfg, reward_funcs=[reward])
    finally:
        common._split_head, setup.load_tokenizer, common.HEAD_CHUNK_ELEMENTS = split, tokenizer, chunk
        setup.compile_layers, load.checkpoint_inside = compile_layers, checkpoint_inside
        if compile:  # compiled frames keep the run's model alive: free it before the next row's peak
            torch._dynamo.reset()
        import gc
        gc.collect()
    total = time.perf_counter() - t0
    rows = [json.loads(x) for x in (work / "runs" / "ours" / "metrics.jsonl").read_text().splitlines()]
    warm = rows[a.warmup:]
    return dict(first_s=rows[0]["step_time"], step_s=statistics.median(r["step_time"] for r in warm),
                peak_gb=peak_gb(a.device), peak_alloc_gb=peak_alloc_gb(a.device), total_s=total,
                mean_length=statistics.mean(r["completions/mean_length"] for r in rows),
                rollout_s=statistics.median(r["rollout/seconds"] for r in warm),
                mismatch_max=max(r.get("sampling/sampling_logp_difference/max", 0.0) for r in warm))


def run_trl(a, model_dir: Path, prompts: list[str], work: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    dev = a.device
    n_seq = a.prompts * a.generations
    if n_seq % a.micro_batch:
        raise SystemExit(f"--micro-batch {a.micro_batch} must divide prompts x generations = {n_seq}")

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.t = [], None

        def on_step_begin(self, args, state, control, **kw):
            if dev == "cuda":
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if dev == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t)

    tok = load_tok(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    model.to(dev)
    args = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=n_seq // a.micro_batch, num_generations=a.generations,
        max_completion_length=a.new_tokens, max_steps=a.warmup + a.steps, learning_rate=1e-6,
        beta=0.0, loss_type="dapo", scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0,
        num_iterations=1, bf16=dev == "cuda", use_cpu=dev == "cpu", logging_steps=1,
        report_to="none", save_strategy="no", log_completions=False, shuffle_dataset=False,
        gradient_checkpointing=a.grad_ckpt == "on", dataloader_num_workers=0, seed=0, disable_tqdm=True)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          callbacks=[timer])
    reset_peak(dev)
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    out = dict(first_s=timer.times[0], step_s=statistics.median(timer.times[a.warmup:]),
               peak_gb=peak_gb(dev), peak_alloc_gb=peak_alloc_gb(dev), total_s=total,
               mean_length=statistics.mean(h["completions/mean_length"] for h in logs) if logs else None)
    del trainer, model
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="tiny | qwen0.5b (default: tiny on CPU, qwen0.5b on CUDA)")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--generations", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward (both sides)")
    ap.add_argument("--ours-micro-batches", default=None,
                    help="comma list: one row of ours per micro-batch size, suffix f = HF forward's full "
                         "logits instead of the chunked head, c = compile=true, o = the layers' checkpoint around "
                         "their compiled call, not inside it (an A/B), h = model.offload_activations, s = the "
                         "chunked LM head at 2^24 logits a chunk, half the default "
                         "(default: --micro-batch; GPU 8,16,32)")
    ap.add_argument("--grad-ckpt", choices=["on", "off"], default="on",
                    help="gradient checkpointing on both sides (on = TRL GRPOConfig's default)")
    ap.add_argument("--compile-options", default=None,
                    help="ours, compiled rows: the layers' torch.compile options, k=v,... (an A/B: "
                         "mode=reduce-overhead, dynamic=sequence, dynamic=False)")
    ap.add_argument("--inductor", default=None,
                    help="ours, compiled rows: torch._inductor.config values for the run, k=v,... (an A/B: "
                         "cpp_wrapper=True, the compiled graphs' launches from C++ instead of Python)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 on CPU)")
    ap.add_argument("--results", default=None, help="append the markdown section to this file (default: printed only)")
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    a = ap.parse_args(argv)
    gpu = a.device == "cuda"
    kind = a.model or ("qwen0.5b" if gpu else "tiny")
    a.prompts = a.prompts or (8 if gpu else 2)
    a.generations = a.generations or (8 if gpu else 4)
    a.prompt_len = a.prompt_len or (128 if gpu else 16)
    a.new_tokens = a.new_tokens or (256 if gpu else 16)
    a.micro_batch = a.micro_batch or (8 if gpu else 4)
    a.steps = a.steps or (3 if gpu else 2)
    if a.threads or not gpu:
        torch.set_num_threads(a.threads or 1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        vocab = build(kind, work / "model")
        prompts = make_prompts(a.prompts * (a.warmup + a.steps), a.prompt_len, vocab)
        for spec in (a.ours_micro_batches or ("8,16,32" if gpu else str(a.micro_batch))).split(","):
            mb, full, comp, outside, host = (int(spec.rstrip("fcohs")), "f" in spec, "c" in spec, "o" in spec,
                                             "h" in spec)
            small = "s" in spec
            name = (f"ours (micro-batch {mb}{', full logits' if full else ''}{', compile' if comp else ''}"
                    f"{', checkpoint around the compiled call' if outside else ''}"
                    f"{', activations on the host' if host else ''}{', head chunk 2^24 logits' if small else ''})")
            results[name] = run_ours(a, work / "model", prompts, work / f"ours{spec}", mb, full, comp, outside,
                                     host, head_chunk=1 << 24 if small else None)
            print(f"{name}: {json.dumps(results[name])}", flush=True)
        if not a.skip_trl:
            try:
                import trl  # noqa: F401
            except ImportError:
                print("trl is not importable: skipping TRL (pip install trl)", flush=True)
            else:
                name = f"trl (micro-batch {a.micro_batch})"
                results[name] = run_trl(a, work / "model", prompts, work / "trl")
                print(f"{name}: {json.dumps(results[name])}", flush=True)
    table = render(results, kind, a)
    print(table)
    if a.results:
        with open(a.results, "a") as f:
            f.write(table + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "args": vars(a)}, indent=1))


def render(results, kind, a) -> str:
    date = datetime.date.today().isoformat()
    cmd = "python bench/grpo_step.py " + " ".join(sys.argv[1:])
    try:
        import trl
        trl_v = f", trl {trl.__version__}"
    except ImportError:
        trl_v = ""
    n_tok = a.prompts * a.generations * a.new_tokens
    lines = [f"## grpo step: ours vs TRL GRPOTrainer — {kind}, {a.prompts} prompts × {a.generations} "
             f"generations, {a.prompt_len}-token prompts, {a.new_tokens} new tokens",
             "", f"Card: {device_name(a.device)}. Date: {date}. torch {torch.__version__}, transformers "
             f"{__import__('transformers').__version__}{trl_v}. Gradient checkpointing {a.grad_ckpt} (both sides), "
             f"{f'ours compiled with {a.compile_options}, ' if a.compile_options else ''}"
             f"{f'Inductor {a.inductor}, ' if a.inductor else ''}"
             f"bf16 weights on CUDA (both sides), allocator "
             f"`PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}` (both sides), median of "
             f"{a.steps} steps after {a.warmup} warm-up. Command: `{cmd.strip()}`", "",
             "| trainer | s/step | first step (s) | completion tokens/s | peak reserved (GB) | peak alloc (GB) "
             "| mean length | speed-up |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    trl_r = next((r for n, r in results.items() if n.startswith("trl")), None)
    for name, r in results.items():
        up = f"{trl_r['step_s'] / r['step_s']:.1f}×" if trl_r and name.startswith("ours") else ""
        peak = f"{r['peak_gb']:.2f}" if r.get("peak_gb") else "—"
        alloc = f"{r['peak_alloc_gb']:.2f}" if r.get("peak_alloc_gb") else "—"
        length = f"{r['mean_length']:.1f}" if r.get("mean_length") is not None else "—"
        lines.append(f"| {name} | {r['step_s']:.3f} | {r['first_s']:.2f} | {n_tok / r['step_s']:,.0f} | "
                     f"{peak} | {alloc} | {length} | {up} |")
    notes = [f"- {n}: rollout {o['rollout_s']:.3f} s of the step; sampler–trainer max |Δ log-prob| "
             f"{o['mismatch_max']:.2e}" for n, o in results.items() if n.startswith("ours")]
    return "\n".join(lines + [""] + notes + [""])


if __name__ == "__main__":
    main()
