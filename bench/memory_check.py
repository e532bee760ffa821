"""Predicted vs measured GPU memory per process: `tether memory` against a few real trainer steps.

One command per configuration; the model is random-init at a real shape, built here (no hub):

    python bench/memory_check.py --algo sft --shape qwen2.5-0.5b                          # 1 GPU
    torchrun --nproc-per-node 2 bench/memory_check.py --algo sft --shape qwen2.5-0.5b      # 2 GPUs, FSDP2
    torchrun --nproc-per-node 4 bench/memory_check.py --algo sft --shape qwen2.5-0.5b --sharding replicate
    torchrun --nproc-per-node 4 bench/memory_check.py --algo sft --shape qwen2.5-7b --gradient-checkpointing \\
        --batch-size 2 --seq-len 2048
    torchrun --nproc-per-node 2 bench/memory_check.py --algo grpo --shape qwen2.5-0.5b

    python bench/memory_check.py --dry                 # no GPU: every planned configuration (PLAN below)
                                                       # with its command and predictions for 1, 2, 4 GPUs
    python bench/memory_check.py --dry --algo dpo --gpus 8   # one configuration's predictions

Each rank measures `torch.cuda.max_memory_allocated()` in two windows: loading (setup, up to the
moment the models are sharded: setup._start is wrapped to read and reset the peak there) and the
rest of the run (training steps, rollouts, the final checkpoint). It also reads what the device
holds outside PyTorch's allocator (`mem_get_info` used minus `memory_reserved`): once after the
first CUDA work (the CUDA context) and once at the end (context + NCCL). Rank 0 prints one JSON line
with the prediction (tether.memory.estimate of the matching MemoryConfig) beside every rank's
numbers, and appends it to --out. The data makes every sequence exactly --seq-len tokens (SFT/DPO:
texts longer than max_length, truncated; GRPO: the EOS is never sampled in practice, 1/vocab).

DPO in tether caches the reference log-probs (a fresh run's reference is the initial policy), so
it is planned with precompute_ref=true. GRPO runs with beta=0 and a cheap function reward (no
reference, no reward model) and skip_zero_advantage=false, so every sequence is trained on.
On CPU (`--device cpu`, gloo under torchrun) the run exercises the script; measured numbers are null.

    ... --snapshot --cap-gb 13.9    # out of memory on purpose just below the peak: prints what is
                                    # live then, summed by where it was allocated (rank 0)
    ... --peak 400000               # the last 400,000 allocations and frees recorded: what was live at
                                    # the highest point among them, summed by where it was allocated

The benchmark rows (bench/gpu.sh memory runs them, on MEM_GPUS processes: 1, 2 or 4), e.g.

    torchrun --nproc-per-node 2 bench/memory_check.py --device cuda --steps 3 --shape qwen2.5-0.5b \
        --algo dpo --batch-size 2 --grad-accum 4 --seq-len 1024
    torchrun --nproc-per-node 4 bench/memory_check.py --device cuda --steps 3 --shape qwen2.5-0.5b \
        --algo ppo --prompts 16 --generations 1 --prompt-len 128 --new-tokens 384 --minibatches 4 \
        --gradient-checkpointing
    torchrun --nproc-per-node 4 bench/memory_check.py --device cuda --steps 3 --shape qwen2.5-7b \
        --algo sft --batch-size 2 --grad-accum 4 --seq-len 1024 --gradient-checkpointing --weights-from /tmp/m7
    python bench/memory_check.py --scale-json FILE     # predictions beside bench/scale.py's measured peaks

Results: benchmarks/memory_check.jsonl, benchmarks/memory/ and docs/memory.md ("Many GPUs").
A trainer that cannot run under torchrun fails in that trainer, not here.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# as the tether CLI sets it (tether/cli.py), before torch is imported: the trainers run in-process here
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from scale import SHAPES as _SCALE  # noqa: E402 - bench/scale.py's shapes, under this script's names

SHAPES = {
    "tiny": dict(_SCALE["tiny"], vocab_size=512),
    "qwen2.5-0.5b": _SCALE["qwen0.5b"],
    "qwen2.5-7b": _SCALE["qwen7b"],
}

# The configurations to measure on 1, 2 and 4 GPUs (`--dry` prints them all).
PLAN = [
    "--algo sft --shape qwen2.5-0.5b --batch-size 4 --grad-accum 4 --seq-len 1024",
    "--algo sft --shape qwen2.5-0.5b --batch-size 4 --grad-accum 4 --seq-len 1024 --sharding replicate",
    "--algo sft --shape qwen2.5-0.5b --batch-size 4 --grad-accum 4 --seq-len 1024 --fsdp-offload",
    "--algo sft --shape qwen2.5-0.5b --batch-size 4 --grad-accum 4 --seq-len 1024 --no-reshard",
    "--algo sft --shape qwen2.5-0.5b --batch-size 4 --grad-accum 4 --seq-len 1024 --lora-r 16",
    "--algo dpo --shape qwen2.5-0.5b --batch-size 2 --grad-accum 4 --seq-len 1024",
    "--algo grpo --shape qwen2.5-0.5b --prompts 16 --generations 8 --prompt-len 128 --new-tokens 384 --micro-batch 16",
    "--algo sft --shape qwen2.5-7b --batch-size 2 --grad-accum 4 --seq-len 2048 --gradient-checkpointing",
]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algo", choices=["sft", "dpo", "grpo", "ppo"], default="sft")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--sharding", choices=["fsdp", "replicate"], default="fsdp", help="replicate = fsdp=false")
    p.add_argument("--fsdp-offload", action="store_true")
    p.add_argument("--no-reshard", action="store_true", help="fsdp_reshard=false")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="model.dtype (fp32: bf16 mixed precision)")
    p.add_argument("--batch-size", type=int, default=4, help="sft/dpo: micro-batch (rows; dpo: pairs)")
    p.add_argument("--grad-accum", type=int, default=1, help="sft/dpo: micro-batches per step in one process")
    p.add_argument("--seq-len", type=int, default=1024, help="sft/dpo: tokens per sequence")
    p.add_argument("--prompts", type=int, default=16, help="grpo: prompts per step")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=384)
    p.add_argument("--micro-batch", type=int, default=0, help="grpo: sequences per forward/backward (0 = all)")
    p.add_argument("--minibatches", type=int, default=4, help="ppo: minibatches per rollout batch (one update each)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--offload-activations", action="store_true", help="model.offload_activations (one GPU)")
    p.add_argument("--lora-r", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tether_memory_check"))
    p.add_argument("--weights-from", default=None,
                   help="a model folder of the same shape (bench/scale.py --keep-model): its weights are linked, "
                        "not rebuilt (a 7B build costs a minute)")
    p.add_argument("--out", default="benchmarks/memory_check.jsonl")
    p.add_argument("--dry", action="store_true", help="print configurations and predictions only (no GPU)")
    p.add_argument("--scale-json", action="append", default=[],
                   help="bench/scale.py --json results: the planner's prediction beside each run's measured "
                        "per-GPU peak (no GPU; one JSON line per run, as the measured ones)")
    p.add_argument("--gpus", default="1,2,4", help="--dry: GPU counts to predict for")
    p.add_argument("--snapshot", action="store_true",
                   help="record allocations; on out-of-memory print what is live, grouped by where it was allocated")
    p.add_argument("--peak", type=int, default=0, metavar="N",
                   help="record the last N allocations and frees; after the run print what was live at the "
                        "highest allocated point among them, summed by where it was allocated (rank 0)")
    p.add_argument("--compile", action="store_true", help="model.compile (the layers compiled)")
    p.add_argument("--cap-gb", type=float, default=0.0,
                   help="cap each process's allocator at this many GB (with --snapshot: see what is live near the peak)")
    return p.parse_args(argv)


def memory_config(a, gpus: int, model: str):
    """The `tether memory` question that matches this run (tether.memory.MemoryConfig)."""
    from tether.memory import MemoryConfig
    online = a.algo in ("grpo", "ppo")
    # ppo: one forward/backward per minibatch (a rank takes its rows of it); the KL penalty needs
    # the reference (ppo.kl_coef 0.05, the default), a separate value model is built from the policy
    micro = a.prompts * a.generations // a.minibatches if a.algo == "ppo" else (a.micro_batch or a.prompts * a.generations)
    return MemoryConfig(
        model=model, algo=a.algo, weight_dtype=a.dtype, optimizer="adamw" if a.dtype == "fp32" else "adamw_bf16",
        lora=a.lora_r > 0, lora_rank=max(a.lora_r, 1), gradient_checkpointing=a.gradient_checkpointing,
        offload_activations=getattr(a, "offload_activations", False),
        batch_size=micro if online else a.batch_size,
        grad_accum=1 if online else a.grad_accum,
        seq_len=a.prompt_len + a.new_tokens if online else a.seq_len,
        rollout_batch=a.prompts, num_generations=a.generations, reward="verifier",
        beta=0.05 if a.algo == "ppo" else 0, value_init="separate",
        precompute_ref=True, gpus=gpus, sharding=a.sharding if gpus > 1 else "none",
        fsdp_offload=a.fsdp_offload, fsdp_reshard=not a.no_reshard, format="json")


def write_config(shape: str, out: Path) -> Path:
    """config.json only (what `tether memory` reads): no weights."""
    out.mkdir(parents=True, exist_ok=True)
    qwen2_config(shape).save_pretrained(out)
    return out


def build_model(shape: str, out: Path, device: str, weights_from: str | None = None) -> None:
    """Random-init Qwen2 weights (bf16 on disk; the trainer loads them as --dtype) and a word-level
    tokenizer over the whole vocabulary: "<0>" ... "<V-1>", pad <0>, EOS <1> (inside the vocabulary:
    SFT appends it to completions; GRPO samples it with probability ~1/V)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if (out / "done").exists():
        return
    cfg = qwen2_config(shape)
    if weights_from:  # the same shape's weights (bench/scale.py's model): linked; config and tokenizer ours
        out.mkdir(parents=True, exist_ok=True)
        for f in Path(weights_from).glob("*.safetensors*"):
            (out / f.name).unlink(missing_ok=True)
            (out / f.name).symlink_to(f.resolve())
        cfg.torch_dtype = "bfloat16"
        cfg.save_pretrained(out)
    else:
        torch.manual_seed(0)
        with torch.device(device):  # on the GPU: a 7B init takes seconds instead of minutes
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
        model.save_pretrained(out)
        del model
    V = cfg.vocab_size
    tok = Tokenizer(models.WordLevel(vocab={f"<{i}>": i for i in range(V)}, unk_token="<2>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<1>", pad_token="<0>", unk_token="<2>")
    fast.model_max_length = 1 << 20
    fast.save_pretrained(out)
    (out / "done").write_text("")
    if device == "cuda":
        torch.cuda.empty_cache()


def qwen2_config(shape: str):
    from transformers import Qwen2Config
    return Qwen2Config(**SHAPES[shape], bos_token_id=None, eos_token_id=1, pad_token_id=0,
                       rope_theta=1e6, max_position_embeddings=32768)


def words(rng, n: int, vocab: int) -> str:
    return " ".join(f"<{rng.randrange(10, vocab)}>" for _ in range(n))


def write_data(a, path: Path, rows: int) -> None:
    import random
    rng, V = random.Random(0), SHAPES[a.shape]["vocab_size"]
    with open(path, "w") as f:
        for _ in range(rows):
            if a.algo == "sft":  # longer than max_length: truncated to exactly seq_len tokens
                row = {"prompt": words(rng, 16, V), "completion": words(rng, a.seq_len, V)}
            elif a.algo == "dpo":
                row = {"prompt": words(rng, 16, V), "chosen": words(rng, a.seq_len, V),
                       "rejected": words(rng, a.seq_len, V)}
            else:  # grpo, ppo
                row = {"prompt": words(rng, a.prompt_len, V)}
            f.write(json.dumps(row) + "\n")


def reward(completions, **_):
    """Cheap and varied: the completion's text length mod 7."""
    return [float(len(c) % 7) for c in completions]


def trainer(a, model_dir: Path, data: Path, runs: Path):
    """(config, train function) for the run, built with tether's own config loader."""
    from tether.config import load_config
    common = {"model": str(model_dir), "data": str(data), "runs_dir": str(runs), "name": a.algo,
              "overwrite": True, "dtype": a.dtype, "device": a.device, "gradient_checkpointing": a.gradient_checkpointing,
              "offload_activations": getattr(a, "offload_activations", False),
              "compile": getattr(a, "compile", False), "lora_r": a.lora_r, "fsdp": a.sharding == "fsdp", "fsdp_offload": a.fsdp_offload,
              "fsdp_reshard": not a.no_reshard, "max_steps": a.steps, "progress": False, "log_every": 1,
              "save_every": 0, "num_samples": 0, "lr": 1e-6, "keep_last": 1}
    if a.algo == "grpo":
        from tether.trainers.grpo import GRPOConfig, train_grpo
        cfg = load_config(GRPOConfig, overrides={
            **common, "batch_size": a.prompts, "num_generations": a.generations, "max_new_tokens": a.new_tokens,
            "max_prompt_length": a.prompt_len, "micro_batch_size": a.micro_batch, "beta": 0.0,
            "skip_zero_advantage": False, "log_entropy": False})
        return cfg, lambda: train_grpo(cfg, reward_funcs=[reward])
    if a.algo == "ppo":
        from tether.trainers.ppo import PPOConfig, train_ppo
        cfg = load_config(PPOConfig, overrides={
            **common, "batch_size": a.prompts, "num_generations": a.generations, "max_new_tokens": a.new_tokens,
            "max_prompt_length": a.prompt_len, "ppo_epochs": 1, "num_minibatches": a.minibatches})
        return cfg, lambda: train_ppo(cfg, reward_funcs=[reward])
    over = {**common, "batch_size": a.batch_size, "grad_accum": a.grad_accum, "max_length": a.seq_len}
    if a.algo == "sft":
        from tether.trainers.sft import SFTConfig, train_sft
        cfg = load_config(SFTConfig, overrides=over)
        return cfg, lambda: train_sft(cfg)
    from tether.trainers.preference.offline import DPOConfig, train_offline
    cfg = load_config(DPOConfig, overrides=over)
    return cfg, lambda: train_offline(cfg)


def predict(a, gpus: int, config_dir: Path) -> dict:
    from tether.memory import estimate
    est = estimate(memory_config(a, gpus, str(config_dir)))
    t = est["totals_gb"]
    return {"peak_gb": t["peak"], "loading_gb": t.get("loading"), "training_step_gb": t["training_step"],
            "rollout_gb": t["rollout"], "outside_allocator_gb": t.get("outside_allocator"),
            "components_gb": {x["component"]: round(x["gb"], 4) for x in est["components"] if x["device"] == "gpu"}}


def command(argline: str, gpus: int) -> str:
    run = "python" if gpus == 1 else f"torchrun --nproc-per-node {gpus}"
    return f"{run} bench/memory_check.py {argline}"


def dry(a, argv) -> None:
    """Predictions for PLAN, or for the one configuration the other arguments describe."""
    rest, skip = [], False
    for x in argv:  # drop --dry and --gpus N / --gpus=N: the rest is the configuration
        if skip or x == "--dry" or x.startswith("--gpus"):
            skip = x == "--gpus"
            continue
        rest.append(x)
    lines = [" ".join(shlex.quote(x) for x in rest)] if rest else PLAN
    gpus = [int(g) for g in a.gpus.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for line in lines:
            b = parse(shlex.split(line))
            config_dir = write_config(b.shape, Path(tmp) / b.shape)
            for n in gpus:
                try:
                    pred = predict(b, n, config_dir)
                except ValueError as e:  # e.g. a global batch that does not divide among n GPUs
                    pred = {"error": str(e)}
                print(json.dumps({"command": command(line, n), "gpus": n, "predicted": pred}))


def from_scale(path: str) -> list[dict]:
    """Predicted vs measured for the runs of one bench/scale.py --json file. Its runs are
    configurations of their own: GRPO (per GPU `per_gpu` prompts x G, micro-batch 8, beta 0, one
    process sampling from the training model, N from the bf16 replica) and DPO (pairs of `dpo_len`
    tokens, reference log-probs precomputed), fp32 weights, gradient checkpointing as given. The
    peak there is max_memory_allocated over the whole rank process, in GiB (converted to GB here).
    Its `--set` overrides that the planner models are read (fsdp=false, fsdp_reduce, release_replica),
    and a one-GPU GRPO row's `sampler_copy` (bench/scale.py samples from a bf16 copy there; a row
    without the key sampled the fp32 weights)."""
    from tether.memory import MemoryConfig, estimate
    d = json.loads(Path(path).read_text())
    if "args" not in d or "results" not in d:  # (a file assembled by hand has neither)
        raise SystemExit(f"{path}: not a bench/scale.py --json file (no args / results)")
    a = d["args"]
    shape = {"qwen0.5b": "qwen2.5-0.5b", "qwen7b": "qwen2.5-7b"}.get(a["shape"], a["shape"])
    per_gpu, micro, G = int(a["per_gpu"]), int(a["micro_batch"]), int(a["generations"])
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        config_dir = str(write_config(shape, Path(tmp)))
        for algo, runs in d["results"].items():
            for r in runs:
                if r.get("who", "tether") != "tether" or r.get("peak_alloc_gib") is None:
                    continue
                N = r["gpus"]
                given = a.get("set")  # (scale.py writes its arguments as strings: "['fsdp=false']")
                given = ast.literal_eval(given) if isinstance(given, str) and given.startswith("[") else given
                # tether keys as --set gave them, bare or qualified (model.fsdp_reduce=bf16)
                sets = {k.split(".")[-1]: v for k, _, v in (str(x).partition("=") for x in (given or []))} \
                    if isinstance(given, list) else {}
                sharding = "none" if N == 1 else "replicate" if sets.get("fsdp") == "false" else "fsdp"
                common = dict(model=config_dir, algo=algo, weight_dtype="fp32", optimizer="adamw",
                              gradient_checkpointing=a["grad_ckpt"] == "true", gpus=N, sharding=sharding,
                              fsdp_reduce=sets.get("fsdp_reduce", "fp32") if sharding == "fsdp" else "fp32",
                              format="json")
                if algo == "grpo":  # (one GPU: a bf16 sampling copy where the row says so)
                    cfg = MemoryConfig(**common, batch_size=micro, seq_len=int(a["prompt_len"]) + int(a["new_tokens"]),
                                       rollout_batch=per_gpu * N, num_generations=G, reward="verifier", beta=0,
                                       release_replica=N > 1 and sets.get("release_replica") == "true",
                                       sampler_copy=bool(r.get("sampler_copy")))
                else:
                    pairs = max(1, min(per_gpu, micro // 2))
                    cfg = MemoryConfig(**common, batch_size=pairs, grad_accum=per_gpu * N // pairs,
                                       seq_len=int(a["dpo_len"]), precompute_ref=True)
                pred = estimate(cfg)["totals_gb"]["peak"]
                meas = r["peak_alloc_gib"] * 2**30 / 1e9
                out.append({"bench": "scale", "source": path, "shape": shape, "algo": algo, "gpus": N,
                            "grad_ckpt": a["grad_ckpt"], "predicted_peak_gb": round(pred, 3),
                            "measured_peak_gb": round(meas, 3), "measured_over_predicted": round(meas / pred, 3)})
    return out


def outside_allocator_gb(device: str):
    import torch
    if device != "cuda":
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 1e9


def _site(frames: list) -> str:
    """Where an allocation was asked for: the innermost frame in FSDP / torch.optim / checkpointing,
    else in transformers / tether, then which step of ours called it."""
    tiers = (("fsdp/", "torch/optim/", "utils/checkpoint"), ("transformers/", "tether/", "bench/"), ("torch/",))
    f = next((f for keys in tiers for f in frames if any(k in f["filename"] for k in keys)),
             frames[0] if frames else None)
    site = f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" if f else "?"
    caller = next((g for g in frames if "tether/" in g["filename"]), None)  # which step of ours
    if caller is not None and caller is not f:
        site += f" <- {caller['filename'].split('tether/')[-1]}:{caller['line']} {caller['name']}"
    return site


def by_site(blocks, top: int = 25) -> list[str]:
    """(size, frames) pairs summed by `_site`, largest first, one line each."""
    sites: dict = {}
    for size, frames in blocks:
        n, total = sites.get(_site(frames), (0, 0))
        sites[_site(frames)] = (n + 1, total + size)
    rows = sorted(sites.items(), key=lambda kv: -kv[1][1])[:top]
    return [f"{size / 1e9:8.3f} GB {n:6d}x  {site}" for site, (n, size) in rows]


def live_by_site(snapshot: dict, top: int = 25) -> list[str]:
    """Live allocations of a torch.cuda.memory._snapshot(), summed by where they were asked for."""
    return by_site(((b["size"], b.get("frames") or []) for seg in snapshot["segments"]
                    for b in seg["blocks"] if b["state"] == "active_allocated"), top)


def live_at_peak(snapshot: dict, device: int = 0) -> tuple[int, list, str]:
    """(bytes, [(size, frames)], frames of the allocation that made it) at the moment the most
    memory was allocated within the recorded history: the blocks live when the snapshot was taken,
    walked back through the trace (an `alloc` undone removes its block, a `free_completed` undone
    puts it back). Only a peak inside the recorded window is found (max_entries)."""
    live = {}
    for seg in snapshot["segments"]:
        if seg["device"] != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                live[addr] = (b["size"], b.get("frames") or [])
            addr += b["size"]
    events = [e for e in snapshot["device_traces"][device] if e["action"] in ("alloc", "free_completed")]

    def undo(e):
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
            return -e["size"]
        live[e["addr"]] = (e["size"], e.get("frames") or [])
        return e["size"]

    total = best = sum(s for s, _ in live.values())
    at = len(events)  # the state after events[:at]
    for i in range(len(events) - 1, -1, -1):
        total += undo(events[i])
        if total > best:
            best, at = total, i
    for e in events[:at]:  # replay forward to the peak (the walk back emptied what it undid)
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames") or [])
        else:
            live.pop(e["addr"], None)
    last = events[at - 1].get("frames") or [] if at else []
    return best, list(live.values()), _site(last)


def measure(a) -> None:
    import torch

    from tether import distributed
    from tether.trainers.core import setup

    distributed.init()
    rank, world = distributed.rank(), distributed.world_size()
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --dry (predictions only) or --device cpu")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.ones(256, 256, device="cuda").matmul(torch.ones(256, 256, device="cuda"))  # context + cuBLAS
        torch.cuda.synchronize()
    context = outside_allocator_gb(a.device)
    work = Path(a.workdir)
    model_dir, data = work / f"model-{a.shape}", work / f"{a.algo}-{a.shape}-{a.seq_len}-{a.prompt_len}.jsonl"
    if rank == 0:  # the others wait: one copy of the model on disk
        work.mkdir(parents=True, exist_ok=True)
        build_model(a.shape, model_dir, a.device, a.weights_from)
        rows_per_step = a.prompts if a.algo in ("grpo", "ppo") else a.batch_size * a.grad_accum
        write_data(a, data, rows_per_step * (a.steps + 1))
    distributed.barrier()

    from transformers import PreTrainedTokenizerFast

    def load_tok(path, **_):  # AutoTokenizer would rebuild it as Qwen2's BPE tokenizer (config.json)
        tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
        tok.padding_side = "right"
        return tok
    setup.load_tokenizer = load_tok
    load_peak = {}
    start = setup._start

    def start_after_sharding(*args, **kw):  # the models are loaded and sharded: close the load window
        if a.device == "cuda":
            load_peak["gb"] = torch.cuda.max_memory_allocated() / 1e9
            torch.cuda.reset_peak_memory_stats()
        return start(*args, **kw)
    setup._start = start_after_sharding

    cfg, train = trainer(a, model_dir, data, work / f"runs-{world}")
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        if a.cap_gb:
            torch.cuda.set_per_process_memory_fraction(a.cap_gb * 1e9 / torch.cuda.get_device_properties().total_memory)
        if a.snapshot or a.peak:  # --peak: the allocation's stack only (a free's would replace it)
            torch.cuda.memory._record_memory_history(max_entries=a.peak or 100000, stacks="python",
                                                     context="alloc" if a.peak else "all")
    t0 = time.perf_counter()
    try:
        train()
    except torch.OutOfMemoryError:
        if a.snapshot and rank == 0:
            print(f"out of memory at {torch.cuda.memory_allocated() / 1e9:.2f} GB allocated; live by site:")
            print("\n".join(live_by_site(torch.cuda.memory._snapshot())), flush=True)
        raise
    seconds = time.perf_counter() - t0
    if a.peak and rank == 0:
        peak, live, last = live_at_peak(torch.cuda.memory._snapshot(), torch.cuda.current_device())
        print(f"allocated peak in the recorded window {peak / 1e9:.3f} GB, reached by {last}; live then:")
        print("\n".join(by_site(live, top=40)), flush=True)
    step_times = []
    if rank == 0:
        metrics = work / f"runs-{world}" / a.algo / "metrics.jsonl"
        if metrics.exists():
            step_times = [r["step_time"] for r in map(json.loads, metrics.read_text().splitlines()) if "step_time" in r]
    mine = {"rank": rank, "load_peak_gb": load_peak.get("gb"), "seconds": round(seconds, 1),
            "run_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if a.device == "cuda" else None,
            "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if a.device == "cuda" else None,
            "cuda_context_gb": context, "outside_allocator_gb": outside_allocator_gb(a.device)}
    ranks = distributed.all_gather_object(mine)
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            pred = predict(a, world, write_config(a.shape, Path(tmp)))
        peaks = [max(r["load_peak_gb"] or 0, r["run_peak_gb"] or 0) for r in ranks]
        line = {"bench": "memory_check", "date": time.strftime("%Y-%m-%d %H:%M"),
                "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                "gpus": world, "args": {k: v for k, v in vars(a).items() if k not in ("dry", "gpus", "workdir", "out")},
                "predicted": pred, "measured": ranks,
                "measured_peak_gb": max(peaks) if a.device == "cuda" else None,
                "step_times": [round(t, 4) for t in step_times],
                "measured_over_predicted": round(max(peaks) / pred["peak_gb"], 3) if a.device == "cuda" else None}
        print(json.dumps(line))
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(line) + "\n")
    if distributed.active():
        torch.distributed.destroy_process_group()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.scale_json:
        for path in a.scale_json:
            for row in from_scale(path):
                print(json.dumps(row))
        return
    if a.dry:
        dry(a, argv)
    else:
        measure(a)


if __name__ == "__main__":
    main()
