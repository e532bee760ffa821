"""run.progress=false silences Hugging Face's own bars ("Loading weights", "Writing model shards")
for the run, keeps them under progress=true, and puts the caller's setting back afterwards."""

import importlib
import json

import pytest
from transformers.utils import logging as hf_logging

from tether.errors import UserError
from tether.models import make_tiny_model
from tether.trainers.sft import SFTConfig, train_sft

HF_BARS = ("Loading weights", "Writing model shards")
hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bars")
    make_tiny_model(root / "model", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    with open(root / "d.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) + "\n")
    return root


def _sft(root, name, progress, **kw):
    return train_sft(SFTConfig(model=str(root / "model"), data=str(root / "d.jsonl"),
                               runs_dir=str(root / "runs"), name=name, max_steps=2,
                               batch_size=4, device="cpu", progress=progress, num_samples=0,
                               **kw))


def test_progress_false_prints_no_hf_bars_and_restores_the_setting(tiny, capfd):
    assert hf_logging.is_progress_bar_enabled()
    capfd.readouterr()
    _sft(tiny, "quiet", progress=False, save_every=1)  # loads weights, writes checkpoints twice
    out, err = capfd.readouterr()
    assert not [b for b in HF_BARS if b in out + err], err
    assert hf_logging.is_progress_bar_enabled() and not hub_tqdm.are_progress_bars_disabled()


def test_progress_true_keeps_the_hf_bars(tiny, capfd):
    capfd.readouterr()
    _sft(tiny, "bars", progress=True)
    err = capfd.readouterr().err
    assert all(b in err for b in HF_BARS), err  # so the test above is not vacuous


def test_a_caller_who_turned_the_bars_off_keeps_them_off(tiny):
    hf_logging.disable_progress_bar()
    try:
        _sft(tiny, "off-already", progress=False)
        assert not hf_logging.is_progress_bar_enabled() and hub_tqdm.are_progress_bars_disabled()
    finally:
        hf_logging.enable_progress_bar()


def test_a_run_that_fails_in_setup_restores_the_bars(tiny):
    with pytest.raises(UserError):
        train_sft(SFTConfig(model=str(tiny / "no-such-model"), data=str(tiny / "d.jsonl"),
                            runs_dir=str(tiny / "runs"), device="cpu", progress=False))
    assert hf_logging.is_progress_bar_enabled() and not hub_tqdm.are_progress_bars_disabled()


def test_a_run_that_raises_mid_loop_leaves_the_bars_as_they_were(tiny):
    """The silencing is scoped to the calls that draw bars (loading, writing shards): an error in
    the loop, with its traceback (and the run's objects) still alive, changes nothing outside."""
    def broken_hook(model, tokenizer, step):
        raise RuntimeError("eval hook broke")
    with pytest.raises(RuntimeError, match="eval hook broke"):
        train_sft(SFTConfig(model=str(tiny / "model"), data=str(tiny / "d.jsonl"),
                            runs_dir=str(tiny / "runs"), name="raises", max_steps=2, batch_size=4,
                            device="cpu", progress=False, num_samples=0, eval_every=1),
                  eval_hook=broken_hook)
    assert hf_logging.is_progress_bar_enabled() and not hub_tqdm.are_progress_bars_disabled()
