"""`tether init-model`: a from-scratch model whose character vocabulary comes from the user's data,
trainable by `tether sft` as it is; the default output is the quickstart's model, byte for byte."""

import json
import math
import random

import pytest

from tether.cli import main
from tether.models import load_tokenizer, make_tiny_model
from tether.models.tiny import CHARS, SPECIAL_TOKENS, char_tokenizer
from tether.run import read_jsonl

GREEK = "αβγδεζηθ"


def _task_rows(n, seed=0):
    """Reverse a word over Greek letters: characters the built-in set does not have."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        w = "".join(rng.choice(GREEK) for _ in range(rng.randint(2, 4)))
        rows.append({"prompt": f"{w}→", "completion": w[::-1]})
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_init_model_from_jsonl_then_sft_trains_on_it(tmp_path, capsys):
    data = _write(tmp_path / "task.jsonl", _task_rows(200))
    out = tmp_path / "model"
    assert main(["init-model", f"out={out}", f"data={data}", "hidden_size=32", "layers=2",
                 "heads=2", "kv_heads=1"]) == 0
    printed = capsys.readouterr().out
    assert "init-model: wrote" in printed and "Writing model shards" not in printed

    tok = load_tokenizer(str(out))
    chars = sorted(set(GREEK) | set("→"))
    assert len(tok) == len(SPECIAL_TOKENS) + len(chars)  # exactly the data's characters
    ids = tok("βαγ→", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 and tok.unk_token_id not in ids
    assert tok.decode(ids) == "βαγ→"
    assert tok.unk_token_id in tok("x", add_special_tokens=False)["input_ids"]  # not in the data
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2

    runs = tmp_path / "runs"
    assert main(["sft", f"model={out}", f"data={data}", f"runs_dir={runs}", "name=mine", "max_steps=40",
                 "batch_size=8", "lr=3e-3", "warmup_steps=5", "log_every=5", "device=cpu",
                 "progress=false", "num_samples=0"]) == 0
    losses = [r["loss"] for r in read_jsonl(runs / "mine" / "metrics.jsonl") if "loss" in r]
    # from about uniform over the vocabulary (ln 17 = 2.83) to below it by a clear margin (measured:
    # 2.66 for steps 1-5 -> 2.09 for steps 36-40; ln 8 = 2.08 is knowing only which letters come)
    assert len(losses) == 8 and losses[-1] < 0.85 * losses[0] and losses[-1] < math.log(len(tok)) - 0.5, losses


def test_default_is_the_quickstart_tokenizer_and_model_byte_for_byte(tmp_path):
    assert main(["init-model", f"out={tmp_path / 'cli'}"]) == 0
    make_tiny_model(tmp_path / "api")
    make_tiny_model(tmp_path / "api_chars", chars=CHARS)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        want = (tmp_path / "api" / name).read_bytes()
        assert (tmp_path / "cli" / name).read_bytes() == want, name
        assert (tmp_path / "api_chars" / name).read_bytes() == want, name


def test_chars_as_string_file_or_with_data(tmp_path):
    assert main(["init-model", f"out={tmp_path / 's'}", "chars=ba+a"]) == 0
    assert list(load_tokenizer(str(tmp_path / "s")).get_vocab()) != []
    assert len(load_tokenizer(str(tmp_path / "s"))) == len(SPECIAL_TOKENS) + 3  # b, a, + once each
    (tmp_path / "alphabet.txt").write_text("xyz\n", encoding="utf-8")
    data = _write(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "ω"}]}])
    assert main(["init-model", f"out={tmp_path / 'f'}", f"chars={tmp_path / 'alphabet.txt'}",
                 f"data={data}"]) == 0
    vocab = load_tokenizer(str(tmp_path / "f")).get_vocab()
    # the file's characters (newline included), and every string value of the rows (roles too)
    assert {"x", "y", "z", "\n", "ω", "u", "s"} <= set(vocab)


def test_char_tokenizer_chars_checked():
    assert len(char_tokenizer("aab")) == len(SPECIAL_TOKENS) + 2
    with pytest.raises(ValueError, match="single characters"):
        char_tokenizer(["ab"])
    with pytest.raises(ValueError, match="empty"):
        char_tokenizer("")


@pytest.mark.parametrize("args, rc, words", [
    (["data=missing.jsonl"], 1, "missing.jsonl"),
    (["hidden_size=30", "heads=4"], 2, "not a multiple of heads"),
    (["heads=4", "kv_heads=3"], 2, "kv_heads"),
    (["hidden_size=12", "heads=4"], 2, "even"),
], ids=["no-data", "heads", "kv-heads", "odd-head"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, args, rc, words):
    monkeypatch.chdir(tmp_path)
    assert main(["init-model", "out=m", *args]) == rc
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "m").exists()


def test_an_existing_model_is_kept_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["init-model", f"out={out}", "chars=ab"]) == 0
    before = (out / "tokenizer.json").read_bytes()
    assert main(["init-model", f"out={out}", "chars=abc"]) == 1
    assert "already holds a model" in capsys.readouterr().err
    assert (out / "tokenizer.json").read_bytes() == before
    assert main(["init-model", f"out={out}", "chars=abc", "overwrite=true"]) == 0
    assert (out / "tokenizer.json").read_bytes() != before
