"""model.offload_activations on CUDA (tether/models/offload.py): a checkpointed training forward's
saved layer inputs go to pinned host memory and come back for backward. The log-probs and every
gradient whose baseline repeats bit for bit are bit-identical to keeping them on the device (one
that does not, as the embedding's, added with atomics, to 1e-5), and what the forward leaves
allocated for backward drops by the layers' inputs, eager and with the layers compiled."""

from contextlib import nullcontext

import pytest
import torch

from tether.models import logprobs, make_tiny_model
from tether.models.load import compile_layers

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYERS, HIDDEN, B, T = 6, 128, 8, 512  # a layer's input: 8 × 512 × 128 fp32 = 2 MiB (≥ offload.MIN_BYTES)


def _step(model, batch, offload, monkeypatch):
    monkeypatch.setattr(logprobs, "OFFLOAD_ACTIVATIONS", offload)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    lp, _ = logprobs.completion_token_logps(model, batch, 1.0, nullcontext())
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # an allocation frees the blocks whose side-stream copies are done
    held = torch.cuda.memory_allocated() - base  # what the forward keeps for backward (+ the log-probs)
    (lp * torch.linspace(0.5, 1.5, lp.shape[1], device="cuda")).sum().backward()
    torch.cuda.synchronize()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, held


@pytest.mark.parametrize("compiled", [False, True])
def test_offloaded_activations_give_the_same_gradients_and_leave_the_device(monkeypatch, compiled):
    torch.manual_seed(0)
    model, _ = make_tiny_model(None, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4, num_kv_heads=2,
                               intermediate_size=256)
    # eager attention: a deterministic backward (SDPA's fp32 kernels accumulate with atomics)
    model.set_attn_implementation("eager")
    model = model.float().cuda()
    # as setup enables it: eager layers checkpoint reentrantly (their inputs saved through the hooks)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": not compiled})
    model.train()
    if compiled:
        compile_layers(model)
    ids = torch.randint(3, model.config.vocab_size, (B, T), device="cuda")
    cm = torch.zeros(B, T, dtype=torch.long, device="cuda")
    cm[:, T // 2:] = 1
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=cm)
    try:
        _step(model, batch, False, monkeypatch)  # warm-up: compilation and the allocator's first blocks
        kept = _step(model, batch, False, monkeypatch)
        repeat = _step(model, batch, False, monkeypatch)
        moved = _step(model, batch, True, monkeypatch)
        again = _step(model, batch, True, monkeypatch)  # pooled host buffers, reused
    finally:
        torch._dynamo.reset()
    for name, out in (("offloaded", moved), ("offloaded again", again)):
        assert torch.equal(out[0], kept[0]), name
        for n, g in kept[1].items():
            if torch.equal(repeat[1][n], g):  # the baseline repeats bit for bit: so must the offload
                assert torch.equal(out[1][n], g), (name, n, (out[1][n] - g).abs().max().item())
            else:  # e.g. the embedding's CUDA backward adds with atomics (7.6e-6 apart on an H200, run to run)
                torch.testing.assert_close(out[1][n], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(), msg=n)
    layer_input = B * T * HIDDEN * 4
    # every layer's input leaves the device; at most two (a copy in flight) may still be there
    assert kept[2] - moved[2] >= (LAYERS - 2) * layer_input, (kept[2], moved[2])
    assert kept[2] - again[2] >= (LAYERS - 2) * layer_input, (kept[2], again[2])
