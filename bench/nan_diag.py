"""Session 20: GRPO's gradient was NaN on every step of SmolLM2 with rollout.max_new_tokens=384 on
an H200 (compile on, bf16 autocast; the loss finite), never at 96. Which part makes it? One
forward + backward of `completion_token_logps` (GRPO's policy forward) on a synthetic
training batch shaped like those steps (256 rows, left-padded prompts, completions of a long-tail
length ending in EOS then padding, width padded to 16), SmolLM2's shape with random weights or a
real checkpoint (--model), over: compile off / on, max_new_tokens 96 / 384, the LM head's Triton
kernels on / off, attention sdpa / eager.

    python bench/nan_diag.py [--model DIR] [--rows 256]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tether.models import head_kernels  # noqa: E402
from tether.models.load import compile_layers  # noqa: E402
from tether.models.logprobs import completion_token_logps  # noqa: E402
from tether.rollout.types import Rollout  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
               rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0, pad_token_id=2,
               eos_token_id=2, bos_token_id=1)


def make_model(path: str | None, attn: str, device):
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    if path:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    else:
        m = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2), attn_implementation=attn)
    return m.to(device).float()


def make_batch(rows: int, T: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 49152, (int(torch.randint(30, 41, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    lengths = torch.randint(20, 90, (rows,), generator=g).clamp(max=T)
    lengths[torch.rand(rows, generator=g) < 0.05] = T  # the long tail: 5% run to the cap
    lengths[0] = T
    comp = torch.randint(3, 49152, (rows, T), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    for i, n in enumerate(lengths.tolist()):
        if n < T:
            comp[i, n - 1] = 2  # EOS is the last real token
    comp[~mask] = 2
    width = int(lengths.max())
    r = Rollout(prompt_ids=prompts, completion_ids=comp[:, :width], completion_mask=mask[:, :width],
                logprobs=torch.zeros(rows, width), texts=[""] * rows,
                finish_reasons=[""] * rows, group=torch.arange(rows), logprob_temperature=1.0, pad_token_id=2)
    return {k: v.to(device) for k, v in r.training_batch(16).items()}


def run(model, batch, amp):
    model.zero_grad(set_to_none=True)
    logps, _ = completion_token_logps(model, batch, 1.0, amp)
    cm = batch["completion_mask"].float()
    adv = torch.randn(cm.shape[0], 1, device=cm.device, generator=torch.Generator(cm.device).manual_seed(1))
    loss = -(logps * cm * adv).sum() / cm.sum()
    loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    return {"loss": float(loss.detach()), "logps_finite": bool(torch.isfinite(logps).all()), "grad_nonfinite": len(bad),
            "first_bad": bad[:3]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--attn", default="sdpa", help="comma-separated: sdpa,eager (eager at 256 rows × 384 tokens needs >139 GB)")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)
    triton_available = head_kernels.available
    results = []
    for attn, compiled in itertools.product(a.attn.split(","), [False, True]):
        model = make_model(a.model, attn, dev)
        if compiled:
            compile_layers(model)
        for T, kernels in itertools.product([96, 384], [True, False]):
            head_kernels.available = triton_available if kernels else (lambda z: False)
            batch = make_batch(a.rows, T, dev)
            r = {"attn": attn, "compile": compiled, "T": T, "width": batch["input_ids"].shape[1],
                 "head_kernels": kernels, **run(model, batch, amp)}
            print(json.dumps(r), flush=True)
            results.append(r)
            if a.json:
                Path(a.json).write_text(json.dumps(results, indent=1))
        head_kernels.available = triton_available
        del model


if __name__ == "__main__":
    main()
