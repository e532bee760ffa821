"""The policy forward every RL and preference trainer shares: per-token log-probs of the completion
tokens (and their entropy), with the LM head applied by us to the completion positions only, in
chunks, so no [N, V] logits or gradient are ever held (`completion_token_logps`).

Model compute, not training logic: it lives with the models so trainers, studies and benchmarks use
one implementation (docs/architecture.md, layers)."""

from __future__ import annotations

import contextlib

import torch

from tether.distributed import is_sharded
from tether.models import head_kernels

_KEEP_SUPPORT: dict[type, bool] = {}


def supports_logits_to_keep(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (every HF causal LM of transformers 5 does)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    t = type(base)
    if t not in _KEEP_SUPPORT:
        _KEEP_SUPPORT[t] = "logits_to_keep" in inspect.signature(base.forward).parameters
    return _KEEP_SUPPORT[t]


# Families whose logits are exactly lm_head(body(x)) (no soft-capping or logit scale; a config that sets
# either is refused in _split_head), so the head can be applied by us, chunk by chunk, to the completion
# positions only. Gemma 3 (gemma3_text): its embedding's sqrt(hidden) scale is in the embedding's forward,
# not in the tied weight, and its final norm is the body's; its 262k vocabulary makes the full
# [tokens, V] logits the largest tensor of a step.
_HEAD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt2", "gpt_neox", "phi3", "gemma3_text")
# Logits held at once by the chunked head: 2^25 (~220 tokens at V = 152k, 128 MB per float32
# temporary) on an accelerator, 2^22 on CPU (cache-sized). None: per device.
HEAD_CHUNK_ELEMENTS: int | None = None
# The chunked head's compute dtype under autocast. None: the autocast dtype (bf16 logits).
# torch.float32 (`model.head_fp32`, set by trainers/core/setup.py): the logits in float32 from the
# body's hidden states and the master weights. Why: rounding logits to bf16 is an error of up to
# |z|·2^-9 per logit, which grows as training sharpens the policy and its logits grow. Against an
# fp32 sampler the mismatch grows so on SmolLM2 (GRPO on an H200: mean |Δ log p| 0.03 -> 0.2
# nats/token over 10 steps, benchmarks/RESULTS.md); how much of that is the head's rounding rather
# than the bf16 body's is not measured (the hypothesis this option tests). MiniMax (2025, the MiniMax-M1
# report) reported the LM head's precision as the cause of such a mismatch and fixed it this way.
HEAD_DTYPE: torch.dtype | None = None

# model.offload_activations: a training forward's saved activations in pinned host memory
# (models/offload.py); the body's forward runs in its saved-tensor hooks. Set by setup for a run.
OFFLOAD_ACTIVATIONS = False


def saved_activations(device):
    """The context every training forward runs in (this module's, SFT's, the scalar-head models'):
    models.offload.host_activations when offloading and gradients are on, else nothing."""
    if OFFLOAD_ACTIVATIONS and torch.is_grad_enabled():
        from tether.models.offload import host_activations
        return host_activations(device)
    return contextlib.nullcontext()


def forward_inputs(batch: dict) -> dict:
    """The HF forward's token inputs of a batch. A packed one (tether.data.pack_batch) goes without
    an attention mask: from its position ids, which restart at each sequence, transformers 5
    builds a causal mask that is block-diagonal per sequence for sdpa and eager attention
    (masking_utils.find_packed_sequence_indices), and runs flash attention's varlen kernels on a
    one-row batch (modeling_flash_attention_utils._is_packed_sequence); given a mask, it would
    take the row for one sequence and let attention cross sequences. Call the model with
    use_cache=False: with a KV cache transformers skips the packed-sequence detection too."""
    packed = "sequence_ids" in batch
    return {"input_ids": batch["input_ids"], "attention_mask": None if packed else batch["attention_mask"],
            "position_ids": batch.get("position_ids")}


def packing_layout(model, enabled: bool) -> str:
    """tether.data.collate_sequences's `packing` for this model: "" (off), "row" (one row: flash
    attention, whose varlen kernels transformers uses only on a one-row batch; no mask at all),
    "rows" (sdpa / eager: rows no longer than the longest sequence, each with a dense mask, so
    the mask and the attention stay row-sized rather than [all tokens]^2)."""
    if not enabled:
        return ""
    impl = str(getattr(model.config, "_attn_implementation", None) or "")
    return "row" if "flash" in impl else "rows"


def uses_chunked_head(model, batch: dict) -> bool:
    """Whether :func:`completion_token_logps` applies the LM head itself, in chunks, to this batch
    (a plain linear head, and logits larger than one chunk): then no [tokens, V] logits exist."""
    split = _split_head(model)
    ids = batch["input_ids"]
    return split is not None and ids.numel() * split[1].out_features > _head_budget(ids.device)


def _split_head(model):
    """(body, lm_head) when the logits are plain lm_head(body(...).last_hidden_state), else None.
    Under PEFT the LoRA layers inside the body stay in place (and `disable_adapter` still works)."""
    m = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(m.config, "model_type", None) not in _HEAD_FAMILIES:
        return None
    if getattr(m.config, "final_logit_softcapping", None) or getattr(m.config, "logit_scale", None):
        return None
    body, head = getattr(m, getattr(m, "base_model_prefix", ""), None), m.get_output_embeddings()
    if body is None or not _plain_linear(head):
        return None
    return body, head


def _plain_linear(module) -> bool:
    """A torch Linear whose forward is Linear's: the class itself, or FSDP2's wrapper class of it
    (an untied head is an FSDP2 unit of its own: distributed.shard), not a subclass of other kinds
    (a LoRA or quantized layer computes something else)."""
    cls = type(module)
    if cls is torch.nn.Linear:
        return True
    return (isinstance(module, torch.nn.Linear) and cls.__bases__[-1] is torch.nn.Linear
            and "FSDP" in cls.__name__)


class _HeadLogps(torch.autograd.Function):
    """lp_i = log softmax(z_i / T)[y_i] and H_i = entropy(softmax(z_i / T)) with z_i = W h_i + b,
    one chunk of tokens at a time. Saves only h and two numbers per token (logsumexp, entropy);
    backward recomputes each chunk's logits once and writes
        dz'/T with dz' = g_lp (onehot(y) − p) − g_H p (log p + H),
        dh = dz W (by token chunks),   dW = dz^T h (by vocabulary chunks),
    so no [N, V] tensor is ever held (Liger's fused linear cross-entropy, for per-token outputs)."""

    @staticmethod
    def forward(ctx, h, w, b, targets, temperature: float, step: int, cd, want_ent: bool):
        ctx.set_materialize_grads(False)
        wc, bc = w.to(cd), (b.to(cd) if b is not None else None)
        N = h.shape[0]
        lp = torch.empty(N, dtype=torch.float32, device=h.device)
        lse, ent = torch.empty_like(lp), torch.empty_like(lp)
        for i in range(0, N, step):
            z = torch.nn.functional.linear(h[i:i + step].to(cd), wc, bc)
            if head_kernels.available(z):  # one read of the chunk, float32 math in registers
                lse[i:i + step], lp[i:i + step], ent[i:i + step] = head_kernels.softmax_stats(
                    z, targets[i:i + step], temperature, want_ent)
                continue
            z = z.float().div_(temperature)
            lse[i:i + step] = torch.logsumexp(z, -1)
            lp[i:i + step] = z.gather(-1, targets[i:i + step, None]).squeeze(-1) - lse[i:i + step]
            if want_ent:  # H = lse − Σ p z
                ent[i:i + step] = lse[i:i + step] - torch.softmax(z, -1).mul_(z).sum(-1)
        ctx.save_for_backward(h, w, b, targets, lse, ent)
        ctx.temperature, ctx.step, ctx.cd = temperature, step, cd
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        h, w, b, targets, lse, ent = ctx.saved_tensors
        T, step, cd = ctx.temperature, ctx.step, ctx.cd
        wc, bc = w.to(cd), (b.to(cd) if b is not None else None)
        N, V = h.shape[0], w.shape[0]

        g_lp = g_lp.float().contiguous() if g_lp is not None else None  # may be an expanded view
        g_ent = g_ent.float().contiguous() if g_ent is not None else None

        def dz(hc, rows, v0, v1):
            """dz for tokens `rows` over vocabulary columns v0..v1 ([n, v1 - v0], compute dtype)."""
            logp = torch.nn.functional.linear(hc, wc[v0:v1], bc[v0:v1] if bc is not None else None)
            if head_kernels.available(logp):  # written over the logits, no float32 temporaries
                return head_kernels.grad_in_place(logp, targets[rows], lse[rows], ent[rows],
                                                  None if g_lp is None else g_lp[rows],
                                                  None if g_ent is None else g_ent[rows], T, v0)
            logp = logp.float().div_(T).sub_(lse[rows, None])
            p = logp.exp()
            coef = g_lp[rows, None] if g_lp is not None else 0.0
            if g_ent is not None:
                coef = logp.add_(ent[rows, None]).mul_(g_ent[rows, None]).add_(coef)
            d = p.mul_(coef).neg_()
            if g_lp is not None:  # + g_lp at the target column (where it falls inside v0..v1)
                y = targets[rows] - v0
                inside = (y >= 0) & (y < v1 - v0)
                d.scatter_add_(-1, y.clamp(0, v1 - v0 - 1)[:, None], (g_lp[rows] * inside)[:, None])
            return d.div_(T).to(cd)

        dh = torch.empty_like(h)
        for i in range(0, N, step):  # dh = dz W, by token chunks
            rows = slice(i, i + step)
            dh[rows] = (dz(h[rows].to(cd), rows, 0, V) @ wc).to(h.dtype)
        dw = db = None
        if ctx.needs_input_grad[1] or (b is not None and ctx.needs_input_grad[2]):
            # dW = dz^T h by vocabulary chunks over all tokens: each row of dW is one GEMM with float32
            # accumulation (as in the full-logits path), no [V, H] accumulator summed chunk by chunk
            hc, vstep = h.to(cd), max(1, (step * V) // max(N, 1))
            if vstep < V:  # whole multiples of 128 columns: an odd width (16,303 at 7B) made each
                vstep = max(128, vstep - vstep % 128)  # chunk's rows unaligned, cuBLAS falls back to
                # an align-1 GEMM (39 ms of a 0.62 s 7B DPO step on an H200, in its profiler trace)
            into = grad_in_place(w) if ctx.needs_input_grad[1] else None
            dw = into if into is not None else torch.empty_like(w) if ctx.needs_input_grad[1] else None
            db = torch.empty_like(b) if b is not None and ctx.needs_input_grad[2] else None
            for v0 in range(0, V, vstep):
                v1 = min(V, v0 + vstep)
                d = dz(hc, slice(None), v0, v1)
                if into is not None and into.dtype == cd:  # + dz^T h, float32 accumulation, one rounding
                    into[v0:v1].addmm_(d.t(), hc)
                elif into is not None:
                    into[v0:v1] += d.t() @ hc
                elif dw is not None:
                    dw[v0:v1] = (d.t() @ hc).to(w.dtype)
                if db is not None:
                    db[v0:v1] = d.sum(0, dtype=torch.float32).to(b.dtype)
            if into is not None:
                dw = None  # already in w.grad
        return dh, dw, db, None, None, None, None, None


# Marks a parameter whose .grad is a persistent accumulator that only Tensor.backward adds into
# (trainers/core/common.flat_grad_buffer sets it): the chunked head may add its weight gradient there.
GRAD_IN_PLACE = "_tether_grad_in_place"


def grad_in_place(w) -> torch.Tensor | None:
    """`w.grad`, where the head's backward adds dW = dz^T h into it itself instead of returning it.
    Why: autograd holds a returned gradient until every use of the leaf has delivered its own and
    sums them first, and a tied head's weight is also the embedding, whose gradient comes last in
    the backward: the head's whole [V, H] dW stayed allocated through every layer's backward
    (Qwen2.5-0.5B: 0.27 GB, the largest transient at the GRPO step's peak, bench/memory_check.py
    --peak). Only where the trainer made `.grad` a persistent accumulator (GRAD_IN_PLACE, set by
    common.flat_grad_buffer) and nothing observes the gradient on its way (no tensor or
    post-accumulate hooks): the sum is the same, added in another order."""
    if not (getattr(w, GRAD_IN_PLACE, False) and w.is_leaf and w.requires_grad) or w.grad is None:
        return None
    if w._backward_hooks or w._post_accumulate_grad_hooks is not None:
        return None  # such hooks read the gradient as autograd delivers it
    g = w.grad
    return g if g.shape == w.shape and g.device == w.device and not g.requires_grad else None


def _head_budget(device) -> int:
    return HEAD_CHUNK_ELEMENTS or (1 << 22 if device.type == "cpu" else 1 << 25)


def _chunked_head(h, head, targets, temperature: float, entropy: str):
    """Per-token log-probs (and entropies) of `targets` [N] from hidden states `h` [N, H] through
    the linear `head`, never holding more than one chunk of logits (:class:`_HeadLogps`).
    `entropy`: "" (none), "detached" or "grad"."""
    step = max(1, _head_budget(h.device) // head.out_features)
    dev = h.device.type
    if HEAD_DTYPE is not None and torch.is_autocast_enabled(dev):  # the head outside autocast
        with torch.autocast(dev, enabled=False):
            lp, ent = _HeadLogps.apply(h.to(HEAD_DTYPE), head.weight, head.bias, targets, float(temperature),
                                       step, HEAD_DTYPE, bool(entropy))
        return lp, (None if not entropy else ent.detach() if entropy == "detached" else ent)
    cd = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else head.weight.dtype
    lp, ent = _HeadLogps.apply(h, head.weight, head.bias, targets, float(temperature), step, cd, bool(entropy))
    return lp, (None if not entropy else ent.detach() if entropy == "detached" else ent)


def _sharded_chunked_head(model, head, batch, idx, targets, temperature: float, mode: str):
    """`_chunked_head` for an FSDP2-sharded model. The head's weights are gathered only inside a
    call of its FSDP2 unit — the root's (a tied head, with the embeddings and final norm) or its
    own (an untied head, distributed.shard) — so the head runs *as* the model's `lm_head` during
    that call (its `forward` swapped for the chunked one, which returns the log-probs and entropies
    in place of logits). Being that unit's output, they get FSDP2's pre-backward hook: the head's
    weight is gathered (again, if resharded) before `_HeadLogps.backward` reads it, and its
    gradient is reduce-scattered with its unit's."""
    ids = batch["input_ids"]
    B, T = ids.shape

    def chunked(hidden):
        lp, ent = _chunked_head(hidden.reshape(B * T, -1).index_select(0, idx), head, targets,
                                temperature, mode)
        return torch.stack([lp.float(), ent.float() if ent is not None else torch.zeros_like(lp, dtype=torch.float32)])
    head.forward = chunked  # an instance attribute: nn.Module.__call__ finds it before the class's
    try:
        out = model(**forward_inputs(batch), use_cache=False).logits
    finally:
        del head.forward
    return out[0], (out[1] if mode else None)


def completion_token_logps(model, batch: dict, temperature: float, amp, want_entropy: bool = False,
                           entropy_grad: bool = False):
    """Per-token log-probs [B, T] aligned with `input_ids` (0 outside the completions: at prompt and
    padding positions), and the masked mean entropy of the completion tokens' distributions when
    asked (differentiable only with `entropy_grad`, for an entropy bonus; otherwise a detached number
    for logging).

    The LM head — the step's largest activation, [B, T, V] logits and as large a gradient — runs only
    on the completion tokens and in chunks (:func:`_chunked_head`) when the model's logits are a plain
    linear head over its body (Llama / Mistral / Qwen / GPT-2 families) and the logits would not fit
    in one chunk: at 16 × 256 completion tokens and a 152k vocabulary that is ~2.5 GB of bf16 logits
    and gradient not held. Otherwise: the HF forward with `logits_to_keep` from the first completion
    token. A packed batch (tether.data.pack_batch) works as is: its completion mask is 0 at each
    sequence's first token, so no position predicts across a boundary.
    """
    from tether.objectives import entropy_from_logits, token_logps

    ids, cmask = batch["input_ids"], batch["completion_mask"]
    B, T = ids.shape
    split = _split_head(model)
    if split is not None and B * T * split[1].out_features <= _head_budget(ids.device) and HEAD_DTYPE is None:
        split = None  # the logits fit in one chunk: the plain forward is as lean and a little faster
    if split is not None:
        body, head = split
        # flat positions t whose hidden state predicts a completion token t + 1 (one host sync)
        idx = torch.nn.functional.pad(cmask[:, 1:].bool(), (0, 1)).flatten().nonzero().squeeze(1)
        targets = ids.flatten().index_select(0, idx + 1)
        mode = ("grad" if entropy_grad and torch.is_grad_enabled() else "detached") if want_entropy else ""
        with amp:
            if is_sharded(model):
                lp, ent = _sharded_chunked_head(model, head, batch, idx, targets, temperature, mode)
            else:
                with saved_activations(ids.device):
                    h = body(**forward_inputs(batch), use_cache=False).last_hidden_state
                lp, ent = _chunked_head(h.reshape(B * T, -1).index_select(0, idx), head, targets,
                                        temperature, mode)
        logps = torch.zeros(B * T, dtype=torch.float32, device=ids.device)
        logps = logps.index_copy(0, idx + 1, lp.float()).view(B, T)
        return logps, (ent.mean() if ent is not None and ent.numel() else
                       (lp.new_zeros(()) if want_entropy else None))

    first = int(cmask.float().argmax(-1).min()) if bool(cmask.any()) else T
    start = max(first - 1, 0)  # logits at `start` predict the first completion token
    kw = {"logits_to_keep": T - start} if start > 0 and supports_logits_to_keep(model) else {}
    if not kw:
        start = 0
    with amp, saved_activations(ids.device):
        logits = model(**forward_inputs(batch), use_cache=False, **kw).logits
    part = token_logps(logits, ids[:, start:], temperature)
    logps = torch.cat([part.new_zeros(ids.shape[0], start), part], 1) if start else part
    logps = logps * torch.nn.functional.pad(cmask[:, 1:].to(logps.dtype), (1, 0))
    ent = None
    if want_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            z = logits[:, :-1] if entropy_grad else logits[:, :-1].detach()
            ent = entropy_from_logits(z, cmask[:, start + 1:], temperature)
    return logps, ent
