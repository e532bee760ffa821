"""One weight buffer per projection group, so the sampler runs one GEMM where the model has several.

A decoder layer of the Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 families reads one input through three
attention projections (q, k, v) and two MLP projections (gate, up). :func:`fuse_projections`
re-lays each group's weights into one contiguous buffer, [W_q; W_k; W_v] (and [b_q; b_k; b_v] in a
second one when the projections have biases), and points every Parameter's ``.data`` at its row
block of that buffer: the Parameter objects, their shapes, dtypes and values stay as they were (bit
for bit), so the model's own forward, ``state_dict`` values, optimizers and in-place refreshes
(``copy_``) work as before. :func:`adjacent_rows` is the test the sampler's backend
(native.py, ``FUSE_PROJECTIONS``) makes when it is built: when a group's weights are consecutive
row blocks of one storage it runs ``F.linear`` once over the whole [N_q + N_k + N_v, hidden] view,
which reads the live parameters' memory — an in-place update of any of them is seen by the next
call, and a captured CUDA graph keeps reading the same addresses.

The trainers fuse the model they sample: the sampling copy, or in one process without one the
trained policy itself (setup.py), whose checkpoints are then written tensor by tensor
(``save_pretrained`` writes each row block as its own tensor; run.save_model_as the master
weights). A parameter re-homed afterwards (``p.data = ...``,
``load_state_dict(assign=True)``, ``.to(device)``) breaks the adjacency; the backend then goes back
to one GEMM per projection (never a stale view), and calling :func:`fuse_projections` again restores it.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def group(module, names) -> list[nn.Linear] | None:
    """``module``'s projections ``names`` when all of them are plain ``nn.Linear`` (not a LoRA/PEFT
    wrapper, not a quantized linear) over the same input, with weights of one dtype and device, and
    biases on all of them or on none; else None."""
    mods = [getattr(module, n, None) for n in names]
    if module is None or any(type(m) is not nn.Linear for m in mods):
        return None
    w0 = mods[0].weight
    if any(m.weight.dim() != 2 or m.weight.shape[1] != w0.shape[1] or m.weight.dtype != w0.dtype
           or m.weight.device != w0.device or m.weight.numel() == 0 for m in mods):
        return None
    biased = [m.bias is not None for m in mods]
    if any(biased) and not all(biased):
        return None
    if all(biased) and any(m.bias.dtype != mods[0].bias.dtype or m.bias.device != w0.device for m in mods):
        return None
    return mods


def adjacent_rows(tensors: list[Tensor]) -> Tensor | None:
    """The tensors as one view [sum of their rows, ...] when they are contiguous, consecutive row
    blocks of one storage (same dtype, device and row shape); else None. The view is detached (no
    autograd edge to the parameters) and shares their memory."""
    t0 = tensors[0]
    if not all(t.dtype == t0.dtype and t.device == t0.device and t.shape[1:] == t0.shape[1:]
               and t.is_contiguous() and t.numel() > 0 for t in tensors):
        return None
    storage, ptr = t0.untyped_storage().data_ptr(), t0.data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage or t.data_ptr() != ptr:
            return None
        ptr += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return t0.detach().as_strided((rows, *t0.shape[1:]), t0.stride(), t0.storage_offset())


def fused_view(mods: list[nn.Linear]) -> tuple[Tensor, Tensor | None] | None:
    """(weight [N_1 + ... + N_n, in], bias [N_1 + ... + N_n] or None) over ``mods``' parameters
    when :func:`fuse_projections` laid them out (or they are adjacent by construction); else None."""
    w = adjacent_rows([m.weight for m in mods])
    if w is None:
        return None
    biases = [m.bias for m in mods]
    if all(b is None for b in biases):
        return w, None
    b = adjacent_rows(biases) if all(b is not None for b in biases) else None
    return None if b is None else (w, b)


@torch.no_grad()
def _relayout(tensors: list[Tensor]) -> None:
    """Copy ``tensors`` (parameters) into one new buffer, in order, and point each one's .data at its part."""
    if adjacent_rows(tensors) is not None:
        return  # laid out already: nothing to copy
    buf = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for t in tensors:
        part = buf[offset:offset + t.numel()].view(t.shape)
        part.copy_(t)
        t.data = part
        offset += t.numel()


def fuse_projections(model) -> nn.Module:
    """Re-lay every decoder layer's q/k/v weights (and biases) and gate/up weights of ``model`` (a
    transformers causal LM of the Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 layout, or a PEFT wrapper of one)
    each into one contiguous buffer (module doc). Groups with a non-plain linear (LoRA) are left as
    they are. Values, shapes and Parameter objects are unchanged; returns ``model``.

    safetensors' ``save_model`` refuses the shared storage; ``save_pretrained`` and ``save_file``
    write each parameter as its own tensor."""
    m = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(m, "model", None), "layers", None)
    for layer in layers if layers is not None else ():
        for module, names in ((getattr(layer, "self_attn", None), QKV), (getattr(layer, "mlp", None), GATE_UP)):
            mods = group(module, names)
            if mods is None:
                continue
            _relayout([p.weight for p in mods])
            if mods[0].bias is not None:
                _relayout([p.bias for p in mods])
    return model
