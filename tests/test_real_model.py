"""A real pretrained model end to end: SmolLM2-135M-Instruct from its GGUF (tests/real_model.py)
becomes a plain bf16 HF folder that loads, chats and answers like the GGUF itself, and a `.gguf`
path works wherever a model path does, converted once. Bad input is one line naming the file."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import tether.models.gguf as gguf_mod
from real_model import require_gguf_extra
from tether.cli import main
from tether.models import load_model, load_tokenizer
from tether.models.load import stored_dtype

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_converted_smollm2_is_a_plain_bf16_model_that_chats(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert stored_dtype(str(smollm2)) == torch.bfloat16
    model = load_model(str(smollm2), dtype="bf16", device="cpu").eval()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert getattr(model, "hf_quantizer", None) is None
    tok = load_tokenizer(str(smollm2))
    assert tok.chat_template
    enc = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    assert tok.decode(enc["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow  # kept out of the default suite's 10 minutes; run with -m slow
def test_converted_logits_equal_the_gguf_loaded_models(smollm2, smollm2_gguf):
    """The folder holds exactly the weights transformers' GGUF loader gives in bf16, so the
    next-token logits agree bit for bit (measured: max |diff| 0.0; against the fp32 GGUF load the
    bf16 rounding alone moves them by up to 0.48)."""
    from transformers import AutoModelForCausalLM

    ours = load_model(str(smollm2), dtype="bf16", device="cpu").eval()
    ref = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                               dtype=torch.bfloat16).eval()
    tok = load_tokenizer(str(smollm2))
    enc = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        a, b = ours(**enc).logits[0, -1], ref(**enc).logits[0, -1]
    assert torch.equal(a, b), (a.float() - b.float()).abs().max()
    ref_state = ref.state_dict()
    assert all(torch.equal(v, ref_state[k]) for k, v in ours.state_dict().items())


@pytest.mark.slow  # kept out of the default suite's 10 minutes (run with -m slow)
def test_a_gguf_path_trains_straight_from_the_cache(smollm2, smollm2_gguf, tmp_path, monkeypatch):
    """`model=<file.gguf>` to a trainer: tokenizer, model and checkpoint dtype all resolve to the
    session's converted folder; no second conversion (convert_gguf would raise)."""
    from tether.trainers.sft import SFTConfig, train_sft

    def no_conversion(*a, **k):
        raise AssertionError("the GGUF was converted a second time")
    monkeypatch.setattr(gguf_mod, "convert_gguf", no_conversion)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "completion": f" {2 * i}"}) + "\n"
                            for i in range(4)))
    summary = train_sft(SFTConfig(model=str(smollm2_gguf), data=str(data), runs_dir=str(tmp_path / "runs"),
                                  name="gguf", max_steps=2, batch_size=2, lr=1e-5, device="cpu",
                                  progress=False, num_samples=0, log_every=1))
    ckpt = tmp_path / "runs" / "gguf" / "checkpoints" / "step-2"
    assert summary["steps"] == 2 and summary["checkpoint"] == str(ckpt), summary
    assert (ckpt / "config.json").exists()
    assert stored_dtype(str(ckpt)) == torch.bfloat16  # saved as the source was published
    assert load_tokenizer(str(ckpt)).chat_template


def test_each_distinct_gguf_file_is_converted_once(tmp_path, monkeypatch):
    require_gguf_extra()
    calls = []

    def fake_convert(path, out):
        calls.append(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / gguf_mod.DONE).write_text("x")
        return out
    monkeypatch.setattr(gguf_mod, "convert_gguf", fake_convert)
    monkeypatch.setenv("TETHER_GGUF_CACHE", str(tmp_path / "cache"))
    a = tmp_path / "a.gguf"
    a.write_bytes(b"GGUF" + b"\0" * 64)
    first = gguf_mod.ensure_converted(a)
    assert gguf_mod.ensure_converted(a) == first and len(calls) == 1  # unchanged: the cache
    b = tmp_path / "b.gguf"
    b.write_bytes(a.read_bytes())
    assert gguf_mod.ensure_converted(b) == first and len(calls) == 1  # same content, other name
    from tether.trainers.preference.reference import model_fingerprint
    before = model_fingerprint(str(a))  # the offline trainers' cached reference log-probs, by content
    a.write_bytes(b"GGUF" + b"\1" * 64)
    # a file is known changed by its stat (file_sha256's memo): make sure the rewrite, done within
    # the same clock tick here, shows as one, as a real replacement of a model file would
    st = a.stat()
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert gguf_mod.ensure_converted(a) != first and len(calls) == 2  # changed: converted again
    assert model_fingerprint(str(a)) != before and model_fingerprint(str(b)) == before


def _unsupported(tmp_path):
    require_gguf_extra()
    import gguf
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "no-such-arch")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("case, words", [
    ("missing", "does not exist"),
    ("not-gguf", "is not a GGUF file"),
    ("unsupported", "no-such-arch is not supported"),
    ("no-gguf-package", "needs the gguf package: pip install 'tether[gguf]'"),
    ("no-accelerate-package", "needs the accelerate package: pip install 'tether[gguf]'"),
])
def test_bad_gguf_input_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys, case, words):
    path = tmp_path / "m.gguf"
    if case == "not-gguf":
        path.write_text("{}")
    elif case == "unsupported":
        path = _unsupported(tmp_path)
    elif case == "no-gguf-package":
        path.write_bytes(b"GGUF" + b"\0" * 64)
        monkeypatch.setattr(gguf_mod, "_importable", lambda name: name != "gguf")
    elif case == "no-accelerate-package":
        path.write_bytes(b"GGUF" + b"\0" * 64)
        monkeypatch.setattr(gguf_mod, "_importable", lambda name: name != "accelerate")
    monkeypatch.setenv("TETHER_GGUF_CACHE", str(tmp_path / "cache"))
    assert main(["convert", f"model={path}", f"out={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and str(path) in err, err
    assert not (tmp_path / "out").exists()
    # the same file as a trainer's model: the same line, before any run directory is made
    assert main(["sft", f"model={path}", f"data={tmp_path / 'd.jsonl'}", f"runs_dir={tmp_path / 'runs'}"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and str(path) in err, err


def test_the_core_install_needs_no_gguf(tmp_path):
    """With `gguf` and `accelerate` unimportable, tether, its CLI and a normal model folder all
    work; only reading a GGUF file asks for them."""
    code = f"""
import sys
sys.modules["gguf"] = sys.modules["accelerate"] = None  # `import` raises ImportError, as on a core install
from tether.cli import main
from tether.models import load_model, make_tiny_model
make_tiny_model({str(tmp_path / "m")!r}, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
load_model({str(tmp_path / "m")!r}, device="cpu")
open({str(tmp_path / "x.gguf")!r}, "wb").write(b"GGUF" + bytes(64))
sys.exit(main(["convert", "model={tmp_path / 'x.gguf'}", "out={tmp_path / 'out'}"]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"})
    # the lines before it are the tiny model's save/load progress bars, where HF draws them
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1:] == [
        f"tether convert: error: reading GGUF file '{tmp_path / 'x.gguf'}' needs the gguf and accelerate packages: pip install 'tether[gguf]'"], r.stderr


def test_convert_gives_a_template_to_a_gguf_that_has_none(tmp_path, monkeypatch, capsys):
    """A base model's GGUF (Gemma 3 270M's) carries no chat template: `chat_template=FILE` writes
    the file's template into the converted tokenizer; without it the folder has none. A missing
    template file is one line, before anything is converted or written."""
    from tether.models.tiny import make_tiny_model

    def no_template_gguf(path, dtype=None, tokenizer=None):
        model, tok = make_tiny_model()
        tok.chat_template = None
        return model, tok
    monkeypatch.setattr(gguf_mod, "load_dequantized", no_template_gguf)
    monkeypatch.setattr(gguf_mod, "file_sha256", lambda p: "0" * 64)
    (tmp_path / "base.gguf").write_bytes(b"GGUF")
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)

    assert main(["convert", f"model={tmp_path / 'base.gguf'}", f"out={tmp_path / 'plain'}"]) == 0
    assert load_tokenizer(str(tmp_path / "plain")).chat_template is None
    assert main(["convert", f"model={tmp_path / 'base.gguf'}", f"out={tmp_path / 'chat'}",
                 f"chat_template={tmp_path / 't.jinja'}"]) == 0
    tok = load_tokenizer(str(tmp_path / "chat"))
    assert tok.chat_template == template
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"

    assert main(["convert", f"model={tmp_path / 'base.gguf'}", f"out={tmp_path / 'none'}",
                 f"chat_template={tmp_path / 'missing.jinja'}"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("missing.jinja' does not exist") and not (tmp_path / "none").exists()


def _bpe_tokenizer(merges: bool):
    """A small byte-level BPE tokenizer whose vocabulary holds whole words: with its merges the words
    encode to their own ids, without them letter by letter (as a misread GGUF tokenizer does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["Ġhello", "Ġworld", "Ġturn"]
    letters = sorted({c for w in words for c in w})
    vocab = {c: i for i, c in enumerate(letters)}
    pairs = []
    for w in words:  # merge left to right: Ġh, Ġhe, Ġhel, ...
        for k in range(2, len(w) + 1):
            if w[:k] not in vocab:
                pairs.append((w[:k - 1], w[k - 1]))
                vocab[w[:k]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs if merges else []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_vocab_selftest_tells_a_misread_tokenizer():
    from tether.models.gguf import vocab_selftest

    ok, n = vocab_selftest(_bpe_tokenizer(merges=True))  # Ġhel, Ġhell, Ġhello, Ġwor, ..., Ġturn
    assert ok == n == 8
    assert vocab_selftest(_bpe_tokenizer(merges=False)) == (0, 8)


def test_control_tokens_of_the_gguf_become_special(smollm2_gguf):
    """llama.cpp's control tokens (type 3) are added special tokens of the converted tokenizer, at
    their own ids, matched whole; a vocabulary entry that is not one stays as it was."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tether.models.gguf import control_tokens, mark_special

    control = control_tokens(smollm2_gguf)
    assert control["<|im_start|>"] == 1 and control["<|im_end|>"] == 2 and "Ġhello" not in control
    vocab = {"<|im_end|>": 0, "<": 1, "|": 2, "i": 3, "m": 4, "_": 5, "e": 6, "n": 7, "d": 8, ">": 9, "x": 10}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="x", max_input_chars_per_word=100))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character a piece: the marker splits
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert hf("<|im_end|>", add_special_tokens=False).input_ids != [0]
    assert mark_special(hf, {"<|im_end|>": 0, "<|im_start|>": 99}) == ["<|im_end|>"]  # 99: not its id here
    assert hf("a<|im_end|>", add_special_tokens=False).input_ids[-1:] == [0] and len(hf) == len(vocab)
    assert hf.decode([0], skip_special_tokens=True) == ""


def test_a_given_tokenizer_must_hold_the_ggufs_vocabulary(smollm2, smollm2_gguf, tmp_path):
    """tokenizer=DIR (for a transformers that misreads a GGUF's tokenizer): the converted SmolLM2
    folder's tokenizer is the GGUF's vocabulary and passes; another vocabulary is one line naming
    the first token that differs, before any weight is read or anything written."""
    from tether.errors import UserError
    from tether.models.gguf import check_same_vocab, gguf_tokens
    from tether.models.tiny import make_tiny_model

    assert gguf_tokens(smollm2_gguf)[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    check_same_vocab(load_tokenizer(str(smollm2)), smollm2_gguf, smollm2)
    _, tiny = make_tiny_model()
    tiny.save_pretrained(tmp_path / "tiny-tok")
    with pytest.raises(UserError, match=r"is not the vocabulary of GGUF file .* tokens differ \(token 0 "):
        check_same_vocab(tiny, smollm2_gguf, tmp_path / "tiny-tok")
    assert main(["convert", f"model={smollm2_gguf}", f"out={tmp_path / 'out'}", f"tokenizer={tmp_path / 'tiny-tok'}"]) == 1
    assert not (tmp_path / "out" / "model.safetensors").exists()
