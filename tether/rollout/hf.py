"""Text in, text out: the helper the SFT trainer and the quickstart use for eval samples.

It runs on the rollout engine (native forward for Llama/Mistral/Qwen2/Qwen3/Gemma 3, HF forward + cache
for anything else) with Hugging Face `generate`'s text-level semantics: batched prompts are left-padded, completions are cut at EOS and decoded without special tokens.
Nothing is kept between calls (trainers that sample every step should hold a `Sampler`).
Sampling draws its seed from torch's global RNG, so a caller that forks/seeds that RNG (the SFT
trainer's evaluation does) gets reproducible samples.
"""

from __future__ import annotations

import torch

from .engine import Sampler


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 64,
             do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, batch_size: int = 64, add_bos: bool = True) -> list[str]:
    """Completions (text after the prompt, special tokens dropped) for each prompt."""
    if not prompts:
        return []
    sampler = Sampler(model, tokenizer, max_new_tokens=max_new_tokens,
                      temperature=temperature if do_sample else 0.0, top_p=top_p, top_k=top_k or 0,
                      max_batch_size=batch_size, add_bos=add_bos)
    try:
        return sampler.sample(list(prompts)).texts
    finally:
        sampler.release()  # stateless like the HF version: no cache or graphs kept between calls
