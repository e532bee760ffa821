"""Training runs without cuDNN's attention backend on CUDA (tether.models.load.guard_attention_backward):
its backward writes NaN into the query gradient at sequence lengths 64 more than a multiple of 128
with a mask and a row whose log-sum-exp is below -88.7 (session 20: every GRPO step of SmolLM2 at
384 new tokens on an H200)."""

import json

import pytest
import torch

from tether.models import make_tiny_model
from tether.models.load import guard_attention_backward


@pytest.fixture
def cudnn_on():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_the_guard_turns_cudnn_attention_off_on_cuda_only_and_puts_it_back(cudnn_on):
    restore = guard_attention_backward(torch.device("cpu"))
    assert torch.backends.cuda.cudnn_sdp_enabled()  # nothing to guard off CUDA
    restore()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    restore = guard_attention_backward(torch.device("cuda", 0))
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    restore()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)  # put back as it was, not switched on
    guard_attention_backward(torch.device("cuda"))()
    assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.fixture
def sft_run(tmp_path, monkeypatch, cudnn_on):
    """An SFT run on this CPU made to take its device for CUDA's (the guard is what the tests follow):
    returns run(max_steps)."""
    import tether.trainers.setup as setup
    import tether.trainers.sft as sft

    make_tiny_model(tmp_path / "model")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": "a", "completion": "b"}) + "\n" for _ in range(4)))
    monkeypatch.setattr(setup, "guard_attention_backward", lambda device: guard_attention_backward(torch.device("cuda")))
    return lambda max_steps: sft.train_sft(sft.SFTConfig(
        model=str(tmp_path / "model"), data=str(tmp_path / "d.jsonl"), runs_dir=str(tmp_path / "runs"),
        max_steps=max_steps, batch_size=2, device="cpu", progress=False))


def test_a_run_trains_without_cudnn_attention_and_puts_it_back_at_its_end(sft_run, monkeypatch):
    """The skeleton turns it off before the first forward and back at finish()."""
    import tether.trainers.sft as sft

    seen = []
    real = sft.forward_inputs  # every SFT forward's inputs pass through it
    monkeypatch.setattr(sft, "forward_inputs",
                        lambda *a, **k: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or real(*a, **k))
    sft_run(2)
    assert seen and not any(seen)  # every training forward ran with it off
    assert torch.backends.cuda.cudnn_sdp_enabled()  # and the run's end put it back


def test_a_run_that_fails_to_start_puts_it_back(sft_run, monkeypatch):
    import tether.trainers.setup as setup

    def broken(*a, **k):
        raise RuntimeError("optimizer")
    monkeypatch.setattr(setup, "make_optimizer", broken)
    with pytest.raises(RuntimeError, match="optimizer"):
        sft_run(1)
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_left_padded_batch_448_wide_has_a_finite_gradient_under_the_guard(cudnn_on):
    """The shape of session 20's NaN: a Llama in bf16 autocast, rows left-padded (fully masked query
    rows: log-sum-exp -inf), 448 = 3·128 + 64 wide. Under the guard every gradient is finite.
    Without it, whether cuDNN's kernel fails depends on the torch/cuDNN build: printed, not asserted."""
    from tether.models.logprobs import completion_token_logps

    torch.manual_seed(0)
    model, _ = make_tiny_model(None, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                            intermediate_size=256)
    model = model.cuda()
    N, W = 8, 448
    ids = torch.randint(3, model.config.vocab_size, (N, W), device="cuda")
    attn = torch.ones(N, W, dtype=torch.long, device="cuda")
    attn[::2, :3] = 0  # every other row: a prompt 3 tokens shorter, padded on the left
    comp = torch.zeros(N, W, dtype=torch.bool, device="cuda")
    comp[:, 64:] = True
    batch = {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
             "completion_mask": comp}
    amp = torch.autocast("cuda", dtype=torch.bfloat16)

    def grads_finite() -> bool:
        model.zero_grad(set_to_none=True)
        lp, _ = completion_token_logps(model, batch, 1.0, amp)
        (lp * comp).sum().backward()
        return all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    try:  # a build may raise on this shape rather than write NaN: either way, not the guard's test
        print("without the guard, finite:", grads_finite())
    except RuntimeError as e:
        print("without the guard:", type(e).__name__, str(e)[:200])
    restore = guard_attention_backward(torch.device("cuda"))
    try:
        assert grads_finite()
    finally:
        restore()
