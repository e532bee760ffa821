"""Rollout engine: sample completions with exact per-token log-probs (docs/rollout.md).

    from tether.rollout import Sampler, SamplingConfig
    sampler = Sampler(model, tokenizer, SamplingConfig(max_new_tokens=128, temperature=0.8))
    ro = sampler.sample(["2+3=", "7*6="], n=4, seed=0, stop=["\\n"])
    ro.texts, ro.completion_ids, ro.completion_mask, ro.logprobs, ro.finish_reasons, ro.group

``tether.rollout.hf.generate`` keeps the old text-in / text-out helper on top of this engine.
"""
from .engine import Sampler, sample
from .native import NATIVE_FAMILIES, native_support
from .sampling import SamplingConfig, sample_tokens
from .types import Rollout, logprob_mismatch

__all__ = ["Sampler", "SamplingConfig", "Rollout", "sample", "sample_tokens", "logprob_mismatch",
           "native_support", "NATIVE_FAMILIES"]
