"""LoRA adapters (peft) on any causal LM: only the adapters train, checkpoints hold the adapter.

Why the base always comes from the config's model path and never from a checkpoint: a LoRA
checkpoint is the adapter alone, so a resume wraps the same base with the saved adapter, and the
frozen reference of the RL / preference trainers is that base with the adapters disabled (no copy).
"""

from __future__ import annotations

import contextlib

from tether.errors import UserError


def apply_lora(model, spec, ckpt=None):
    """Wrap `model` with LoRA adapters per `spec` (any object with lora_r, lora_alpha, lora_dropout,
    lora_targets: the trainers' `model` section); from the adapter saved in `ckpt` when resuming."""
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
    except ImportError:
        raise UserError("lora_r > 0 needs peft: pip install 'tether[lora]'") from None
    if ckpt is not None:
        return PeftModel.from_pretrained(model, str(ckpt), is_trainable=True)
    targets = spec.lora_targets if spec.lora_targets == "all-linear" else \
        [t.strip() for t in spec.lora_targets.split(",") if t.strip()]
    return get_peft_model(model, LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha,
                                            lora_dropout=spec.lora_dropout,
                                            target_modules=targets, task_type="CAUSAL_LM"))


@contextlib.contextmanager
def adapters_off(model):
    """The base model under the adapters (the frozen reference of the RL / preference trainers),
    for the forwards inside: every adapter layer bypassed, as peft's `disable_adapter()` does, but
    without its `requires_grad_(False)` on the adapters. Why: under FSDP2 with the bf16
    mixed-precision policy, a sharded model's first forward fixes which parameters are trained
    (lazy init); when that forward was the reference's, peft's context had switched every trained
    parameter off, and the first backward then failed ("a gradient with dtype BFloat16 to a tensor
    with grad_dtype Float"). A model without adapters passes through unchanged."""
    layers = [m for m in model.modules() if hasattr(m, "_disable_adapters")]
    was = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m, w in zip(layers, was):
            m._disable_adapters = w
