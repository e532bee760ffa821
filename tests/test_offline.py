"""The offline preference trainer (tether.trainers.preference.offline): DPO family, KTO, SimPO, ORPO."""

import contextlib
import copy
import json
import random

import pytest
import torch

from extras import needs
import tether.trainers.preference.offline as offline
import tether.trainers.preference.reference as offline_reference
import tether.trainers.core.setup as setup
from tether.cli import main as cli_main
from tether.data import encode_preference
from tether.models import load_model, make_tiny_model
from tether.run import read_jsonl
from tether.trainers.preference.offline import (DPOConfig, KTOConfig, ORPOConfig, SimPOConfig, train_offline,
                                                train_step)
from tether.trainers.preference.data import kl_partners, to_unpaired
from tether.trainers.preference.reference import CACHE_FILE, CACHE_META, reference_logps

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
CPU = torch.device("cpu")
NO_AMP = contextlib.nullcontext()


def preference_rows(n: int, seed: int = 0, far: bool = False) -> list[dict]:
    """Prompt "w=" with w a word over a–j. Chosen: w. Rejected: w with two letters replaced from
    k–t (far=True: an all k–t word, so chosen and rejected share no completion letters)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        w = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(4, 7)))
        bad = list(w)
        for j in (range(len(w)) if far else rng.sample(range(len(w)), 2)):
            bad[j] = rng.choice("klmnopqrst")
        rows.append({"prompt": f"{w}=", "chosen": w, "rejected": "".join(bad)})
    return rows


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline")
    make_tiny_model(root / "model", **TINY)
    write_jsonl(root / "pairs.jsonl", preference_rows(64))
    return root


def cfg_for(root, cls=DPOConfig, **kw):
    base = dict(model=str(root / "model"), data=str(root / "pairs.jsonl"), runs_dir=str(root / "runs"),
                device="cpu", progress=False, batch_size=4, log_every=1, lr=1e-3, schedule="constant",
                warmup_steps=0, warmup_ratio=0.0)
    return cls(**{**base, **kw})


# ---- one optimizer step moves the log-ratios the right way -------------------------------------------

METHODS = {  # name -> (config class, overrides)
    "sigmoid": (DPOConfig, {}),
    "cdpo": (DPOConfig, {"label_smoothing": 0.1}),
    "robust": (DPOConfig, {"loss": "robust", "label_smoothing": 0.1}),
    "ipo": (DPOConfig, {"loss": "ipo"}),
    "hinge": (DPOConfig, {"loss": "hinge"}),
    "kto": (KTOConfig, {}),
    "simpo": (SimPOConfig, {}),
    "orpo": (ORPOConfig, {}),
}


@pytest.fixture(scope="module")
def tiny():
    model, tok = make_tiny_model(None, **TINY)
    pairs, _ = encode_preference(preference_rows(6, seed=3, far=True), tok)
    return model, tok, pairs


def _ratios_after_one_step(tiny, name):
    """Change of log π(y|x) per example after one SGD step: (desirable/chosen, undesirable/rejected)."""
    base, tok, pairs = tiny
    cls, kw = METHODS[name]
    cfg = cls(model="x", data="x", **kw)
    paired = cfg.preference.method != "kto"
    ex = [dict(e, idx=i) for i, e in enumerate(pairs if paired else to_unpaired(pairs))]
    model = copy.deepcopy(base).train()
    split = {"train": ex}
    before = reference_logps(model, split, {"train": paired}, cfg, tok.pad_token_id, CPU, NO_AMP)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # plain gradient step: first-order direction
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    out = train_step(cfg, model, opt, sched, [ex], paired, before, tok.pad_token_id, CPU, NO_AMP,
                     kl_pool=ex, partners=kl_partners(len(ex)))
    after = reference_logps(model, split, {"train": paired}, cfg, tok.pad_token_id, CPU, NO_AMP)
    if paired:
        return after["train.chosen"] - before["train.chosen"], \
            after["train.rejected"] - before["train.rejected"], out
    d = torch.tensor([e["label"] for e in ex])
    delta = after["train.completion"] - before["train.completion"]
    return delta[d], delta[~d], out


def _moves_right(up, down):
    return bool(up.mean() > 0 and down.mean() < 0)


@pytest.mark.parametrize("name", list(METHODS))
def test_one_step_raises_chosen_and_lowers_rejected(tiny, name):
    up, down, out = _ratios_after_one_step(tiny, name)
    assert _moves_right(up, down), (name, up, down)
    assert torch.isfinite(torch.tensor(out["loss"])) and out["grad_norm"] > 0
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert key in out


@pytest.mark.parametrize("name", ["sigmoid", "ipo", "hinge", "kto", "simpo", "orpo"])
def test_direction_check_catches_a_flipped_sign(tiny, name, monkeypatch):
    """The test above is not vacuous: the same trainer with the loss's sign flipped fails it."""
    real = offline.objective

    def flipped(*a, **k):
        loss, m = real(*a, **k)
        return -loss, m
    monkeypatch.setattr(offline, "objective", flipped)
    up, down, _ = _ratios_after_one_step(tiny, name)
    assert not _moves_right(up, down)


# ---- KTO ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("label", [True, False])
def test_kto_batch_with_one_label_only(tiny, label):
    base, tok, pairs = tiny
    cfg = KTOConfig(model="x", data="x")
    ex = [dict(e, idx=i) for i, e in enumerate(e for e in to_unpaired(pairs) if e["label"] == label)]
    model = copy.deepcopy(base).train()
    before = reference_logps(model, {"train": ex}, {"train": False}, cfg, tok.pad_token_id, CPU, NO_AMP)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    out = train_step(cfg, model, opt, sched, [ex], False, before, tok.pad_token_id, CPU, NO_AMP,
                     kl_pool=ex, partners=kl_partners(len(ex)))
    after = reference_logps(model, {"train": ex}, {"train": False}, cfg, tok.pad_token_id, CPU, NO_AMP)
    delta = (after["train.completion"] - before["train.completion"]).mean()
    assert (delta > 0) if label else (delta < 0)
    present, absent = ("chosen", "rejected") if label else ("rejected", "chosen")
    assert f"rewards/{present}" in out and f"rewards/{absent}" not in out  # no fake 0 for a missing group
    assert "rewards/margins" not in out and out[f"count/{absent}"] == 0
    assert out["kl"] == 0.0  # z0 at step 0: policy == reference on the mismatched pairs


def test_kl_partners_is_a_fixed_derangement():
    p = kl_partners(50)
    assert sorted(p) == list(range(50)) and all(p[i] != i for i in range(50))
    assert p == kl_partners(50)


def test_kto_splits_pairs_into_unpaired_rows_and_logs_its_reference_point(root):
    s = train_offline(cfg_for(root, KTOConfig, name="kto", max_steps=3, eval_fraction=0.25))
    assert s["train_examples"] == 2 * (64 - 16) and s["eval_examples"] == 16  # held-out stays paired
    rows = read_jsonl(root / "runs" / "kto" / "metrics.jsonl")
    train_rows = [r for r in rows if "kl" in r]
    assert len(train_rows) == 3 and all(r["kl"] >= 0 for r in train_rows)
    assert "eval/rewards/accuracies" in rows[-1]


# ---- data: truncation counted, bad data one line ----------------------------------------------------

def test_truncation_is_counted_and_reported(root):
    # char tokenizer: prompt "w=" is BOS + len(w) + 1 tokens, a response len + 1 (EOS).
    rows = [{"prompt": "ab=", "chosen": "ab", "rejected": "cd"}] * 6 + \
           [{"prompt": "ab=", "chosen": "abcdefgh", "rejected": "cd"}] * 2
    data = write_jsonl(root / "trunc.jsonl", rows)
    s = train_offline(cfg_for(root, name="trunc", data=data, max_length=8, max_steps=1))
    assert (s["data"]["truncated"], s["data"]["dropped"], s["train_examples"]) == (2, 0, 8)
    assert "2 truncated" in s["data"]["train"]
    s = train_offline(cfg_for(root, name="trunc", data=data, max_length=8, max_steps=1, truncation="drop",
                              overwrite=True))
    assert (s["data"]["truncated"], s["data"]["dropped"], s["train_examples"]) == (0, 2, 6)


def test_bad_data_is_one_line_error(root, capsys):
    unpaired = write_jsonl(root / "unpaired.jsonl", [{"prompt": "a=", "completion": "a", "label": True}])
    code = cli_main(["dpo", f"model={root / 'model'}", f"data={unpaired}", "device=cpu",
                     f"runs_dir={root / 'runs'}", "progress=false"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "chosen" in err


# ---- reference cache and exact resume -------------------------------------------------------------

def _count_loads(monkeypatch, limit):
    """Counts model loads: the policy's (trainers/core/setup.py) and the reference's (preference/reference.py)."""
    calls = []

    def counting(path, *a, **k):
        calls.append(path)
        if len(calls) > limit:
            raise AssertionError(f"load_model called {len(calls)} times: {calls}")
        return load_model(path, *a, **k)
    monkeypatch.setattr(setup, "load_model", counting)
    monkeypatch.setattr(offline_reference, "load_model", counting)
    return calls


VOLATILE = {"time", "step_time", "tokens_per_second"}


def _metrics(path):
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in read_jsonl(path)]


def test_reference_cache_reused_on_resume_and_resume_is_exact(root, monkeypatch):
    runs = root / "runs"
    full = train_offline(cfg_for(root, name="full", max_steps=6, eval_fraction=0.125, eval_every=3))
    calls = _count_loads(monkeypatch, limit=1)
    train_offline(cfg_for(root, name="cut", max_steps=3, eval_fraction=0.125, eval_every=3))
    assert len(calls) == 1  # fresh run: the policy at step 0 is the reference, one model load
    cache = runs / "cut" / CACHE_FILE
    meta = json.loads((runs / "cut" / CACHE_META).read_text())
    assert meta["computed_with"] == "policy at step 0"
    stamp = cache.stat().st_mtime_ns

    calls.clear()  # the resumed run may load the checkpointed policy, and nothing else
    s = train_offline(cfg_for(root, name="cut", max_steps=6, eval_fraction=0.125, eval_every=3, resume=True))
    assert len(calls) == 1 and "checkpoints/step-3" in calls[0]
    assert s["reference"] == "cache" and cache.stat().st_mtime_ns == stamp
    assert _metrics(runs / "cut" / "metrics.jsonl") == _metrics(runs / "full" / "metrics.jsonl")
    samples = read_jsonl(runs / "cut" / "samples.jsonl")  # sampled at steps 3 and 6, 2 prompts each
    assert [r["step"] for r in samples] == [3, 3, 6, 6]
    assert samples == read_jsonl(runs / "full" / "samples.jsonl")  # forked RNG: resume stays exact
    assert s["eval/rewards/accuracies"] == full["eval/rewards/accuracies"]

    # Without the cache the resumed run must load the reference (so the count above is meaningful),
    # and the recomputed numbers equal the cached ones.
    old = {k: v.clone() for k, v in __import__("safetensors.torch").torch.load_file(str(cache)).items()}
    cache.unlink()
    calls.clear()
    calls = _count_loads(monkeypatch, limit=2)
    s = train_offline(cfg_for(root, name="cut", max_steps=7, eval_fraction=0.125, resume=True))
    assert len(calls) == 2 and s["reference"] == "reference model"
    new = __import__("safetensors.torch").torch.load_file(str(cache))
    assert all(torch.allclose(old[k], new[k], atol=1e-5) for k in old)


def test_stale_cache_is_recomputed(root):
    train_offline(cfg_for(root, name="stale", max_steps=1))
    meta = root / "runs" / "stale" / CACHE_META
    fp = json.loads(meta.read_text())["fingerprint"]
    s = train_offline(cfg_for(root, name="stale", max_steps=1, overwrite=True))  # the cache survives
    assert s["reference"] == "cache"
    s = train_offline(cfg_for(root, name="stale", max_steps=1, max_length=12, overwrite=True))  # other token ids
    assert s["reference"] == "policy at step 0" and json.loads(meta.read_text())["fingerprint"] != fp


@needs("peft")
def test_lora_reference_is_the_base_with_adapters_disabled(root, monkeypatch):
    cfg = dict(name="lora", lora_r=4, max_steps=2, save_every=1, lr=1e-2)
    train_offline(cfg_for(root, **cfg))
    cache = root / "runs" / "lora" / CACHE_FILE
    from safetensors.torch import load_file
    old = load_file(str(cache))
    cache.unlink()
    calls = _count_loads(monkeypatch, limit=1)  # the base; no second model for the reference
    s = train_offline(cfg_for(root, **{**cfg, "max_steps": 3}, resume=True))
    assert len(calls) == 1 and s["reference"] == "base with adapters disabled"
    new = load_file(str(cache))
    assert all(torch.allclose(old[k], new[k], atol=1e-5) for k in old)


# ---- it works: held-out implicit-reward accuracy and margin grow --------------------------------------

def test_dpo_learns_a_preference_that_generalizes(root):
    """Chosen copies the prompt's word; rejected has two letters swapped for k–t letters. After DPO
    the *held-out* pairs (words never trained on) are ranked right by the implicit reward, and
    the margin keeps growing."""
    data = write_jsonl(root / "works.jsonl", preference_rows(400, seed=1))
    s = train_offline(cfg_for(root, name="works", data=data, max_steps=40, batch_size=8,
                              eval_fraction=0.1, eval_every=10, log_every=10, beta=0.1))
    evals = [r for r in read_jsonl(root / "runs" / "works" / "metrics.jsonl") if "eval/rewards/margins" in r]
    margins = [r["eval/rewards/margins"] for r in evals]
    assert s["eval_examples"] == 40 and len(evals) == 4
    assert s["eval/rewards/accuracies"] >= 0.9
    assert all(b > a for a, b in zip(margins, margins[1:])) and margins[-1] > 3 * margins[0] > 0
    assert s["eval/rewards/chosen"] > s["eval/rewards/rejected"]
    assert s["model"].endswith("checkpoints/step-40")
