"""Scaling on GPUs: `tether grpo` and `tether dpo` on 1, 2, 4 GPUs of one host (torchrun, FSDP2 or
plain replication), and with --trl TRL's GRPOTrainer / DPOTrainer (accelerate + FSDP2,
bench/scale_trl.py) on the same model, data and per-GPU batch.

    python bench/scale.py                                  # Qwen2.5-0.5B shape, grpo + dpo, 1/2/4 GPUs
    python bench/scale.py --shape tiny --gpus 1,2 --device cpu   # the same path on CPU (gloo), a smoke run

The benchmark rows (bench/gpu.sh scale runs them; --results/--json go under $OUT there):

    python bench/scale.py --shape qwen0.5b --gpus 1,2,4 --algos grpo --steps 4 --warmup 1 \\
        --keep-model /tmp/m05 --run-timeout 115                          # 0.5B GRPO weak scaling
    python bench/scale.py --shape qwen0.5b --gpus 1,2,4 --algos dpo --steps 5 --warmup 2 \\
        --keep-model /tmp/m05 --run-timeout 110                          # 0.5B DPO weak scaling
    python bench/scale.py --shape qwen0.5b --gpus 1,2,4 --algos dpo --steps 5 --warmup 3 \\
        --keep-model /tmp/m05 --run-timeout 55 --set fsdp=false --set compile=true   # replicated, compiled
    python bench/scale.py --shape qwen0.5b --gpus 1,2,4 --algos grpo --steps 3 --warmup 2 \\
        --keep-model /tmp/m05 --run-timeout 110 --set fsdp=false          # GRPO replicated
    python bench/scale.py --shape qwen0.5b --gpus 1 --algos grpo --steps 10 --warmup 3 --keep-model /tmp/m05 \\
        --run-timeout 190 --set compile=true --set queue.placement=interleaved --set queue.max_staleness=1
        # one GPU, interleaved sampling (queue.placement=auto, max_staleness=0: the synchronous loop)
    python bench/scale.py --shape qwen7b --gpus 4 --algos dpo --trl --steps 5 --warmup 2 --keep-model /tmp/m7 \\
        --run-timeout 200 --trl-timeout 280 --set fsdp_reduce=bf16       # 7B DPO vs TRL, bf16 reduce on both
    python bench/scale.py --shape qwen7b --gpus 4 --algos dpo --steps 5 --warmup 3 --keep-model /tmp/m7 \\
        --run-timeout 380 --set fsdp_reduce=bf16 --set compile=true      # 7B DPO compiled
    python bench/scale.py --shape qwen7b --gpus 4 --algos grpo --steps 2 --warmup 1 --keep-model /tmp/m7 \\
        --run-timeout 180 --set release_replica=true                     # 7B GRPO, replica released per update
        # (and without --set release_replica=true, --run-timeout 260: the default)

Weak scaling: the batch *per GPU* is fixed (--per-gpu prompts × --generations completions of
--new-tokens tokens; --per-gpu pairs of --dpo-len tokens per sequence), so N GPUs train on an N
times larger global batch per step; throughput = tokens trained per second of step time, speed-up
= throughput(N) / throughput(1). Models are random-init (no hub here) with a word-level
tokenizer whose EOS the model never samples, so every completion runs to --new-tokens tokens;
weights fp32 (sharded master copy) with bf16 compute and fp32 gradient reduction, gradient
checkpointing on, SDPA attention. GRPO: β = 0 (no reference), μ = 1, token-mean loss, group-std
advantages, samples from the rollout replica gathered after each step (`gather_time`, reported);
on one GPU from a bf16 sampling copy (rollout.sampler_copy), as every rank samples from its bf16
replica, so the one-GPU baseline of the speed-ups samples alike. DPO: sigmoid, β = 0.1, reference
log-probs precomputed (as `tether dpo` does).

Per run: median step time over the steps after --warmup, tokens/s (GRPO: prompt + completion
tokens trained; DPO: 2 · pairs · length), MFU = model FLOPs / (step time · GPUs · peak) with model
FLOPs = 6·P per trained token + 2·P per sampled or reference token (P = parameters without the
embedding; the peak is the card's dense bf16 number, 989 TFLOP/s on H100 SXM), and the largest
per-GPU peak of allocated and reserved memory. Checkpoints are not written (they are not part of
a step). Prints a markdown section (--results FILE also appends it there) and writes --json.
--profile, --trace, --cprofile and --world1 are diagnosis: rank 0's op tables, every rank's chrome
trace (open in Perfetto, ui.perfetto.dev), rank 0's cProfile, the one-GPU run as a one-rank FSDP2 group.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "tiny": dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True),
    # the 0.5B shape's depth with negligible compute: per-op overhead on CPU
    "thin24": dict(vocab_size=1024, hidden_size=64, num_hidden_layers=24, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True),
    "qwen0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    "qwen7b": dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False),
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM


def build(shape: str, out: Path, device: str) -> None:
    """A random-init Qwen2 model of `shape` (bf16, as published) and a word-level tokenizer over
    its vocabulary ("<i>"), with an EOS outside it (never sampled)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    spec = SHAPES[shape]
    cfg = Qwen2Config(**spec, rope_theta=1e6, max_position_embeddings=32768, bos_token_id=None,
                      eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda" if device == "cuda" else "cpu"):  # 7B: init on the GPU, seconds not minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if shape not in ("tiny", "thin24") else torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    del model
    if device == "cuda":  # this process stays alive through the runs: give the GPU's memory back
        torch.cuda.empty_cache()
    V = spec["vocab_size"]
    vocab = {f"<{i}>": i for i in range(V)}
    vocab["<eos>"] = V
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<1>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<0>", unk_token="<1>")
    fast.model_max_length = 1 << 20
    fast.save_pretrained(out)


def words(g: torch.Generator, n: int, length: int, vocab: int) -> list[str]:
    ids = torch.randint(10, vocab, (n, length), generator=g)
    return [" ".join(f"<{i}>" for i in row.tolist()) for row in ids]


def write_data(a, work: Path, N: int) -> Path:
    vocab = SHAPES[a.shape]["vocab_size"]
    g = torch.Generator().manual_seed(1)
    steps = a.warmup + a.steps
    if a.algo == "grpo":
        rows = [{"prompt": p} for p in words(g, a.per_gpu * N * steps, a.prompt_len, vocab)]
    else:
        half = a.dpo_len // 2
        n = a.per_gpu * N * steps
        rows = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in
                zip(words(g, n, half, vocab), words(g, n, a.dpo_len - half, vocab),
                    words(g, n, a.dpo_len - half, vocab))]
    path = work / f"{a.algo}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reward(completions, **_):
    """Cheap and varied (so advantages are non-zero): the completion's text length mod 7."""
    return [float(len(c) % 7) for c in completions]


def worker(a) -> None:
    """One rank of one run (under torchrun): the tether command in this process, tokenizer and
    checkpoints patched (see the module doc), then the per-rank peak memory gathered to rank 0."""
    from transformers import PreTrainedTokenizerFast

    from tether import cli, distributed
    from tether.trainers.core import setup

    def load_tok(path, **_):  # AutoTokenizer would rebuild it as Qwen2's BPE (model_type qwen2)
        tok = PreTrainedTokenizerFast.from_pretrained(a.model_dir)
        tok.padding_side = "right"
        if a.algo == "dpo":  # DPO appends EOS to completions: one the model has (sampling never runs)
            tok.eos_token = "<2>"
        return tok
    setup.load_tokenizer = load_tok
    setup.Training.checkpoint = lambda self: Path(self.run.path)
    N = int(os.environ.get("WORLD_SIZE", "1"))
    args = [a.algo, f"model={a.model_dir}", f"data={a.data}", f"runs_dir={a.work}", f"name={a.algo}{N}",
            f"max_steps={a.warmup + a.steps}", "lr=1e-6", "progress=false", "log_every=1", "seed=0",
            f"gradient_checkpointing={a.grad_ckpt}", f"device={a.device}", "num_samples=0",
            "overwrite=true", f"batch_size={a.per_gpu * N}"]
    if a.algo == "grpo":
        args += [f"num_generations={a.generations}", f"max_new_tokens={a.new_tokens}",
                 f"max_prompt_length={a.prompt_len}", "loss_agg=token-mean", "beta=0",
                 f"micro_batch_size={a.micro_batch}", "reward_funcs=[bench/scale.py:reward]"]
        if N == 1:  # sample from a bf16 copy, as every rank does from its replica: a rollout from
            # the fp32 weights takes 1.49 s against the ranks' 0.57 s (0.5B, 4 × H200) and flatters
            # every speed-up
            args.append("sampler_copy=true")
    else:  # batch_size = pairs per forward; grad_accum makes the global batch per_gpu × N pairs
        pairs = max(1, min(a.per_gpu, a.micro_batch // 2))
        args[-1] = f"batch_size={pairs}"
        args += [f"max_length={a.dpo_len + 8}", f"grad_accum={a.per_gpu * N // pairs}"]
    args += a.set or []  # --set k=v: any tether key (e.g. fsdp_reshard=false), for diagnosis
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    prof = _profiler(a, N) if a.profile else (_tracer(a, N) if a.trace else None)
    keep = cli._leave_process_group
    if a.world1:  # diagnosis: FSDP2 and the group's code paths in ONE process (a one-rank group)
        import torch.distributed as dist
        if a.device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("cuda:nccl,cpu:gloo" if a.device == "cuda" else "gloo")
        distributed.active = lambda: dist.is_initialized()  # from here every `distributed.active()` says yes
        shard = distributed.shard

        def said(model, layers, **kw):  # the log shows it sharded
            print(f"world1: FSDP2 over {len(layers)} layers, {kw}", flush=True)
            return shard(model, layers, **kw)
        distributed.shard = said
    distributed.init()  # joined here, so the CLI keeps the group and the peaks gather over every rank
    if a.cprofile:  # rank 0's Python profile of the whole command (pstats file)
        import cProfile
        pr = cProfile.Profile()
        pr.enable()
    code = cli.main(args) if not distributed.active() else _in_group(cli, args)
    if a.cprofile and distributed.rank() == 0:
        pr.disable()
        Path(a.cprofile).mkdir(parents=True, exist_ok=True)
        pr.dump_stats(str(Path(a.cprofile, f"{a.algo}{N}{'-world1' if a.world1 else ''}.pstats")))
    if prof is not None:
        prof.__exit__(None, None, None)
    mem = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30) \
        if a.device == "cuda" else (0.0, 0.0)
    peaks = distributed.all_gather_object(mem) if distributed.active() else [mem]
    if distributed.rank() == 0:
        assert len(peaks) == N, f"peaks of {len(peaks)} ranks, {N} expected"
        Path(a.work, f"{a.algo}{N}.json").write_text(json.dumps({"code": code, "peaks": peaks}))
    if distributed.active():
        keep()  # the group left as the CLI leaves it (barrier, destroy)
    sys.exit(code)


def _profiler(a, N: int):
    """torch.profiler over steps warmup+1 .. warmup+2 of rank 0 (stepped by each metrics row
    rank 0 logs); writes <profile>/<algo><N>-<set>.txt: the top ops by self CUDA and self CPU time,
    and the CUDA-busy share of the profiled wall time (how launch/CPU-bound the step is)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from tether import distributed, run
    if distributed.rank() != 0:
        return None
    tag = f"{a.algo}{N}" + ("-" + "_".join(a.set).replace("=", "-") if a.set else "")

    def ready(p):
        ev = p.key_averages()
        cuda = sum(e.self_device_time_total for e in ev) / 1e6  # µs -> s (kernels; overlapping streams add up)
        steps = [r for r in times if r is not None][-2:]
        text = (f"{tag}: profiled steps' step_time {steps}; summed self CUDA time {cuda:.3f} s\n\n"
                + ev.table(sort_by="self_device_time_total", row_limit=40) + "\n\n"
                + ev.table(sort_by="self_cpu_time_total", row_limit=30))
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        Path(a.profile, tag + ".txt").write_text(text)

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=a.warmup, warmup=1, active=2, repeat=1), on_trace_ready=ready)
    prof.__enter__()
    times: list = []
    log = run.RunDir.log

    def stepping(self, step, metrics, *rest, **kw):
        out = log(self, step, metrics, *rest, **kw)
        if "step_time" in metrics:
            times.append(metrics["step_time"])
            prof.step()
        return out
    run.RunDir.log = stepping
    return prof


def _tracer(a, N: int):
    """torch.profiler on *every* rank over the optimizer updates warmup+1 .. warmup+2 (stepped by
    Training.guarded_step, which every rank calls: one update a step for DPO and GRPO with μ = 1,
    more for GRPO μ > 1 and PPO, whose window then covers fewer steps; needs warmup + 2 updates in
    the run, else no trace is written); writes <trace>/<algo><N>[-<set>]-rank<r>.json.gz,
    chrome traces whose timestamps share the host's monotonic clock, so the ranks' traces line up
    side by side (which one reaches each collective last)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from tether.trainers.core import setup
    rank = int(os.environ.get("RANK", "0"))
    tag = f"{a.algo}{N}" + ("-" + "_".join(a.set).replace("=", "-") if a.set else "")

    def ready(p):
        Path(a.trace).mkdir(parents=True, exist_ok=True)
        p.export_chrome_trace(str(Path(a.trace, f"{tag}-rank{rank}.json.gz")))

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    # the profiler's own warm-up step is the last of --warmup: steps warmup+1, warmup+2 are traced
    # record_shapes: which tensors the casts and copies move (a step's ToCopyBackward / linear-to
    # copies cannot be attributed without shapes)
    prof = profile(activities=acts, record_shapes=True,
                   schedule=schedule(wait=max(0, a.warmup - 1), warmup=1, active=2, repeat=1),
                   on_trace_ready=ready)
    prof.__enter__()
    step = setup.Training.guarded_step  # every trainer's update goes through it, on every rank

    def stepping(self, *args, **kw):
        try:
            return step(self, *args, **kw)
        finally:
            prof.step()
    setup.Training.guarded_step = stepping
    return prof


def _in_group(cli, args):
    """cli.main leaves the process group at its end; the peaks are gathered after, so rejoin-free:
    run the command's body with the group kept (see cli._leave_process_group)."""
    keep = cli._leave_process_group
    cli._leave_process_group = lambda: None
    try:
        return cli.main(args)
    finally:
        cli._leave_process_group = keep


def launch(a, N: int) -> dict:
    """One run on N processes; its numbers from metrics.jsonl and the worker's peaks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(N),
           "--master-port", str(a.port_base + N), __file__, "--worker", "--algo", a.algo,
           "--shape", a.shape, "--model-dir", str(a.model_dir), "--work", str(a.work),
           "--data", str(a.data), "--device", a.device, "--per-gpu", str(a.per_gpu),
           "--generations", str(a.generations), "--new-tokens", str(a.new_tokens),
           "--prompt-len", str(a.prompt_len), "--dpo-len", str(a.dpo_len),
           "--micro-batch", str(a.micro_batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--grad-ckpt", a.grad_ckpt] + (["--profile", a.profile] if a.profile else []) \
        + (["--trace", a.trace] if a.trace else []) + (["--world1"] if a.world1 else []) \
        + (["--cprofile", a.cprofile] if a.cprofile else []) \
        + [x for kv in (a.set or []) for x in ("--set", kv)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    if a.device == "cpu":
        env["TETHER_DIST_BACKEND"] = "gloo"
    proc = run_capped(cmd, cwd=ROOT, env=env, timeout=a.run_timeout)
    if a.log_dir:
        Path(a.log_dir).mkdir(parents=True, exist_ok=True)
        Path(a.log_dir, f"{a.shape}-{a.algo}{N}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode:
        said = [ln for ln in proc.stderr.splitlines() if "error:" in ln] or proc.stderr.splitlines()[-1:]
        return {"error": " / ".join(said)[-1500:]}
    rows = [json.loads(x) for x in (a.work / f"{a.algo}{N}" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time" in r]
    warm = rows[a.warmup:]
    step = statistics.median(r["step_time"] for r in warm)
    peaks = json.loads((a.work / f"{a.algo}{N}.json").read_text())["peaks"]
    trained = tokens_per_step(a, N)
    gather = statistics.median(r.get("gather_time", 0.0) for r in warm) if a.algo == "grpo" else 0.0
    return {"gpus": N, "step_s": step, "tokens_per_s": trained / step, "gather_s": gather,
            "mfu": mfu(a, N, step), "steps": len(warm),
            "peak_alloc_gib": max(p[0] for p in peaks), "peak_reserved_gib": max(p[1] for p in peaks),
            "rollout_s": statistics.median(r.get("rollout/seconds", 0.0) for r in warm),
            **({"sampler_copy": True} if a.algo == "grpo" and N == 1 else {})}  # (worker: sampler_copy=true)


def run_capped(cmd, timeout=None, **kw) -> subprocess.CompletedProcess:
    """subprocess.run in its own process session; past `timeout` seconds the whole session (the
    launcher and its ranks) is killed and the result says so (returncode 124, stderr "error: timeout")."""
    import signal
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout or None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, 124, out, (err or "") + f"\nerror: timeout after {timeout:.0f} s")
    except BaseException:  # this process stopped (SIGTERM from an outer timeout, ^C): its runs too
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# TRL's side (bench/scale_trl.py): accelerate's FSDP2 configuration, N processes
ACCELERATE_FSDP2 = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: bf16
num_machines: 1
num_processes: {n}
main_process_port: {port}
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Qwen2DecoderLayer
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_activation_checkpointing: false
"""


def launch_trl(a, N: int) -> dict:
    """One TRL run on N GPUs (accelerate launch of bench/scale_trl.py); its numbers, or {"error": ...}."""
    cfg = Path(a.work) / f"accelerate{N}.yaml"
    cfg.write_text(ACCELERATE_FSDP2.format(n=N, port=29600 + N))
    steps = a.steps if a.trl_steps is None else a.trl_steps
    warmup = a.warmup if a.trl_warmup is None else a.trl_warmup
    out, partial = Path(a.work) / f"trl-{a.algo}{N}.json", Path(a.work) / f"trl-{a.algo}{N}.steps.json"
    for f in (out, partial):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
           str(ROOT / "bench" / "scale_trl.py"),
           "--worker", "--algo", a.algo, "--model-dir", str(a.model_dir), "--data", str(a.data),
           "--work", str(a.work), "--per-gpu", str(a.per_gpu), "--generations", str(a.generations),
           "--new-tokens", str(a.new_tokens), "--dpo-len", str(a.dpo_len),
           "--micro-batch", str(a.micro_batch), "--steps", str(steps), "--warmup", str(warmup),
           "--device", a.device, "--reduce", a.trl_reduce]
    t0 = time.perf_counter()
    proc = run_capped(cmd, timeout=a.trl_timeout or None)
    if a.log_dir:
        Path(a.log_dir).mkdir(parents=True, exist_ok=True)
        Path(a.log_dir, f"trl-{a.algo}{N}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode or not out.exists():
        tail = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln][-3:]
        res = {"error": " / ".join(tail)[-1500:] or proc.stderr[-1500:], "wall_s": round(time.perf_counter() - t0, 1)}
        if partial.exists():  # a run cut off: the steps it finished (rank 0 writes them as they end)
            times = json.loads(partial.read_text())["times"]
            if times:
                warm = times[warmup:] or times
                res.update(step_s=statistics.median(warm), first_s=times[0], times=times, steps=len(warm),
                           peak_alloc_gib=None, peak_reserved_gib=None)
        return res
    return json.loads(out.read_text())


def mfu(a, N: int, step: float) -> float:
    """Model FLOPs per step over what N cards do in `step` seconds: GRPO 6·P per trained token +
    2·P per sampled one (prompt + completion counted for both), DPO 6·P per trained token."""
    P = non_embedding_params(a.shape)
    flops = (8 if a.algo == "grpo" else 6) * P * tokens_per_step(a, N)
    return flops / (step * N * peak_flops(a.device))


def tokens_per_step(a, N: int) -> int:
    """Tokens trained per step on N GPUs (GRPO: prompt + completion of every sequence)."""
    if a.algo == "grpo":
        return a.per_gpu * N * a.generations * (a.prompt_len + a.new_tokens)
    return 2 * a.per_gpu * N * a.dpo_len


def non_embedding_params(shape: str) -> int:
    s = SHAPES[shape]
    h, L, i = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i  # q, o; k, v; gate, up, down
    return L * per_layer + h * s["vocab_size"]  # + the LM head's matmul (the embedding is a lookup)


def peak_flops(device: str) -> float:
    if device != "cuda":
        return 1e12  # nominal: MFU on CPU is not meaningful
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), 989.0) * 1e12


def peak(r: dict) -> str:
    if r.get("peak_alloc_gib") is None:
        return "— (run cut off)"
    return f"{r['peak_alloc_gib']:.1f} / {r['peak_reserved_gib']:.1f}"


def _layout(a) -> str:
    """How tether's runs shared the model (the --set overrides of fsdp and fsdp_reduce)."""
    sets = {k.split(".")[-1]: v for k, _, v in (kv.partition("=") for kv in (a.set or []))}
    if sets.get("fsdp") == "false":
        return "replicated (fsdp=false: fp32 weights, bf16 autocast, gradients all-reduced)"
    return f"FSDP2 (fp32 master, bf16 compute, {sets.get('fsdp_reduce', 'fp32')} reduce)"


def render(a, results: dict) -> str:
    name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU (gloo)"
    lines = [f"## scale-out: {a.shape}, weak scaling (per GPU: GRPO {a.per_gpu} prompts × "
             f"{a.generations} × ({a.prompt_len} + {a.new_tokens}) tokens; DPO {a.per_gpu} pairs × "
             f"{a.dpo_len} tokens)", "",
             f"Card: {name}. Date: {datetime.date.today().isoformat()}. torch {torch.__version__}. "
             f"{_layout(a)}, gradient checkpointing {a.grad_ckpt}, "
             f"micro-batch {a.micro_batch}, median of {a.steps} steps after {a.warmup} warm-up. "
             f"Command: `python bench/scale.py {' '.join(sys.argv[1:])}`", "",
             "| algo | GPUs | s/step | tokens/s | speed-up | efficiency | MFU | replica gather (s) | "
             "rollout (s) | peak alloc / reserved per GPU (GiB) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    notes = []
    for algo, runs in results.items():
        for who in ("tether", "trl"):
            mine = [r for r in runs if r.get("who", "tether") == who]
            base = next((r for r in mine if r.get("gpus") == 1 and "error" not in r), None)
            for r in mine:
                label = algo if who == "tether" else f"TRL {algo}" + (" (fp32 reduce)" if r.get("reduce") == "fp32" else "")
                if "error" in r and "step_s" not in r:
                    lines.append(f"| {label} | {r['gpus']} | failed: {r['error'][:300]} |")
                    continue
                if r.get("steps") is not None:
                    label += f" ({r['steps']} step{'s' if r['steps'] != 1 else ''})"
                up = r["tokens_per_s"] / base["tokens_per_s"] if base else None
                speed = f"{up:.2f}×" if up else "—"
                eff = f"{up / r['gpus']:.0%}" if up else "—"
                mfu = f"{r['mfu']:.1%}" if "mfu" in r else "—"
                gather = f"{r['gather_s']:.3f}" if "gather_s" in r else "—"
                rollout = f"{r['rollout_s']:.3f}" if "rollout_s" in r else "—"
                lines.append(f"| {label} | {r['gpus']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                             f"{speed} | {eff} | {mfu} | {gather} | {rollout} | "
                             f"{peak(r)} |")
        ours = {r["gpus"]: r for r in runs if r.get("who", "tether") == "tether" and "step_s" in r}
        for r in runs:
            if r.get("who") == "trl" and "step_s" in r and r["gpus"] in ours:
                theirs = "?" if r.get("peak_alloc_gib") is None else f"{r['peak_alloc_gib']:.1f}"
                notes.append(f"- {algo} on {r['gpus']} GPU(s): tether {r['step_s'] / ours[r['gpus']]['step_s']:.2f}× "
                             f"TRL's speed at {ours[r['gpus']]['peak_alloc_gib']:.1f} vs "
                             f"{theirs} GiB peak allocated per GPU")
    return "\n".join(lines + [""] + notes) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="qwen0.5b", choices=list(SHAPES))
    ap.add_argument("--algos", default="grpo,dpo")
    ap.add_argument("--algo", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--gpus", default="1,2,4")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--per-gpu", type=int, default=None, help="prompts (GRPO) / pairs (DPO) per GPU per step")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--dpo-len", type=int, default=1024, help="tokens per DPO sequence (prompt + completion)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--grad-ckpt", default="true")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--work", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--results", default=None, help="append the markdown section to this file (default: printed only)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trl", action="store_true", help="also run TRL's trainers (bench/scale_trl.py)")
    ap.add_argument("--trl-only", action="store_true", help="TRL's runs alone (with --trl; tether's skipped)")
    ap.add_argument("--trl-reduce", choices=["bf16", "fp32"], default="bf16",
                    help="TRL's gradient reduce dtype: bf16 = accelerate's FSDP2 default; fp32 = tether's default "
                         "(model.fsdp_reduce; `--set fsdp_reduce=bf16` gives tether accelerate's)")
    ap.add_argument("--trl-steps", type=int, default=None, help="TRL's measured steps (default --steps)")
    ap.add_argument("--trl-warmup", type=int, default=None, help="TRL's warm-up steps (default --warmup)")
    ap.add_argument("--trl-timeout", type=float, default=0, help="seconds before a TRL run is killed (0: none); "
                    "the steps it finished are still reported")
    ap.add_argument("--log-dir", default=None, help="write each run's stdout and stderr here")
    ap.add_argument("--run-timeout", type=float, default=0, help="seconds before one tether run is killed (0: none)")
    ap.add_argument("--profile", default=None, help="write rank 0's torch.profiler tables of 2 steps here")
    ap.add_argument("--trace", default=None, help="write every rank's chrome trace of 2 steps here "
                                                  "(timestamps on the host's monotonic clock)")
    ap.add_argument("--world1", action="store_true", help="diagnosis: the 1-GPU run in a one-rank process "
                    "group, so it is sharded with FSDP2 like the N-GPU runs (separates FSDP2's own cost from N processes')")
    ap.add_argument("--cprofile", default=None, help="write rank 0's cProfile stats of the command here")
    ap.add_argument("--port-base", type=int, default=29500, help="torchrun's port is this + N (two concurrent "
                    "scale.py calls need different bases)")
    ap.add_argument("--set", action="append", default=None, help="extra tether key=value for every run (diagnosis)")
    ap.add_argument("--keep-model", default=None, help="build the model into this folder once and reuse it "
                    "(a later call with the same folder skips the build); default: a temporary folder")
    a = ap.parse_args(argv)
    if not a.worker:  # an outer `timeout` sends SIGTERM: exit through run_capped, which kills the runs
        import signal
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    big = a.shape == "qwen7b"
    a.per_gpu = a.per_gpu or (2 if big else 8 if a.shape == "qwen0.5b" else 2)
    a.new_tokens = a.new_tokens or (512 if big else 256 if a.shape == "qwen0.5b" else 16)
    if a.shape == "tiny":
        a.prompt_len, a.dpo_len, a.generations = min(a.prompt_len, 16), min(a.dpo_len, 32), min(a.generations, 4)
    if a.worker:
        a.work = Path(a.work)
        return worker(a)
    results = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TETHER_BENCH_TMP")) as tmp:
        a.work = Path(tmp)
        a.model_dir = Path(a.keep_model) if a.keep_model else a.work / "model"
        if not (a.model_dir / "tokenizer.json").exists():  # the tokenizer is written last
            t0 = time.perf_counter()
            build(a.shape, a.model_dir, a.device)
            print(f"built {a.shape} in {time.perf_counter() - t0:.1f} s -> {a.model_dir}", flush=True)
        for algo in a.algos.split(","):
            a.algo = algo
            results[algo] = []
            for N in (int(n) for n in a.gpus.split(",")):
                a.data = write_data(a, a.work, N)
                if not a.trl_only:
                    t0 = time.perf_counter()
                    r = launch(a, N)
                    r.update(gpus=N, wall_s=round(time.perf_counter() - t0, 1))
                    results[algo].append(r)
                    print(f"{algo} × {N}: {json.dumps(r)[:400]}", flush=True)
                if a.trl:
                    t0 = time.perf_counter()
                    t = launch_trl(a, N)
                    t.update(gpus=N, who="trl", reduce=a.trl_reduce, wall_s=round(time.perf_counter() - t0, 1))
                    if "step_s" in t:
                        t["tokens_per_s"] = tokens_per_step(a, N) / t["step_s"]
                        t["mfu"] = mfu(a, N, t["step_s"])
                    results[algo].append(t)
                    print(f"trl {algo} × {N}: {json.dumps(t)[:400]}", flush=True)
    table = render(a, results)
    print(table)
    if a.results:
        with open(a.results, "a") as f:
            f.write(table + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "args": {k: str(v) for k, v in vars(a).items()}}, indent=1))


if __name__ == "__main__":
    main()
