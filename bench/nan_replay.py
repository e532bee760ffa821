"""Session 20's NaN, replayed: the training batch of SmolLM2's first GRPO step at 384 new tokens
(saved on the H200 by bench/nan_dump.py: 256 rows × 448, 96 of them left-padded by one token, 27
running to the cap) through GRPO's policy forward and loss, on a GPU, under variations, to find
what makes the gradient non-finite there (on this 2-core CPU the same batch, row by row, gives a
finite gradient; synthetic batches of the same shape — bench/nan_diag.py — did not reproduce it on
the H200, with random or real weights).

    python bench/nan_replay.py --model /tmp/smollm2 --batch bench/nan_batches/batch1.pt --json OUT.json

Each case: one forward + backward of the on-policy GRPO loss (ratio ≡ 1, token-mean over the
step's mask, the step's advantages), reporting whether the loss, the log-probs and every
parameter's gradient are finite, and the first decoder layer (from the top, as backward reaches
them) whose output gradient is not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tether.models import head_kernels  # noqa: E402
from tether.models.load import compile_layers, decoder_layers  # noqa: E402
from tether.models.logprobs import completion_token_logps  # noqa: E402


def case(model, tensors, mask, adv, rows, amp, backends=None, micro: int = 0) -> dict:
    model.zero_grad(set_to_none=True)
    layers = decoder_layers(model)
    first_bad: list[int] = []

    def hook(i):
        def fn(module, grad_input, grad_output):
            g = grad_output[0]
            if g is not None and not torch.isfinite(g).all() and not first_bad:
                first_bad.append(i)
        return fn
    handles = [layer.register_full_backward_hook(hook(i)) for i, layer in enumerate(layers)]
    from torch.nn.attention import sdpa_kernel
    ctx = sdpa_kernel(backends) if backends else contextlib.nullcontext()
    total = mask[rows].sum()
    loss_sum, lp_ok = 0.0, True
    try:
        with ctx:
            parts = [rows] if not micro else [rows[i:i + micro] for i in range(0, len(rows), micro)]
            for part in parts:
                sub = {k: v[part] for k, v in tensors.items()}
                lp, _ = completion_token_logps(model, sub, 1.0, amp)
                lp_ok &= bool(torch.isfinite(lp).all())
                ratio = torch.exp(lp - lp.detach())
                loss = -(ratio * adv[part] * mask[part]).sum() / total
                loss.backward()
                loss_sum += float(loss.detach())
    except Exception as e:  # noqa: BLE001 - a backend that refuses the inputs is a result too
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    finally:
        for h in handles:
            h.remove()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    return {"loss": loss_sum, "logps_finite": lp_ok, "grads_nonfinite": len(bad), "first_bad_layer": first_bad[:1],
            "bad_params": bad[:3]}


def bisect(model, tensors, mask, adv, rows, amp) -> list[int]:
    """A small set of rows that alone gives a non-finite gradient (halving while one half does);
    [] when all of `rows` together give a finite one."""
    if not case(model, tensors, mask, adv, rows, amp).get("grads_nonfinite"):
        return []
    while len(rows) > 1:
        half = len(rows) // 2
        for part in (rows[:half], rows[half:]):
            if case(model, tensors, mask, adv, part, amp).get("grads_nonfinite"):
                rows = part
                break
        else:
            break  # needs rows from both halves
    return rows.tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=0, help="only the first N rows (a CPU smoke run)")
    ap.add_argument("--quick", action="store_true", help="only as trained and under the guard (session 22)")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM
    from torch.nn.attention import SDPBackend

    dev = torch.device(a.device)
    saved = torch.load(a.batch, weights_only=False)
    keep = slice(0, a.rows or None)
    tensors = {k: v[keep].to(dev) for k, v in saved["tensors"].items()}
    mask, adv = saved["mask"][keep].to(dev).float(), saved["batch"]["advantages"][keep].to(dev)
    bf16, fp32 = torch.autocast(dev.type, dtype=torch.bfloat16), torch.autocast(dev.type, enabled=False)
    every = torch.arange(mask.shape[0], device=dev)
    padded = (tensors["attention_mask"][:, 0] == 0).nonzero().squeeze(1)
    unpadded = (tensors["attention_mask"][:, 0] == 1).nonzero().squeeze(1)
    results = []

    def record(name, **kw):
        r = {"case": name, **kw}
        print(json.dumps(r), flush=True)
        results.append(r)
        Path(a.json).write_text(json.dumps(results, indent=1))

    def load(attn):
        return AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation=attn).to(dev)

    model = load("sdpa")
    record("sdpa bf16 (as trained)", **case(model, tensors, mask, adv, every, bf16))
    from tether.models.attention import guard_attention_backward  # session 21's fix: 16 masked keys more
    restore = guard_attention_backward(dev)
    try:
        record("sdpa bf16 guarded", **case(model, tensors, mask, adv, every, bf16))
        record("sdpa bf16 guarded, only cudnn",
               **case(model, tensors, mask, adv, every, bf16, backends=[SDPBackend.CUDNN_ATTENTION]))
    finally:
        restore()
    if a.quick:
        return
    record("sdpa fp32", **case(model, tensors, mask, adv, every, fp32))
    for name, b in [("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH),
                    ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        record(f"sdpa bf16 only {name}", **case(model, tensors, mask, adv, every, bf16, backends=[b]))
    record("sdpa bf16 micro 32", **case(model, tensors, mask, adv, every, bf16, micro=32))
    record("sdpa bf16 left-padded rows", **case(model, tensors, mask, adv, padded, bf16))
    record("sdpa bf16 unpadded rows", **case(model, tensors, mask, adv, unpadded, bf16))
    available = head_kernels.available
    head_kernels.available = lambda z: False
    record("sdpa bf16 head kernels off", **case(model, tensors, mask, adv, every, bf16))
    head_kernels.available = available
    record("bisect (sdpa bf16)", rows=bisect(model, tensors, mask, adv, every, bf16))
    compile_layers(model)
    record("sdpa bf16 compiled", **case(model, tensors, mask, adv, every, bf16))
    del model
    torch.cuda.empty_cache()
    record("eager bf16 micro 32", **case(load("eager"), tensors, mask, adv, every, bf16, micro=32))


if __name__ == "__main__":
    main()
