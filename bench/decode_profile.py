"""Where the rollout engine's decode step spends its time: one sampling call under torch.profiler, its
kernels sorted into categories by name, against the memory floor of each.

    python bench/decode_profile.py --device cuda                 # Qwen2.5-0.5B shape, batch 64, 128 + 256 tokens
    python bench/decode_profile.py --device cuda --batch 256 --json out.json --trace trace.json
    python bench/decode_profile.py --device cpu --model tiny --batch 4 --new-tokens 16   # the CPU path (tests)
                                                                  # (bench/gpu.sh rollout runs the CUDA rows)

The model is bench/rollout.py's (`build_model`: random-init Qwen2.5-0.5B shape in bf16, or the tiny
Llama), its q/k/v and gate/up weights in one buffer per layer and group (`fuse_projections`: one GEMM
each, tether/rollout/native.py's FUSE_PROJECTIONS; --no-fuse: one GEMM per projection); the prompts
are --batch rows of --prompt-len random ids; sampling is at temperature 1 over the full vocabulary
with EOS ignored, so every decode step runs the whole batch. One call warms up (graph capture,
cuBLAS handles), one plain call gives the wall time without the profiler, one call runs under
torch.profiler (CPU and CUDA activities on CUDA). Only the decode loop counts: the
profile is cut to the span the engine's decode timer measures (from its sync after the prefill to
its sync after the last step), found through record_function ranges put around the engine's
`_sync` calls for that call. Every number is that window's total divided by the engine's count of
decode steps (--new-tokens − 1). Inside a CUDA graph replay the profiler records each kernel but no
op that launched it, so kernels are told apart by name alone; --no-graphs profiles the same step
launched op by op (what the graphs save shows in launches and gap).

Per decode step:
- wall: the engine's own timer (`stats["ms_per_step"]`, as bench/rollout.py reads it), of the
  profiled call and of the plain call (their difference is the profiler's own cost);
- busy: the summed duration of the GPU's work in the window (kernels, memcpy, memset); busy_union,
  the union of their intervals, equals it when nothing overlaps (one stream);
- gap: wall − busy_union, the time the GPU waits for the host: launches, the host checks every
  `sync_every` steps, Python;
- kernels: GPU work items per step; launches: the host's launch calls per step (with CUDA graphs
  one cudaGraphLaunch replays a whole step, graph_launches counts those);
- categories: busy split by kernel name (`kernel_category`: GEMMs, attention, norm/elementwise,
  sampling, copy, other), with kernels per step; top: the 15 kernels of most total time, with
  their calls per step;
- floors: the bytes a step must move over --hbm-gbps (the card's HBM bandwidth; H200: 4800 GB/s).
  weights: every parameter once (tied embeddings once, as the LM head; an untied input embedding
  by its --batch looked-up rows); gemm: the linear layers' weights and biases read and the
  [B, V] logits written; attention: the KV cache read at the mean context length, P + T/2 slots
  (kv_attended: the slots the captured steps are given, rounded up to engine.KV_BUCKET); sampling:
  the logits read once. A category's `x_floor` is its time over its floor. Norms, elementwise ops
  and copies move a few [B, hidden] rows per op, so their floor is ~0 and none is given.

On CPU there is no GPU work: the "kernels" are torch's CPU ops, each with its self time, and the C
decode step (tether/rollout/cpu.py) is recorded as one op, `tether::cpu_decode_step` (category
other: the whole forward in one call); busy is their sum and gap the Python between them.

Prints a markdown table (--results FILE also appends it there); --json FILE writes every number
with the device, torch version, date and git commit; --trace FILE the profiler's chrome trace.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from rollout import Replies, build_model, device_name  # noqa: E402  (bench/rollout.py)
from tether.rollout import Sampler, SamplingConfig  # noqa: E402
import tether.rollout.engine as engine  # noqa: E402
import tether.rollout.native as native  # noqa: E402

SYNC, WAVE, CSTEP, CHECK = "tether::sync", "tether::decode_wave", "tether::cpu_decode_step", "tether::check"
MARKERS = (SYNC, WAVE, CHECK)  # ranges this script adds to cut the profile; not work of their own

CATEGORIES = ("gemm", "attention", "norm/elementwise", "sampling", "copy", "other")

# (category, substrings of the lower-cased name): tried in this order, the first match wins.
RULES = (
    ("copy", ("memcpy", "memset")),  # CUPTI's names: "Memcpy DtoD (Device -> Device)", "Memset (Device)"
    ("attention", ("_decode_attn", "attention", "attn", "flash", "fmha", "sdpa")),
    ("norm/elementwise", ("rmsnorm",)),  # before "gemm", which _gemma_rmsnorm holds
    ("gemm", ("gemm", "gemv", "cublas", "cutlass", "nvjet", "xmma", "matmul", "splitkreduce", "triton_tem")),
    ("sampling", ("_block_stats", "_draw", "softmax", "sort", "topk", "cumsum", "scan", "argmax", "argmin", "maxops",
                  "minops", "amax", "amin", "searchsorted", "logsumexp", "multinomial", "philox", "curand",
                  "random", "uniform", "distribution", "normal_kernel", "bernoulli")),
    ("norm/elementwise", ("norm", "rsqrt", "welford", "meanops", "masked", "where", "with_index")),
    ("copy", ("copy", "catarray", "fill", "index", "gather", "scatter", "embedding")),
    ("norm/elementwise", ("elementwise", "silu", "gelu", "swiglu", "rope", "rotary", "roll", "triton_poi",
                          "mul", "add")),
)
# CPU op names (aten::<op>) that the substrings above do not place
ATEN_GEMM = {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "addmv", "mv"}
ATEN_ELEMENTWISE = {"sub", "div", "exp", "log", "neg", "clamp", "clamp_min", "clamp_max", "minimum", "maximum",
                    "eq", "ne", "lt", "gt", "le", "ge", "bitwise_or", "bitwise_and", "logical_not", "pow",
                    "sigmoid", "tanh", "abs", "reciprocal"}


def kernel_category(name: str) -> str:
    """The category of a GPU kernel (or CPU op) from its name alone, one of CATEGORIES.

    - gemm: cuBLAS / cuBLASLt / CUTLASS matrix products (``*gemm*``, ``gemv*``, Hopper's ``nvjet_*``,
      ``sm90_xmma_*``, split-K reductions), ``aten::mm/addmm/linear/...``;
    - attention: the engine's Triton ``_decode_attn``, flash / fmha / cuDNN SDPA kernels;
    - sampling: softmax, sort, top-k, cumsum and scans, arg/max reductions, searchsorted, the
      engine's Triton ``_block_stats``, random number generation;
    - norm/elementwise: RMSNorm (``*norm*``, ``rsqrt``), masked_fill / where, and every other
      elementwise kernel (``*elementwise_kernel*``: SiLU, mul, add, RoPE's products, roll);
    - copy: memcpy, memset, copies and casts (``direct_copy``), cat, fill, index / gather /
      scatter / embedding lookups;
    - other: the rest (sum reductions, the CPU's C decode step).

    Memcpy / memset are matched first, then the substrings of ``RULES`` in order. A kernel is put
    where its name says, not where it was launched from (inside a CUDA graph no op is recorded):
    the elementwise ops of the sampling code (exp, masked_fill) count as elementwise, its gathers
    as copies."""
    low = name.lower()
    if low.startswith("aten::"):
        op = low[6:].strip("_")
        if op in ATEN_GEMM:
            return "gemm"
        if op in ATEN_ELEMENTWISE:
            return "norm/elementwise"
    for cat, keys in RULES:
        if any(k in low for k in keys):
            return cat
    return "other"


# ------------------------------------------------------------------------------------ the profile

class _Annotated:
    """A callable run inside a record_function range of its own; other attributes pass through."""

    def __init__(self, fn, label):
        self._fn, self._label = fn, label

    def __call__(self, *a, **k):
        with record_function(self._label):
            return self._fn(*a, **k)

    def __getattr__(self, name):
        return getattr(self._fn, name)


@contextmanager
def marked(sampler: Sampler):
    """The engine's `_sync` calls, its decode wave and its host checks inside record_function ranges
    (SYNC, WAVE, CHECK), and on CPU the C decode step as one op (CSTEP), for the duration of the block."""
    sync, be = engine._sync, sampler.backend
    cstep = getattr(be, "cstep", None)
    engine._sync = _Annotated(sync, SYNC)
    sampler._decode_wave = _Annotated(sampler._decode_wave, WAVE)
    sampler._check = _Annotated(sampler._check, CHECK)
    if cstep is not None:
        be.cstep = _Annotated(cstep, CSTEP)
    try:
        yield
    finally:
        engine._sync = sync
        del sampler._decode_wave, sampler._check  # the class's methods again
        if cstep is not None:
            be.cstep = cstep


def _cpu(e) -> bool:
    return e.device_type == DeviceType.CPU


def decode_window(events) -> tuple[float, float]:
    """(start, end) in the profile's µs of the engine's decode timer: from the end of the second
    `_sync` in the decode wave (the one after the prefill) to the end of its last (after the last
    step)."""
    waves = [e for e in events if e.name == WAVE and _cpu(e)]
    if len(waves) != 1:
        raise RuntimeError(f"expected one decode wave in the profile, found {len(waves)}")
    w = waves[0].time_range
    syncs = sorted((e.time_range for e in events
                    if e.name == SYNC and _cpu(e) and w.start <= e.time_range.start <= w.end), key=lambda r: r.start)
    if len(syncs) < 3:
        raise RuntimeError(f"expected >= 3 syncs in the decode wave (start, after prefill, end), found {len(syncs)}")
    return syncs[1].end, syncs[-1].end


_LAUNCH = re.compile(r"^cu(da)?\w*Launch|^cu(da)?Memcpy\w*Async|^cu(da)?Memset\w*Async")
_DEVICE_SYNC = re.compile(r"^(Stream|Event|Context) (Sync|Wait)")


def window_work(events, t0: float, t1: float, on_gpu: bool):
    """The work in [t0, t1]: (name, start µs, duration µs) per GPU kernel / memcpy / memset, or on
    CPU per op with its self time; and the host's launch calls (name list)."""
    work, launches = [], []
    for e in events:
        r = e.time_range
        if not (t0 <= r.start < t1) or e.name in MARKERS:
            continue
        if on_gpu:
            if not _cpu(e):
                if not (getattr(e, "is_user_annotation", False) or e.name.startswith("tether::")
                        or _DEVICE_SYNC.match(e.name)):
                    work.append((e.name, r.start, r.end - r.start))
            elif _LAUNCH.match(e.name):
                launches.append(e.name)
        elif _cpu(e) and not getattr(e, "is_async", False):
            work.append((e.name, r.start, e.self_cpu_time_total))
    return work, launches


def breakdown(work, steps: int, intervals: bool = True, top: int = 15) -> dict:
    """Per-step totals of ``work`` [(name, start µs, duration µs)]: busy (sum), busy_union (the
    union of [start, start + duration]; with ``intervals`` False, e.g. CPU self times, the sum),
    kernels, per category {ms, kernels}, and the ``top`` names by total time."""
    per_name: dict[str, list] = {}
    for name, _, dur in work:
        s = per_name.setdefault(name, [0.0, 0])
        s[0] += dur
        s[1] += 1
    busy = sum(d for _, _, d in work)
    union = busy
    if intervals:
        union, end = 0.0, float("-inf")
        for _, s, d in sorted(work, key=lambda w: w[1]):
            if s + d > end:
                union += s + d - max(s, end)
                end = s + d
    cats = {c: {"ms": 0.0, "kernels": 0.0} for c in CATEGORIES}
    for name, (us, n) in per_name.items():
        c = cats[kernel_category(name)]
        c["ms"] += us / 1e3 / steps
        c["kernels"] += n / steps
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(
        busy_ms=busy / 1e3 / steps, busy_union_ms=union / 1e3 / steps, kernels=len(work) / steps,
        categories=cats,
        top=[dict(name=name, category=kernel_category(name), ms=us / 1e3 / steps, calls=n / steps,
                  us_per_call=us / n, share=us / busy if busy else 0.0) for name, (us, n) in ranked])


# ------------------------------------------------------------------------------------ memory floors

def floors(model, B: int, P: int, T: int, hbm_gbps: float, attended: list[int]) -> dict:
    """Bytes a decode step must move (module docstring) and their time at ``hbm_gbps``."""
    cfg = model.config
    seen, linear = set(), 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            for p in (m.weight, m.bias):
                if p is not None and p.data_ptr() not in seen:
                    seen.add(p.data_ptr())
                    linear += p.numel() * p.element_size()
    params = {p.data_ptr(): p for p in model.parameters()}
    weights = sum(p.numel() * p.element_size() for p in params.values())
    emb = model.get_input_embeddings().weight
    if emb.data_ptr() not in seen:  # an untied input embedding: only the looked-up rows are read
        weights -= emb.numel() * emb.element_size() - B * emb.shape[1] * emb.element_size()
    elt = next(model.parameters()).element_size()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_slot = 2 * cfg.num_hidden_layers * B * kv_heads * head_dim * elt  # keys + values, all layers
    ctx = P + T / 2  # mean over decode steps t = 1..T-1 of the P + t slots that hold tokens
    logits = B * cfg.vocab_size * elt
    ms = lambda nbytes: nbytes / (hbm_gbps * 1e9) * 1e3  # noqa: E731
    out = dict(hbm_gbps=hbm_gbps, weight_bytes=weights, linear_bytes=linear, logits_bytes=logits,
               mean_context=ctx, kv_bytes=per_slot * ctx,
               mean_kv_attended=sum(attended) / len(attended) if attended else None,
               kv_attended_bytes=per_slot * sum(attended) / len(attended) if attended else None)
    out.update(weights_ms=ms(weights), kv_ms=ms(out["kv_bytes"]), logits_ms=ms(logits),
               total_ms=ms(weights + out["kv_bytes"] + 2 * logits))
    out["category_ms"] = {"gemm": ms(linear + logits), "attention": ms(out["kv_bytes"]), "sampling": ms(logits)}
    return out


# ------------------------------------------------------------------------------------ the run

def git_commit() -> str | None:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("+dirty" if dirty else "")) if sha else None


def profile_decode(model, B, P, T, dev, graphs=True, trace=None, hbm_gbps=4800.0, kind="?", turns=0) -> dict:
    """``turns`` > 0: multi-turn episodes as bench/rollout.py's rows (model turns of about ``turns``
    tokens ending at an end token, a 16-token reply fed back each time) instead of one turn."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(B)
    ids = torch.randint(10, vocab, (B, P), generator=g).tolist()
    if turns:
        ends = torch.randperm(vocab, generator=g)[: max(1, vocab // turns)].tolist()
        reply = torch.randint(10, vocab, (16,), generator=g).tolist()
        cfg = SamplingConfig(max_new_tokens=T, temperature=1.0, stop_token_ids=ends, cuda_graphs=graphs)
    else:
        cfg = SamplingConfig(max_new_tokens=T, temperature=1.0, ignore_eos=True, cuda_graphs=graphs)
    sampler = Sampler(model, None, cfg)
    call = lambda seed: sampler.sample(ids, seed=seed, episodes=Replies(reply) if turns else None)  # noqa: E731
    call(0)  # warm-up: graphs captured, kernels picked
    plain = call(1).stats
    on_gpu = dev == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with marked(sampler), profile(activities=acts) as prof:
        ro = call(2)
    stats = ro.stats
    assert int(ro.token_mask.sum()) <= B * T and (turns or int(ro.completion_mask.sum()) == B * T)
    if stats["capture_s"] > 0:
        warnings.warn(f"the profiled call captured graphs ({stats['capture_s']:.3f} s): its window includes them")
    used_graphs = bool(graphs and on_gpu and sampler.backend.name == "native")
    attended = [sampler._kv(P + t) for t in range(1, T)] if used_graphs else []
    layers = getattr(sampler.backend, "layers", [])  # the native backend's: q|k|v, gate|up in one GEMM
    backend = dict(name=sampler.backend.name, attention=getattr(sampler.backend, "attention", None),
                   cuda_graphs=used_graphs, layers=len(layers),
                   qkv_fused=sum(L.qkv is not None and L.qkv.fused for L in layers),
                   gate_up_fused=sum(L.gate_up is not None and L.gate_up.fused for L in layers),
                   rope_in_attention=sum(getattr(sampler.backend, "rope_in_kernel", [])))
    sampler.release()

    events = prof.events()
    t0, t1 = decode_window(events)
    work, launches = window_work(events, t0, t1, on_gpu)
    checks = [e.time_range for e in events if e.name == CHECK and _cpu(e) and t0 <= e.time_range.start < t1]
    steps = stats["decode_steps"]
    b = breakdown(work, steps, intervals=on_gpu)
    if used_graphs and b["kernels"] < 2:
        warnings.warn(f"{b['kernels']:.1f} GPU kernels recorded per step: the profiler did not see the "
                      "kernels of the graph replays (--no-graphs profiles the step op by op)")
    if trace:
        prof.export_chrome_trace(str(trace))
    fl = floors(model, B, P, T, hbm_gbps, attended)
    for c, f in fl["category_ms"].items():
        b["categories"][c].update(floor_ms=f, x_floor=b["categories"][c]["ms"] / f if f else None)
    wall = stats["ms_per_step"]
    window_ms = (t1 - t0) / 1e3
    if abs(window_ms - 1e3 * stats["decode_s"]) > 0.05 * window_ms + 1.0:
        warnings.warn(f"profile window {window_ms:.1f} ms vs the engine's decode timer "
                      f"{1e3 * stats['decode_s']:.1f} ms: the window may be misplaced")
    return dict(
        device=device_name(dev), torch=torch.__version__, date=datetime.datetime.now().isoformat(timespec="seconds"),
        commit=git_commit(), command="python bench/decode_profile.py " + " ".join(sys.argv[1:]),
        config=dict(model=kind, batch=B, prompt_len=P, new_tokens=T, turns=turns,
                    dtype=str(next(model.parameters()).dtype),
                    params=sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values()),
                    backend=backend),
        steps=steps,
        per_step=dict(wall_ms=wall, wall_ms_unprofiled=plain["ms_per_step"], window_ms=window_ms / steps,
                      busy_ms=b["busy_ms"], busy_union_ms=b["busy_union_ms"], gap_ms=wall - b["busy_union_ms"],
                      kernels=b["kernels"], launches=len(launches) / steps if on_gpu else None,
                      host_check_ms=sum(r.end - r.start for r in checks) / 1e3 / steps, checks=len(checks),
                      graph_launches=sum("Graph" in n for n in launches) / steps if on_gpu else None),
        categories=b["categories"], floors=fl, top=b["top"])


_NOISE = re.compile(r"^void |\(anonymous namespace\)::|\b(at::native::|at_cuda_detail::cub::|at::|c10::|std::)"
                    r"|::\{lambda\([^)]*\)#\d+\}(::operator\(\)\(\) const)?")


def short_name(name: str, width: int = 110) -> str:
    """A kernel's name for the table: namespaces, lambdas and the parameter list dropped (the
    template arguments, which say which functor runs, kept), cut to ``width`` characters."""
    s = _NOISE.sub("", name)
    depth = 0
    for i, ch in enumerate(s):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0 and i > 0 and (s[i - 1].isalnum() or s[i - 1] in "_>"):
            s = s[:i]
            break
    return s if len(s) <= width else s[:width - 3] + "..."


def render(r: dict) -> str:
    c, s, fl = r["config"], r["per_step"], r["floors"]
    busy = s["busy_ms"] or 1e-12
    what = "GPU busy (kernels, memcpy, memset)" if s["launches"] is not None else "busy (CPU ops' self time)"
    f3 = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    be = c["backend"]  # the C step (attention "c") runs GEMMs of its own: no q|k|v fusion to report
    fused = "" if be["attention"] == "c" or "layers" not in be else \
        f", q|k|v / gate|up one GEMM in {be['qkv_fused']} / {be['gate_up_fused']} of {be['layers']} layers"
    lines = [f"## decode step profile — {c['model']}, batch {c['batch']}, {c['prompt_len']}-token prompts, "
             f"{c['new_tokens']} new tokens" + (f", episodes of ~{c['turns']}-token turns" if c.get("turns") else ""), "",
             f"Card: {r['device']}. Date: {r['date']}. torch {r['torch']}, commit {r['commit']}. Backend "
             f"{c['backend']['name']}, attention {c['backend']['attention']}, CUDA graphs "
             f"{'on' if c['backend']['cuda_graphs'] else 'off'}{fused}. Per decode step: totals over the engine's "
             f"decode window / {r['steps']} steps. Command: `{r['command'].strip()}`", "",
             "| per decode step | value |", "| --- | ---: |",
             f"| wall, engine timer, profiled call (ms) | {s['wall_ms']:.3f} |",
             f"| wall, engine timer, call without the profiler (ms) | {s['wall_ms_unprofiled']:.3f} |",
             f"| {what} (ms) | {s['busy_ms']:.3f} |",
             f"| idle gap: wall − busy (union {s['busy_union_ms']:.3f} ms) (ms) | {s['gap_ms']:.3f} |",
             f"| host checks: {s['checks']} in the window, their host time (ms) | {s['host_check_ms']:.3f} |",
             f"| kernels | {s['kernels']:.1f} |"]
    if s["launches"] is not None:
        lines.append(f"| host launch calls (graph launches) | {s['launches']:.1f} ({s['graph_launches']:.2f}) |")
    lines += [f"| memory floor at {fl['hbm_gbps']:.0f} GB/s: weights {fl['weight_bytes'] / 1e9:.3f} GB + KV "
              f"{fl['kv_bytes'] / 1e9:.3f} GB (context {fl['mean_context']:.0f}) + logits written and read "
              f"2 × {fl['logits_bytes'] / 1e9:.3f} GB (ms) | {fl['total_ms']:.3f} |",
              f"| wall / memory floor | {s['wall_ms'] / fl['total_ms']:.1f}× |", "",
              "| category | ms / step | share of busy | kernels / step | memory floor (ms) | × floor |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, cat in r["categories"].items():
        x = cat.get("x_floor")
        lines.append(f"| {name} | {cat['ms']:.3f} | {cat['ms'] / busy:.1%} | {cat['kernels']:.1f} | "
                     f"{f3(cat.get('floor_ms'))} | {'—' if x is None else f'{x:.1f}×'} |")
    lines.append(f"| all | {s['busy_ms']:.3f} | 100% | {s['kernels']:.1f} | {fl['total_ms']:.3f} | "
                 f"{s['busy_ms'] / fl['total_ms']:.1f}× |")
    if fl["kv_attended_bytes"] is not None:
        lines += ["", f"Attention's floor is the KV read at the mean context ({fl['mean_context']:.0f} slots); the "
                  f"captured steps attend over {fl['mean_kv_attended']:.0f} slots on average "
                  f"(rounded up to {engine.KV_BUCKET}): {fl['kv_attended_bytes'] / 1e9:.4f} GB, "
                  f"{fl['kv_attended_bytes'] / (fl['hbm_gbps'] * 1e9) * 1e3:.3f} ms."]
    lines += ["", f"Top {len(r['top'])} kernels by time:", "",
              "| # | kernel | category | ms / step | calls / step | µs / call | share of busy |",
              "| ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    for i, k in enumerate(r["top"], 1):
        name = short_name(k["name"]).replace("|", "\\|")
        lines.append(f"| {i} | `{name}` | {k['category']} | {k['ms']:.4f} | {k['calls']:.2f} | "
                     f"{k['us_per_call']:.2f} | {k['share']:.1%} |")
    return "\n".join(lines + [""])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="tiny | qwen0.5b | gemma3-270m (default: tiny on CPU, qwen0.5b on CUDA)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--turns", type=int, default=0,
                    help="multi-turn episodes with model turns of about this many tokens (bench/rollout.py's rows)")
    ap.add_argument("--overlap-turns", choices=["on", "off"], default=None,
                    help="with --turns: one more decode step runs while the host answers (engine.OVERLAP_TURNS; "
                         "default: the engine's)")
    ap.add_argument("--fuse-record", choices=["on", "off"], default=None,
                    help="a decode step's bookkeeping in one Triton kernel (engine.FUSE_RECORD; default: the engine's)")
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="the card's HBM bandwidth (H200: 4800)")
    ap.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs (op by op)")
    ap.add_argument("--no-fuse", action="store_true",
                    help="keep one weight per projection (one GEMM each) instead of q|k|v and gate|up fused")
    ap.add_argument("--no-fuse-kernels", action="store_true",
                    help="RoPE and silu(gate) * up as torch ops, not in the Triton kernels (native.FUSE_KERNELS)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1 on CPU, as bench/rollout.py)")
    ap.add_argument("--results", default=None, help="append the markdown section to this file")
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--trace", default=None, help="write the profiler's chrome trace here")
    args = ap.parse_args(argv)
    dev = args.device
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (one decode step at least)")
    kind = args.model or ("qwen0.5b" if dev == "cuda" else "tiny")
    if args.threads or dev == "cpu":
        torch.set_num_threads(args.threads or 1)
    if args.no_fuse_kernels:
        native.FUSE_KERNELS = False
    if args.overlap_turns:
        engine.OVERLAP_TURNS = args.overlap_turns == "on"
    if args.fuse_record:
        engine.FUSE_RECORD = args.fuse_record == "on"
    model = build_model(kind, dev, fuse=not args.no_fuse)
    r = profile_decode(model, args.batch, args.prompt_len, args.new_tokens, dev, graphs=not args.no_graphs, turns=args.turns,
                       trace=args.trace, hbm_gbps=args.hbm_gbps, kind=kind)
    table = render(r)
    print(table)
    if args.results:
        with open(args.results, "a") as f:
            f.write(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return r


if __name__ == "__main__":
    main()
