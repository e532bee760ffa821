"""TRL's side of bench/scale.py: one rank of GRPOTrainer / DPOTrainer under `accelerate launch`
with FSDP2, on the same random-init model, tokenizer, data and per-GPU batch as tether's runs.

    python bench/scale.py --shape qwen7b --gpus 4 --algos dpo --trl ...   # starts this file, one run a GPU count

bench/scale.py --trl writes the accelerate config (scale.ACCELERATE_FSDP2) and launches this file
as `accelerate launch --config_file <cfg> bench/scale_trl.py --worker --algo ... --model-dir ...`;
it needs trl, datasets, dill and multiprocess importable. Settings matched to tether's: fp32 master
weights with bf16 compute (accelerate mixed_precision=bf16 -> FSDP2 MixedPrecisionPolicy), FSDP2
per Qwen2DecoderLayer with reshard after forward, gradient checkpointing on, lr 1e-6, seed 0.
GRPO: β = 0, μ = 1, loss_type "dapo" (token mean), group-std rewards, temperature 1, no vLLM (TRL
generates with the FSDP2-wrapped model: what a user without vLLM gets), per device prompts ×
generations sequences per step in micro-batches of --micro-batch. DPO: sigmoid, β = 0.1, reference
log-probs precomputed (`precompute_ref_log_probs=True`, as tether), pairs per forward = micro-batch / 2.
Gradient reduction: accelerate's FSDP2 policy reduces in the compute dtype (bf16), tether in fp32
by default (model.fsdp_reduce); --reduce fp32 gives TRL tether's (its plugin's policy replaced), and
scale.py's `--set fsdp_reduce=bf16` gives tether TRL's: compare like with like.
Step time: on_step_begin -> on_step_end (CUDA-synchronized), median after --warmup; per-GPU peak
allocated / reserved memory over the whole train() call. Rank 0 writes <work>/trl-<algo><N>.json
(and <work>/trl-<algo><N>.steps.json as steps end, so a run cut off still reports them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

def worker(a) -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.t = [], None

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.times.append(time.perf_counter() - self.t)
            if int(os.environ.get("RANK", "0")) == 0:
                Path(a.work, f"trl-{a.algo}{N}.steps.json").write_text(json.dumps({"times": self.times}))
            print(f"[trl] step {len(self.times)}: {self.times[-1]:.2f} s", file=sys.stderr, flush=True)

    cuda = a.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    from accelerate.utils import FullyShardedDataParallelPlugin as Plugin
    from torch.distributed.fsdp import MixedPrecisionPolicy
    plain = Plugin.set_mixed_precision

    def set_policy(self, mixed_precision, *args, **kw):  # --reduce fp32: ours; and say what FSDP2 gets
        plain(self, mixed_precision, *args, **kw)
        p = self.mixed_precision_policy
        if a.reduce == "fp32" and isinstance(p, MixedPrecisionPolicy):
            self.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=p.param_dtype, reduce_dtype=torch.float32,
                                                               output_dtype=p.output_dtype)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[trl] FSDP2 policy: {self.mixed_precision_policy}", file=sys.stderr, flush=True)
    Plugin.set_mixed_precision = set_policy

    N = int(os.environ["WORLD_SIZE"])
    # from the file, with a cache folder every rank sees: TRL maps (tokenizes, caches reference
    # log-probs) on the main process first and the others read its cache files; an in-memory
    # Dataset's cache lives in a per-process temporary folder (rank 1 then fails to open it)
    data = load_dataset("json", data_files=str(a.data), split="train",
                        cache_dir=str(Path(a.work) / f"hf-cache-{a.algo}{N}"))
    tok = PreTrainedTokenizerFast.from_pretrained(a.model_dir)
    tok.padding_side = "left" if a.algo == "grpo" else "right"
    if a.algo == "dpo":
        tok.eos_token = "<2>"  # as ours: an EOS the model has (DPO appends it; nothing is sampled)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    timer = StepTimer()
    common = dict(output_dir=str(Path(a.work) / f"trl-{a.algo}{N}"), learning_rate=1e-6,
                  max_steps=a.warmup + a.steps, bf16=True, logging_steps=1, report_to="none",
                  save_strategy="no", gradient_checkpointing=True, seed=0, disable_tqdm=True,
                  dataloader_num_workers=0, use_cpu=not cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if a.algo == "grpo":
        from trl import GRPOConfig, GRPOTrainer
        seqs = a.per_gpu * a.generations
        args = GRPOConfig(per_device_train_batch_size=a.micro_batch,
                          gradient_accumulation_steps=seqs // a.micro_batch,
                          num_generations=a.generations, max_completion_length=a.new_tokens,
                          beta=0.0, loss_type="dapo", scale_rewards="group", temperature=1.0,
                          top_p=1.0, top_k=0, num_iterations=1, log_completions=False,
                          shuffle_dataset=False, **common)

        def reward(completions, **_):
            return [float(len(c) % 7) for c in completions]
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tok,
                              train_dataset=data, callbacks=[timer])
    else:
        from trl import DPOConfig, DPOTrainer
        pairs = max(1, min(a.per_gpu, a.micro_batch // 2))
        # model_init_kwargs: TRL 1.16 builds the reference itself (the policy is passed as an instance)
        # with create_model_from_path, whose device_map defaults to "auto" on a GPU and is reset to
        # None only for MULTI_GPU / DEEPSPEED, not FSDP: each rank would dispatch the 7B reference
        # over every visible GPU and the precompute fails ("index is on cuda:0, different from
        # other tensors on cuda:N"). device_map=None: loaded on the CPU, then sharded.
        args = DPOConfig(per_device_train_batch_size=pairs, gradient_accumulation_steps=a.per_gpu // pairs,
                         max_length=a.dpo_len + 8, beta=0.1, loss_type=["sigmoid"],
                         precompute_ref_log_probs=True, model_init_kwargs={"device_map": None}, **common)
        trainer = DPOTrainer(model=model, args=args, processing_class=tok,
                             train_dataset=data, callbacks=[timer])
    trainer.train()
    mem = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30) if cuda else (0.0, 0.0)
    peaks = [None] * N
    torch.distributed.all_gather_object(peaks, mem)
    if int(os.environ.get("RANK", "0")) == 0:
        warm = timer.times[a.warmup:] or timer.times
        Path(a.work, f"trl-{a.algo}{N}.json").write_text(json.dumps({
            "step_s": statistics.median(warm), "first_s": timer.times[0], "times": timer.times, "steps": len(warm),
            "peak_alloc_gib": max(p[0] for p in peaks), "peak_reserved_gib": max(p[1] for p in peaks)}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--algo", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reduce", choices=["bf16", "fp32"], default="bf16",
                    help="gradient reduce-scatter dtype: bf16 = accelerate's default, fp32 = tether's default")
    for k in ("per-gpu", "generations", "new-tokens", "dpo-len", "micro-batch", "steps", "warmup"):
        ap.add_argument(f"--{k}", type=int, required=True)
    a = ap.parse_args(argv)
    worker(a)


if __name__ == "__main__":
    main()
