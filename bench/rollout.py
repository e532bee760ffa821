"""Rollout engine vs Hugging Face `generate`: same model, same prompts, same lengths.

    python bench/rollout.py                    # CPU: tiny model, 32-token prompts, 64 new tokens
    python bench/rollout.py --device cuda      # GPU: random-init Qwen2.5-0.5B shape, 128 + 256 tokens
                                               # (the benchmark row; bench/gpu.sh rollout runs it)

Both sides sample at temperature 1 from the full vocabulary (HF: top_k=0, top_p=1) with EOS
ignored, so every sequence gets exactly --new-tokens tokens. Each side is called once cold (the
first-call cost: HF's lazy init, our graph capture) and then timed warm (median of --repeats).
ms/step is decode time per step: ours from the engine's own timer, HF's as
(t(new_tokens) − t(1 token)) / (new_tokens − 1), i.e. without the prefill. Peak memory (CUDA only) is
the allocator's peak *reserved* bytes over a warm call, after emptying the cache first — reserved,
not allocated, so our persistent cache and CUDA-graph pool are counted.
On CUDA the run also checks log-prob agreement with a training forward (bf16) and greedy decoding
with graphs against without. Prints a markdown table (--results FILE also appends it there).

The model's q/k/v and gate/up weights are laid out in one buffer per layer and group
(`fuse_projections`, as the trainers' sampling copy is): the engine runs one GEMM per group
(tether/rollout/native.py, FUSE_PROJECTIONS). `--no-fuse` keeps HF's layout: one GEMM per projection.

`--turns M` adds multi-turn rows at each batch: the same prompts and the same total length, but
every model turn ends at an end token and a 16-token reply is fed back into the same KV cache
(the engine's episode path, `Sampler.sample(episodes=...)`) until the --new-tokens budget is spent.
With random weights the next-token distribution is near uniform, so V/M of the vocabulary's ids
serve as end tokens to give turns of about M tokens (the measured mean is printed). Tokens/s counts
every token of the episode, the model's and the replies', against the single-turn row's: what
the turn boundaries (host checks, replies scheduled, waiting slots masked) cost.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tether.objectives.logprobs import token_logps  # noqa: E402
from tether.rollout import Sampler, SamplingConfig, logprob_mismatch  # noqa: E402
from tether.rollout.engine import Episodes  # noqa: E402
from tether.rollout.fuse import fuse_projections  # noqa: E402
import tether.rollout.engine as engine  # noqa: E402
import tether.rollout.native as native  # noqa: E402

QWEN05 = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
              rope_theta=1e6, max_position_embeddings=32768)


# Gemma 3 270M's shape (its config.json): 18 layers, five local (512-token window, RoPE base 10k) to one
# global (base 1M), 4 query heads over 1 KV head of 256, a 262k vocabulary
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=256, intermediate_size=2048, query_pre_attn_scalar=256,
                   sliding_window=512, max_position_embeddings=32768, tie_word_embeddings=True,
                   layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)])


def build_model(kind: str, device: str, fuse: bool = True):
    """The benchmark's model; fuse: its q/k/v and gate/up weights in one buffer per layer and group
    (fuse_projections: the sampler runs one GEMM each; the same values, HF's forward unchanged)."""
    if kind == "tiny":
        from tether.models import make_tiny_model
        model, _ = make_tiny_model(None)  # Llama: hidden 128, 4 layers, 4 heads / 2 KV heads
        model = model.to(device).eval()
    elif Path(kind).is_dir():  # a real model's HF folder (e.g. `tether convert`'s Gemma 3 270M), in bf16
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(kind, dtype=torch.bfloat16).to(device)
        model.generation_config.eos_token_id = None  # EOS ignored: every row runs to max_new_tokens
        model.generation_config.pad_token_id = model.config.pad_token_id or 0
        model = model.eval()
    else:
        from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen2Config
        if kind == "gemma3-270m":  # random weights in Gemma 3 270M's shape (the speed does not read them)
            cfg = Gemma3TextConfig(**GEMMA3_270M, bos_token_id=None, eos_token_id=None, pad_token_id=0)
        else:
            cfg = Qwen2Config(**QWEN05, bos_token_id=None, eos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.generation_config.eos_token_id = None  # EOS ignored: every row runs to max_new_tokens
        model.generation_config.pad_token_id = 0
        model = model.eval()
    return fuse_projections(model) if fuse else model


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def peak_of(fn, device):
    """(seconds, output, peak reserved GB) of one call; the cache is emptied first."""
    if device != "cuda":
        t, out = timed(fn, device)
        return t, out, None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t, out = timed(fn, device)
    return t, out, torch.cuda.max_memory_reserved() / 1e9


def hf_generate(model, ids, new):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=None, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          pad_token_id=0, eos_token_id=None)


def bench_batch(model, B, P, new, vocab, device, repeats, skip_hf):
    g = torch.Generator().manual_seed(B)
    ids = torch.randint(10, vocab, (B, P), generator=g).to(device)
    rows = {}
    # --- ours
    sampler = Sampler(model, None, SamplingConfig(max_new_tokens=new, temperature=1.0, ignore_eos=True))
    first, _ = timed(lambda: sampler.sample(ids.tolist(), seed=0), device)
    runs = [peak_of(lambda: sampler.sample(ids.tolist(), seed=1), device) for _ in range(repeats)]
    wall = statistics.median(r[0] for r in runs)
    ro = runs[-1][1]
    assert ro.completion_mask.sum().item() == B * new
    rows["ours"] = dict(first_s=first, wall_s=wall, tok_s=B * new / wall,
                        ms_step=statistics.median(r[1].stats["ms_per_step"] for r in runs),
                        peak_gb=max((r[2] or 0) for r in runs) or None, capture_s=None)
    extra = {}
    if device == "cuda":
        extra["mismatch"] = mismatch(model, ro, rows_max=32)
    sampler.release()
    del sampler, ro, runs
    # --- HF generate
    if not skip_hf:
        first_hf, out = timed(lambda: hf_generate(model, ids, new), device)
        assert out.shape[1] == P + new, "HF stopped early: lengths must match"
        hf_runs = [peak_of(lambda: hf_generate(model, ids, new), device) for _ in range(repeats)]
        prefill = statistics.median(timed(lambda: hf_generate(model, ids, 1), device)[0] for _ in range(repeats))
        wall_hf = statistics.median(r[0] for r in hf_runs)
        rows["hf"] = dict(first_s=first_hf, wall_s=wall_hf, tok_s=B * new / wall_hf,
                          ms_step=1e3 * (wall_hf - prefill) / (new - 1),
                          peak_gb=max((r[2] or 0) for r in hf_runs) or None)
        del hf_runs, out
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows, extra


class Replies(Episodes):
    """Every turn answered with the same `reply` ids; episodes end at the token budget."""

    def __init__(self, reply):
        self.reply, self.turns = list(reply), 0

    def turn_ended(self, seq, ids):
        self.turns += 1
        return self.reply


def bench_multiturn(model, B, P, new, vocab, device, repeats, mean_turn, reply_len=16, sync_every=0):
    """Episodes of ~mean_turn-token model turns and reply_len-token replies, `new` tokens in all.
    `sync_every`: decode steps between host checks (0: the engine's default, 8 on CUDA). A row whose
    turn ended waits, masked, until the next check schedules its reply: about sync_every / 2 steps a
    boundary, against the cost of each check's host sync.

    Each repeat is a pair, a single-turn call (EOS ignored, `new` tokens a row, the same prompts)
    then a multi-turn call, back to back: the boundaries' cost is computed a pair at a time, so a
    drift of the card's speed over the run (clocks, another process) moves both sides of a pair;
    its median and range over the pairs are reported."""
    g = torch.Generator().manual_seed(B)
    ids = torch.randint(10, vocab, (B, P), generator=g).to(device).tolist()
    ends = torch.randperm(vocab, generator=g)[: max(1, vocab // mean_turn)].tolist()
    reply = torch.randint(10, vocab, (reply_len,), generator=g).tolist()
    sampler = Sampler(model, None, SamplingConfig(max_new_tokens=new, temperature=1.0, stop_token_ids=ends,
                                                  sync_every=sync_every))
    single = Sampler(model, None, SamplingConfig(max_new_tokens=new, temperature=1.0, ignore_eos=True,
                                                 sync_every=sync_every))
    timed(lambda: sampler.sample(ids, seed=0, episodes=Replies(reply)), device)
    timed(lambda: single.sample(ids, seed=0), device)
    runs, pairs = [], []
    for r in range(repeats):
        t1, one = timed(lambda: single.sample(ids, seed=1 + r), device)
        eps = Replies(reply)
        t, ro = timed(lambda: sampler.sample(ids, seed=1 + r, episodes=eps), device)
        tokens, capture = int(ro.token_mask.sum()), ro.stats["capture_s"]
        single_tok_s = int(one.completion_mask.sum()) / t1
        runs.append((t, tokens, int(ro.completion_mask.sum()), eps.turns, ro.stats["ms_per_step"], capture))
        pairs.append(dict(cost=1 - tokens / t / single_tok_s, cost_no_capture=1 - tokens / (t - capture) / single_tok_s,
                          single_tok_s=single_tok_s, single_ms_step=one.stats["ms_per_step"]))
    sampler.release()
    single.release()
    t, tokens, model_tokens, turns, ms, capture = sorted(runs)[len(runs) // 2]
    costs = sorted(p["cost"] for p in pairs)
    costs_nc = sorted(p["cost_no_capture"] for p in pairs)
    # Episodes end at different steps, so a timed call may compact its batch to a size the warm-up never
    # reached and capture that size's CUDA graph then (once a process, like the first call's captures):
    # tokens/s is given with and without those seconds.
    return dict(wall_s=t, tok_s=tokens / t, tok_s_no_capture=tokens / (t - capture), capture_s=capture,
                tokens=tokens, model_tokens=model_tokens, ms_step=ms, mean_turn=model_tokens / max(turns + B, 1),
                turns_per_episode=turns / B + 1, sync_every=sync_every, pairs=pairs,
                pair_cost=statistics.median(costs), pair_cost_range=[costs[0], costs[-1]],
                pair_cost_no_capture=statistics.median(costs_nc), pair_cost_no_capture_range=[costs_nc[0], costs_nc[-1]],
                single_tok_s=statistics.median(p["single_tok_s"] for p in pairs),
                single_ms_step=statistics.median(p["single_ms_step"] for p in pairs))


@torch.no_grad()
def mismatch(model, ro, rows_max):
    """bf16 training forward over the sampled tokens vs the sampler's log-probs."""
    batch = {k: v[:rows_max] for k, v in ro.training_batch().items()}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits
    lp = token_logps(logits, batch["input_ids"], ro.logprob_temperature)
    return logprob_mismatch(batch["logprobs"], lp, batch["completion_mask"])


@torch.no_grad()
def greedy_graphs_vs_eager(model, vocab, device):
    """Greedy tokens with CUDA graphs vs the same engine eager (same kernels per step)."""
    ids = torch.randint(10, vocab, (8, 64), generator=torch.Generator().manual_seed(7)).tolist()
    a = Sampler(model, None, max_new_tokens=64, temperature=0, ignore_eos=True).sample(ids)
    b = Sampler(model, None, max_new_tokens=64, temperature=0, ignore_eos=True, cuda_graphs=False).sample(ids)
    same = (a.completion_ids == b.completion_ids).float().mean().item()
    return {"greedy_token_agreement_graphs_vs_eager": same}


def device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="tiny | qwen0.5b | gemma3-270m (random weights in that shape) | an HF model folder (default: tiny on CPU, qwen0.5b on CUDA)")
    ap.add_argument("--batches", default="8,64,256")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--no-fuse", action="store_true",
                    help="keep one weight per projection (one GEMM each) instead of q|k|v and gate|up fused")
    ap.add_argument("--no-fuse-kernels", action="store_true",
                    help="RoPE and silu(gate) * up as torch ops, not in the Triton kernels (native.FUSE_KERNELS)")
    ap.add_argument("--turns", type=int, default=0, help="also multi-turn rows: model turns of about this many tokens")
    ap.add_argument("--overlap-turns", choices=["on", "off"], default=None,
                    help="multi-turn rows: one more decode step runs while the host answers (engine.OVERLAP_TURNS; "
                         "default: the engine's)")
    ap.add_argument("--fuse-record", choices=["on", "off"], default=None,
                    help="a decode step's bookkeeping in one Triton kernel (engine.FUSE_RECORD; default: the engine's)")
    ap.add_argument("--sync-every", type=int, default=0,
                    help="multi-turn rows: decode steps between host checks (0: the engine's default)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1 on CPU: on a shared 2-core box a 2-thread parallel "
                         "region stalls for a scheduler quantum whenever the other core is busy)")
    ap.add_argument("--results", default=None, help="append the markdown section to this file (default: printed only)")
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    args = ap.parse_args(argv)
    dev = args.device
    kind = args.model or ("qwen0.5b" if dev == "cuda" else "tiny")
    P = args.prompt_len or (128 if dev == "cuda" else 32)
    new = args.new_tokens or (256 if dev == "cuda" else 64)
    repeats = args.repeats or (3 if dev == "cuda" else 1)
    if args.threads or dev == "cpu":
        torch.set_num_threads(args.threads or 1)
    if args.no_fuse_kernels:
        native.FUSE_KERNELS = False
    if args.overlap_turns:
        engine.OVERLAP_TURNS = args.overlap_turns == "on"
    if args.fuse_record:
        engine.FUSE_RECORD = args.fuse_record == "on"
    model = build_model(kind, dev, fuse=not args.no_fuse)
    vocab = model.config.vocab_size
    results, extras = {}, {}
    for B in map(int, args.batches.split(",")):
        results[B], extras[B] = bench_batch(model, B, P, new, vocab, dev, repeats, args.skip_hf)
        if args.turns:
            results[B]["multi-turn"] = bench_multiturn(model, B, P, new, vocab, dev, repeats, args.turns,
                                                       sync_every=args.sync_every)
        print(f"batch {B}: {json.dumps(results[B])}", flush=True)
    if dev == "cuda":
        extras["greedy"] = greedy_graphs_vs_eager(model, vocab, dev)
    table = render(results, extras, kind, P, new, dev, args)
    print(table)
    if args.results:
        with open(args.results, "a") as f:
            f.write(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "extras": extras}, indent=1))


def render(results, extras, kind, P, new, dev, args) -> str:
    date = datetime.date.today().isoformat()
    cmd = "python bench/rollout.py " + " ".join(sys.argv[1:])
    fused = "one GEMM per projection (--no-fuse)" if args.no_fuse else "q|k|v and gate|up fused"
    if args.no_fuse_kernels:
        fused += ", RoPE and SwiGLU as torch ops (--no-fuse-kernels)"
    if args.turns:  # the engine's switches as this device applies them
        overlap = dev == "cuda" if engine.OVERLAP_TURNS is None else engine.OVERLAP_TURNS
        kernel = engine.FUSE_RECORD and dev == "cuda"
        fused += (f", turn boundaries {'overlapped with' if overlap else 'not overlapped with'} a decode"
                  f" step, the step's bookkeeping {'in one kernel' if kernel else 'in torch ops'}")
    lines = [f"## rollout: ours vs HF generate — {kind}, {P}-token prompts, {new} new tokens, {fused}",
             "", f"Card: {device_name(dev)}. Date: {date}. torch {torch.__version__}, "
             f"transformers {__import__('transformers').__version__}. Command: `{cmd.strip()}`", "",
             "| batch | engine | tokens/s | ms/decode step | first call (s) | warm call (s) | peak mem (GB) | speed-up |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for B, rows in results.items():
        hf = rows.get("hf")
        for name, r in rows.items():
            if name == "multi-turn":
                continue
            up = f"{r['tok_s'] / hf['tok_s']:.1f}×" if hf and name == "ours" else ""
            peak = f"{r['peak_gb']:.2f}" if r.get("peak_gb") else "—"
            lines.append(f"| {B} | {name} | {r['tok_s']:,.0f} | {r['ms_step']:.2f} | {r['first_s']:.2f} | "
                         f"{r['wall_s']:.2f} | {peak} | {up} |")
    multi = {B: rows for B, rows in results.items() if "multi-turn" in rows}
    if multi:
        lines += ["", "Multi-turn episodes of the same total length (`--turns`): every model turn ends at an end "
                  "token and a 16-token reply goes into the same KV cache. Each repeat is a pair of calls, "
                  "single-turn then multi-turn; the cost is 1 − (episode tokens/s) / (single-turn tokens/s) "
                  "a pair, its median and range over the pairs.", "",
                  "| batch | turns / episode | mean model turn (tokens) | tokens/s (all tokens) | single-turn tokens/s | "
                  "cost of the boundaries, pairs: median (range) | the same without graph captures | "
                  "ms / decode step, episodes / single-turn | graph captures in the call (s) |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for B, rows in multi.items():
            m = rows["multi-turn"]
            lo, hi = m["pair_cost_range"]
            lo_nc, hi_nc = m["pair_cost_no_capture_range"]
            lines.append(f"| {B} | {m['turns_per_episode']:.1f} | {m['mean_turn']:.0f} | {m['tok_s']:,.0f} | "
                         f"{m['single_tok_s']:,.0f} | {m['pair_cost']:.1%} ({lo:.1%} – {hi:.1%}) | "
                         f"{m['pair_cost_no_capture']:.1%} ({lo_nc:.1%} – {hi_nc:.1%}) | "
                         f"{m['ms_step']:.2f} / {m['single_ms_step']:.2f} | {m['capture_s']:.3f} |")
    notes = []
    for B, e in extras.items():
        if B == "greedy":
            notes.append(f"- greedy tokens, CUDA graphs vs eager: {e['greedy_token_agreement_graphs_vs_eager']:.4f} agree")
        elif e.get("mismatch"):
            m = e["mismatch"]
            notes.append(f"- batch {B}: |log-prob(sampler) − log-prob(training forward)|, bf16: "
                         f"mean {m['sampling/sampling_logp_difference/mean']:.2e}, "
                         f"p99 {m['sampling/sampling_logp_difference/p99']:.2e}, "
                         f"max {m['sampling/sampling_logp_difference/max']:.2e}")
    return "\n".join(lines + [""] + notes + [""])


if __name__ == "__main__":
    main()
