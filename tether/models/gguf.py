"""GGUF checkpoints (llama.cpp's quantized single-file format) as normal Hugging Face folders.

`convert_gguf(path, out)` dequantizes a `.gguf` file through transformers' own GGUF loader
(`from_pretrained(dir, gguf_file=name)`, model and tokenizer alike), detaches the quantizer and
writes a bf16 HF folder with the tokenizer and its chat template: from then on nothing about the
model is GGUF, and every command loads it like any other checkpoint. `ensure_converted(path)` does
that once per distinct file into a cache, so `model=<file.gguf>` works anywhere a model path goes
(tether.models.load.model_source is the one place that calls it).

Why bf16: GGUF weights are low-bit blocks; dequantized they carry no more precision than bf16
holds for training, at half the size of fp32 on disk (`dtype=fp32` still loads them widened).
Reading a GGUF file needs the `gguf` package (transformers reads the file through it) and
`accelerate` (transformers refuses a `gguf_file=` load without it): both come with
`pip install 'tether[gguf]'`, are needed only here and are imported lazily: the core install does
not need them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tether.errors import UserError

MAGIC = b"GGUF"  # the first four bytes of every GGUF file (all versions)
DONE = "tether_gguf_source.txt"  # written last into a converted folder: its presence = complete

# (resolved path, inode, size, mtime, ctime) -> sha256: a run loads the model path several times
# (tokenizer, model, reference, stored dtype); a file (4 GB for a 7B model: seconds to hash) is
# hashed once per process while its stat says it is unchanged, as make decides what to rebuild.
_HASHES: dict[tuple, str] = {}


def is_gguf(path) -> bool:
    return str(path).lower().endswith(".gguf")


def cache_root() -> Path:
    """Where converted files live: $TETHER_GGUF_CACHE, else $XDG_CACHE_HOME/tether/gguf (default
    ~/.cache/tether/gguf). Not next to the file: GGUFs often sit where writing is wrong or
    impossible (inside an installed package, which a reinstall wipes; a read-only mount; a shared
    models directory), and a per-user cache keyed by content is shared by every copy of a file."""
    if os.environ.get("TETHER_GGUF_CACHE"):
        return Path(os.environ["TETHER_GGUF_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "tether" / "gguf"


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise UserError(f"GGUF file '{path}' does not exist" if not path.exists()
                        else f"GGUF path '{path}' is not a file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise UserError(f"'{path}' is not a GGUF file (it does not start with the GGUF magic bytes)")
    missing = [name for name in NEEDS if not _importable(name)]
    if missing:
        what = f"the {missing[0]} package" if len(missing) == 1 else f"the {' and '.join(missing)} packages"
        raise UserError(f"reading GGUF file '{path}' needs {what}: pip install 'tether[gguf]'")


# What transformers' GGUF loader imports: gguf reads the file; accelerate, because from_pretrained
# with gguf_file= raises "accelerate is required when loading a GGUF file" without it.
NEEDS = ("gguf", "accelerate")


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def file_sha256(path: Path) -> str:
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def load_dequantized(path, dtype=None, tokenizer=None):
    """(model, tokenizer) from a GGUF file through transformers, every weight unpacked into a plain
    dense tensor (fp32 unless `dtype`) and the quantizer detached, so the model trains and saves as
    any other. One-line UserErrors name the file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    path = Path(path).expanduser()
    _check_file(path)
    where, name = str(path.resolve().parent), path.name
    given = tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(given or where, **({} if given else {"gguf_file": name}))
    except Exception as e:  # noqa: BLE001 - a file or folder transformers cannot read: one line
        raise UserError(f"cannot convert GGUF file '{path}': {_one_line(e)}") from None
    if given:  # the tokenizer is checked before the (longer) weights are read
        check_same_vocab(tokenizer, path, given)
    else:
        mark_special(tokenizer, control_tokens(path))
        ok, n = vocab_selftest(tokenizer)
        if n and ok < 0.9 * n:
            import transformers
            raise UserError(f"cannot convert GGUF file '{path}': transformers {transformers.__version__} reads its "
                            f"tokenizer wrongly ({ok} of {n} of the vocabulary's own words encode to themselves; "
                            "5.24 reads Gemma 3's right; or give tokenizer=<a folder with this vocabulary>)")
    try:
        # dequantize=True: transformers otherwise keeps the weights in packed GGUF blocks behind
        # its own matmul kernels when they are installed, which can be neither trained nor saved.
        model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=dtype or torch.float32,
            quantization_config=GgufConfig(dequantize=True))
    except Exception as e:  # noqa: BLE001 - unsupported architecture, corrupt file: one line
        raise UserError(f"cannot convert GGUF file '{path}': {_one_line(e)}") from None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model, tokenizer


def gguf_tokens(path) -> list[str]:
    """The GGUF vocabulary, token i at index i."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.tokens")
    return [] if field is None else [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]


def check_same_vocab(tokenizer, path, where) -> None:
    """A tokenizer given in place of the GGUF's must hold the GGUF's vocabulary: every token at
    its own id (else every id the model was trained on would mean another token)."""
    tokens = gguf_tokens(path)
    vocab = tokenizer.get_vocab()
    # a SentencePiece vocabulary writes a space as ▁ where the GGUF may keep it (Gemma's runs of spaces)
    wrong = [(i, t) for i, t in enumerate(tokens) if i not in (vocab.get(t), vocab.get(t.replace(" ", "\u2581")))]
    if wrong:
        i, t = wrong[0]
        raise UserError(f"tokenizer '{where}' is not the vocabulary of GGUF file '{path}': {len(wrong)} of "
                        f"{len(tokens)} tokens differ (token {i} {t!r} has id {vocab.get(t)} there)")


def vocab_selftest(tokenizer, sample: int = 200) -> tuple[int, int]:
    """(how many, of how many) word tokens of the vocabulary encode back to their own single id:
    up to `sample` tokens spread over the ids, each a marker (▁, Ġ) or a letter and then three or
    more letters, not an added token. A tokenizer that splits them (a GGUF tokenizer whose merges
    or scores were not read: every word comes out letter by letter) scores near 0; a right one 1."""
    added = set(tokenizer.get_added_vocab())
    words = sorted((i, t) for t, i in tokenizer.get_vocab().items()
                   if t not in added and len(t) >= 4 and t[1:].isalpha())
    picked = words[::max(1, len(words) // sample)][:sample]
    ok = sum(tokenizer(tokenizer.convert_tokens_to_string([t]), add_special_tokens=False).input_ids == [i]
             for i, t in picked)
    return ok, len(picked)


def control_tokens(path) -> dict[str, int]:
    """The GGUF vocabulary's control tokens (llama.cpp's token type 3: <bos>, <eos>, a chat
    format's turn markers such as Gemma's <start_of_turn> / <end_of_turn>) -> their ids."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    types, tokens = reader.fields.get("tokenizer.ggml.token_type"), reader.fields.get("tokenizer.ggml.tokens")
    if types is None or tokens is None:
        return {}
    out = {}
    for k, (ti, si) in enumerate(zip(types.data, tokens.data)):
        if int(types.parts[ti][0]) == 3:
            out[bytes(tokens.parts[si]).decode("utf-8", "replace")] = k
    return out


def mark_special(tokenizer, control: dict[str, int]) -> list[str]:
    """Make each control token an added special token of `tokenizer` where it is an ordinary
    vocabulary entry of the same id: matched whole before the model splits text, dropped by
    skip_special_tokens. transformers' GGUF reader does so for some versions and not others (Gemma
    3 270M: 6,384 added tokens on 5.24, 5 on 5.17, without <end_of_turn>, so a chat template's
    turn end is no token of its own there). Returns the tokens marked."""
    from tokenizers import AddedToken

    added = set(tokenizer.get_added_vocab())
    marked = [t for t, i in control.items() if t not in added and tokenizer.convert_tokens_to_ids(t) == i]
    if marked:
        n = len(tokenizer)
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in marked], special_tokens=True)
        assert len(tokenizer) == n, "a control token got a new id"
    return marked


def convert_gguf(path, out, chat_template: str | None = None, tokenizer: str | None = None) -> Path:
    """Write the GGUF file `path` as a bf16 HF folder (config, model.safetensors, tokenizer with its
    chat template, or `chat_template` in its place) at `out`; returns `out`. `tokenizer`: an HF
    tokenizer folder with the GGUF's vocabulary, used instead of the GGUF's own. The folder loads
    with `from_pretrained` and no gguf."""
    import torch

    path, out = Path(path).expanduser(), Path(out).expanduser()
    model, tokenizer = load_dequantized(path, tokenizer=tokenizer)  # fp32: each weight rounded to bf16 once
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    if tokenizer.pad_token is None:  # as tether.models.load_tokenizer does: EOS stands in
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / DONE).write_text(f"{path.resolve()}\nsha256 {file_sha256(path)}\n")
    return out


def ensure_converted(path) -> Path:
    """The converted folder of the GGUF file `path`, converting it on first use only: the cache
    entry is named by the file's sha256, so an unchanged file (under any name) is never converted
    twice, and a changed one gets a new entry. Processes that ask at once (torchrun ranks) wait
    on a lock and the first converts; a conversion is renamed into place only once complete."""
    path = Path(path).expanduser()
    _check_file(path)
    digest = file_sha256(path)
    root = cache_root()
    target = root / digest[:24]
    if (target / DONE).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{digest[:24]}.lock", "w") as lock:
        try:
            import fcntl
            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no fcntl (Windows): ranks may convert twice; the rename below is safe
            pass
        if (target / DONE).exists():  # another process converted it while we waited
            return target
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:24]}.", dir=root))
        try:
            convert_gguf(path, tmp)
            if target.exists():  # a partial folder left by a killed conversion
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    # said after, not before: a file that fails to convert gets its one-line error and nothing else
    print(f"converted GGUF {path} -> {target} in {time.perf_counter() - t0:.0f} s (once; later "
          f"uses of this file load the folder)", file=sys.stderr)
    return target
