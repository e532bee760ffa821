"""SFT works (learns what it is shown, and only that), fails fast on bad data, and writes the run
directory contract."""

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from extras import needs
from tether.errors import NonFiniteLossError, UserError
from tether.models import load_model, load_tokenizer, make_tiny_model
from tether.trainers.core.common import guarded_step, make_optimizer, make_scheduler
from tether.trainers.sft import SFTConfig, evaluate_loss, train_sft
from tether.trainers.sft import load_sft_data
from tether.rollout.hf import generate


def _copy_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(5))
        rows.append({"prompt": f"Copy {digits}:", "completion": f" {digits}", "answer": digits})
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    make_tiny_model(root / "model", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=128)
    train, test = _copy_rows(4000, seed=1), _copy_rows(50, seed=2)
    with open(root / "train.jsonl", "w") as f:
        for r in train:
            f.write(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n")
    return root, train, test


def _copy_accuracy(model_dir, rows) -> float:
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    outs = generate(model, tok, [r["prompt"] for r in rows], max_new_tokens=8)
    return sum(o.strip() == r["answer"] for o, r in zip(outs, rows)) / len(rows)


def _cfg(root, **kw):
    base = dict(model=str(root / "model"), data=str(root / "train.jsonl"), runs_dir=str(root / "runs"),
                batch_size=16, lr=3e-3, log_every=5, device="cpu", progress=False, num_samples=2,
                sample_max_new_tokens=16, warmup_steps=10)
    base.update(kw)
    return SFTConfig(**base)


def test_sft_learns_to_copy_held_out_strings_and_writes_the_run_dir(tiny):
    root, _, test = tiny
    before = _copy_accuracy(str(root / "model"), test)
    summary = train_sft(_cfg(root, name="learn", max_steps=300, eval_fraction=0.05, eval_every=100))
    ck = summary["checkpoint"]
    after = _copy_accuracy(ck, test)
    # Held-out strings: only a model that learned to copy (not the training rows) gets these.
    assert before == 0.0 and after >= 0.9, (before, after)
    run = root / "runs" / "learn"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(r["step"], int) and isinstance(r["time"], float) for r in rows)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.5 * losses[0]
    assert any("eval/loss" in r for r in rows)
    assert (run / "config.yaml").exists() and json.loads((run / "summary.json").read_text())["steps"] == 300
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "completion"} <= set(samples[0])
    ckdir = Path(ck)
    assert (ckdir / "model.safetensors").exists() and (ckdir / "trainer_state.pt").exists()
    assert (ckdir / "tokenizer.json").exists()
    assert (run / "plots" / "loss.png").exists()


@needs("tensorboard")
def test_log_with_tensorboard_writes_event_files(tiny):
    root, _, _ = tiny
    train_sft(_cfg(root, name="tb", max_steps=2, log_every=1, num_samples=0, log_with="tensorboard"))
    assert list((root / "runs" / "tb" / "tensorboard").glob("events.out.tfevents.*"))


def test_log_with_tensorboard_without_the_package_is_one_line_before_anything_is_written(tiny, monkeypatch):
    root, _, _ = tiny
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `import` raises ImportError
    with pytest.raises(UserError, match=r"^run.log_with=tensorboard needs the tensorboard package: "
                                        r"pip install 'tether\[tensorboard\]'$"):
        train_sft(_cfg(root, name="tb-missing", max_steps=2, num_samples=0, log_with="tensorboard"))
    assert not (root / "runs" / "tb-missing").exists()


def test_completion_only_loss_does_not_train_the_prompt(tiny):
    """With completion_only the prompt's NLL must not be what improves; without it, it does."""
    root, _, _ = tiny
    tok = load_tokenizer(str(root / "model"))

    def prompt_loss(model_dir):
        cfg = _cfg(root, completion_only=False)
        ex = load_sft_data(cfg, tok)[0][:200]
        masked = _cfg(root, completion_only=True)
        ex_c = load_sft_data(masked, tok)[0][:200]
        # prompt-token mask = all tokens minus completion tokens
        prompt_only = [{"input_ids": a["input_ids"],
                        "completion_mask": [x - y for x, y in zip(a["completion_mask"], b["completion_mask"])]}
                       for a, b in zip(ex, ex_c)]
        model = load_model(model_dir)
        return evaluate_loss(model, prompt_only, 32, tok.pad_token_id, torch.device("cpu"),
                             torch.autocast("cpu", enabled=False))

    base = prompt_loss(str(root / "model"))
    only = train_sft(_cfg(root, name="c-only", max_steps=60, completion_only=True))
    full = train_sft(_cfg(root, name="c-full", max_steps=60, completion_only=False))
    p_only, p_full = prompt_loss(only["checkpoint"]), prompt_loss(full["checkpoint"])
    # The prompt text ("Question: What is ...") is highly predictable: trained on, its loss collapses.
    assert p_full < 0.5 * p_only, (base, p_only, p_full)


def test_grad_accumulation_equals_bigger_batch(tiny):
    root, _, _ = tiny
    a = train_sft(_cfg(root, name="acc1", max_steps=3, batch_size=8, grad_accum=1, log_every=1, num_samples=0))
    b = train_sft(_cfg(root, name="acc2", max_steps=3, batch_size=4, grad_accum=2, log_every=1, num_samples=0))
    ra = [json.loads(x) for x in (root / "runs" / "acc1" / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(x) for x in (root / "runs" / "acc2" / "metrics.jsonl").read_text().splitlines()]
    for x, y in zip(ra, rb):
        if "loss" in x:
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)


def test_non_finite_loss_never_reaches_the_weights():
    model = torch.nn.Linear(3, 1)
    opt = make_optimizer(model, 1e-2, 0.0)
    sched = make_scheduler(opt, "constant", 0, 10)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.tensor([[float("nan"), 1.0, 2.0]])).sum()
    loss.backward()
    with pytest.raises(NonFiniteLossError):
        guarded_step(model, opt, sched, 1.0, loss.item())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state  # Adam moments untouched


BAD_INPUTS = [
    # (file name, raw bytes, expected fragment of the one-line error)
    ("missing.jsonl", b'{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n',
     "missing.jsonl:2:completion: missing column"),
    ("nocols.jsonl", b'{"prompt": "a"}\n', "nocols.jsonl: expected columns"),
    ("wrongtype.jsonl", b'{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": 42}\n',
     "wrongtype.jsonl:2:completion: expected a string"),
    ("empty.jsonl", b"", "empty.jsonl: dataset is empty"),
    ("emptystr.jsonl", b'{"prompt": "a", "completion": ""}\n', "emptystr.jsonl:1:completion: empty string"),
    ("utf8.jsonl", b'{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": "\xff\xfe"}\n',
     "utf8.jsonl:2:completion: invalid UTF-8"),
    ("json.jsonl", b'{"prompt": "a", "completion": "b"\n', "json.jsonl:1: malformed JSON"),
    ("roles.jsonl", b'{"messages": [{"role": "bot", "content": "x"}]}\n', "roles.jsonl:1:messages[0].role"),
    ("shape.jsonl", b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n', "expected columns"),
]


@pytest.mark.parametrize("name, raw, needle", BAD_INPUTS)
def test_bad_data_is_one_line_before_anything_is_written(tiny, tmp_path, capsys, name, raw, needle):
    # the CLI's own entry point in this process (a subprocess per case cost ~4 s of imports each;
    # tests/test_bad_input.py checks the exit codes of a real subprocess)
    from tether.cli import main
    root, _, _ = tiny
    f = tmp_path / name
    f.write_bytes(raw)
    capsys.readouterr()
    code = main(["sft", f"model={root / 'model'}", f"data={f}", f"runs_dir={tmp_path / 'runs'}", "name=bad",
                 "device=cpu", "progress=false"])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert needle in err and err.count("\n") == 0, err
    assert not (tmp_path / "runs" / "bad").exists()  # nothing written, not even half


def test_over_max_length_is_counted(tiny, tmp_path):
    root, _, _ = tiny
    f = tmp_path / "long.jsonl"
    rows = [{"prompt": "Copy 12345:", "completion": " 3" * (40 if i % 2 else 1)}
            for i in range(10)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(str(root / "model"))
    ex, _, _, rep = load_sft_data(_cfg(root, data=str(f), max_length=60, truncation="truncate"), tok)
    assert rep["truncated"] == 5 and rep["dropped"] == 0 and max(len(e["input_ids"]) for e in ex) == 60
    ex, _, _, rep = load_sft_data(_cfg(root, data=str(f), max_length=60, truncation="drop"), tok)
    assert rep["dropped"] == 5 and len(ex) == 5 and "long.jsonl" in rep["train"]


@needs("peft")
def test_lora_trains_only_adapters_and_learns(tiny, tmp_path):
    root, train, _ = tiny
    from safetensors.torch import load_file
    # A random-init base cannot be steered by adapters alone (tiny tied embeddings cap every
    # logit near 1), so first give it a little pretraining, as a real base would have.
    pre = train_sft(_cfg(root, name="lora-base", max_steps=60, num_samples=0))
    base_dir = Path(pre["checkpoint"])
    base = load_file(str(base_dir / "model.safetensors"))
    data = tmp_path / "seven.jsonl"  # a new behaviour for the adapters: always answer " 7"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": " 7"}) + "\n"
                            for r in train[:500]))
    summary = train_sft(_cfg(root, name="lora", model=str(base_dir), data=str(data), max_steps=60,
                             lora_r=8, lora_alpha=16, lr=1e-2, num_samples=0))
    ck = Path(summary["checkpoint"])
    assert (ck / "adapter_model.safetensors").exists() and not (ck / "model.safetensors").exists()
    adapter = load_file(str(ck / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    # the base weights on disk are untouched, and the adapted model learned the task
    assert torch.equal(load_file(str(base_dir / "model.safetensors"))["model.embed_tokens.weight"],
                       base["model.embed_tokens.weight"])
    rows = [json.loads(x) for x in (root / "runs" / "lora" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.5 * losses[0]
