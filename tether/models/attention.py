"""Training attention that never meets cuDNN's NaN backward (what a run installs on CUDA).

cuDNN's SDPA backward (PyTorch's default for a masked bf16/fp16 attention on H100/H200 since torch
2.11) writes NaN into the query gradient when all three hold (pytorch#196678; root cause in
cudnn-frontend#628): an explicit attention mask is passed, the key length is 64 more than a
multiple of 128, and some query row's log-sum-exp is below -ln(float32 max) ≈ -88.7. The kernel
walks keys in 128-wide tiles but masks out-of-range keys at a 64-wide granularity, so at those
lengths the zero-filled half tile is scored 0 instead of -inf and exp(0 - lse) overflows. Rows
with such a log-sum-exp are ordinary in our batches: a left-padded prompt's pad positions see no
key at all (-inf), and Qwen2.5 has "massive activation" heads (TRL's DPO hit it, trl#7181).
Unguarded, every GRPO step of SmolLM2 at 384 new tokens on an H200 has a NaN gradient (widths
448 = 3·128 + 64, left-padded rows); replayed, one such saved batch gives NaN with cuDNN only,
finite with the memory-efficient kernel, eager, or the padded rows removed (benchmarks/RESULTS.md).

Turning cuDNN attention off for the whole run makes the compiled DPO step 28 % slower on an H200
(0.0955 s vs 0.0745 s, two processes, a config without masks: `python bench/dpo_step.py --device
cuda --compile static --no-cudnn-attention` against the same without the flag). Instead, while a
run trains, transformers' "sdpa" attention gets 16 masked keys more whenever the key length is
≡ 64 (mod 128) and a mask is passed with gradients on: the result is the same (a masked key has
weight exactly 0) and the length is out of the kernel's bad case; every other shape runs on the
fastest kernel unchanged. Forwards without gradients (sampling, reference log-probs, `tether
eval`) never pad: the forward is right.
Under compile_layers the length test is a guard: the first batch of a bad length compiles the
layer graph once more (then both stay cached). On an H200 (torch 2.11, cuDNN 9.19), `pytest -m gpu
tests/test_attention_guard.py` (in `bash bench/gpu.sh tests`) passes: at key lengths 64, 192, 448,
704 and 1088 with every log-sum-exp below -88.7, unguarded cuDNN's query gradient is inf; guarded,
every gradient is finite and as close to a float64 answer as the memory-efficient kernel's, and a
left-padded Llama batch 448 wide trains with finite gradients."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

BAD_KEY_LENGTH = (128, 64)  # (tile, remainder): cuDNN's backward fails at key lengths ≡ 64 (mod 128)
EXTRA_KEYS = 16  # masked keys added there: 64 + 16 = 80 (mod 128), and a multiple of 16 stays one


def needs_extra_keys(query: torch.Tensor, key: torch.Tensor, mask) -> bool:
    """Whether this attention call is the backward's bad case: on CUDA, with a mask, with gradients,
    at a key length ≡ 64 (mod 128). (Without a mask transformers passes is_causal=True: clean.)"""
    tile, remainder = BAD_KEY_LENGTH
    return (mask is not None and query.is_cuda and torch.is_grad_enabled()
            and key.shape[-2] % tile == remainder)


def with_extra_keys(key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, n: int = EXTRA_KEYS):
    """key, value [B, H, T, D] and mask [..., Q, T] with `n` more keys that no query may see: zero
    keys and values, mask False (bool) or -inf (additive float mask: not the dtype's lowest value,
    which would give a fully masked query row's uniform weights to the new keys too)."""
    fill = False if mask.dtype == torch.bool else float("-inf")
    return (F.pad(key, (0, 0, 0, n)), F.pad(value, (0, 0, 0, n)), F.pad(mask, (0, n), value=fill))


def _safe(inner: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if needs_extra_keys(query, key, attention_mask):
            key, value, attention_mask = with_extra_keys(key, value, attention_mask)
            if kwargs.get("position_bias") is not None:  # (T5-style biases, added to the mask)
                kwargs["position_bias"] = F.pad(kwargs["position_bias"], (0, EXTRA_KEYS))
        return inner(module, query, key, value, attention_mask, *args, **kwargs)
    attention.tether_inner = inner
    return attention


def guard_attention_backward(device: torch.device) -> Callable[[], None]:
    """On CUDA, route transformers' "sdpa" attention (every model of the process: policy, reference,
    critic, reward model) through the key padding above; returns the call that puts the original
    back. Nothing happens on other devices, nor when a guard is already in place (a run inside a
    run's process: the outer one restores)."""
    from transformers.modeling_utils import AttentionInterface

    current = AttentionInterface._global_mapping.get("sdpa")
    if device.type != "cuda" or current is None or hasattr(current, "tether_inner"):
        return lambda: None
    mine = _safe(current)
    AttentionInterface.register("sdpa", mine)

    def restore():  # unless something else registered an "sdpa" since: then it stays
        if AttentionInterface._global_mapping.get("sdpa") is mine:
            AttentionInterface.register("sdpa", current)
    return restore
