"""`tether init-model`: a small model from scratch for your own task — a transformers config (Llama,
Qwen2 or Gemma 3 family) with random weights and a character tokenizer whose vocabulary is the characters
of your data (or the ones you give), written as a normal Hugging Face folder that every command
takes as `model=`.

Why characters: a from-scratch model on a narrow task (arithmetic, a toy language, strings of
symbols) needs no subword vocabulary, and one token per character keeps the embedding table tiny
and every character of the data representable. The model and tokenizer come from
tether.models.tiny, the same code the quickstart's model comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tether.data import load_rows
from tether.errors import UserError
from tether.models.load import model_out_dir, quiet_hf_progress
from tether.models.tiny import CHARS, SPECIAL_TOKENS, make_tiny_model


@dataclass
class InitModelConfig:
    out: str = ""
    "directory to write the model to (config.json, model.safetensors, tokenizer files); must not hold a model unless overwrite=true"
    data: str = ""
    "data whose characters make the vocabulary: every string value of every row (any format tether reads: .jsonl, .json, .csv, .parquet, a saved dataset, a hub name)"
    split: str = "train"
    "split to read when `data` is a dataset directory or hub name"
    chars: str = ""
    "the vocabulary's characters: a file (its characters) or the characters themselves (quote digit-only strings); with data both count; neither: the built-in set (digits, ASCII letters, punctuation, whitespace, ×÷−)"
    family: Literal["llama", "qwen2", "gemma3"] = "llama"
    "architecture (all: GQA, RoPE, RMSNorm, tied embeddings; llama and qwen2: SwiGLU; gemma3: Gemma 3's layout, gelu-tanh MLP, four norms a layer, local layers over 32 tokens alternating with global ones)"
    hidden_size: int = 128
    "width of the residual stream"
    layers: int = 4
    "decoder layers"
    heads: int = 4
    "attention heads (hidden_size must be a multiple)"
    kv_heads: int = 2
    "key/value heads (grouped-query attention; heads must be a multiple)"
    intermediate_size: int = 0
    "MLP width (0 = 3 x hidden_size)"
    max_position_embeddings: int = 512
    "longest sequence the config declares (RoPE: no learned table)"
    seed: int = 0
    "seed of the random initialization"
    overwrite: bool = False
    "replace a model already in `out`"

    def __post_init__(self):
        for name in ("hidden_size", "layers", "heads", "kv_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.intermediate_size < 0:
            raise ValueError(f"intermediate_size must be >= 0; got {self.intermediate_size}")
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if (self.hidden_size // self.heads) % 2:
            raise ValueError(f"head size hidden_size/heads = {self.hidden_size // self.heads} must be "
                             f"even (RoPE rotates pairs of dimensions)")


def _strings(value: Any):
    """Every string inside a row's value (messages and other nested lists / dicts included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def vocabulary(cfg: InitModelConfig) -> list[str]:
    """The characters of the tokenizer: `chars` (a file's text or the string itself) and those of
    `data`, sorted for a vocabulary that does not depend on row order; the built-in set if neither
    is given. One-line errors name the file or the row."""
    found: set[str] = set()
    if cfg.chars:
        path = Path(cfg.chars).expanduser()
        if path.is_file():
            try:
                found |= set(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"chars file '{cfg.chars}' cannot be read as UTF-8 text: {e}") from None
        else:
            found |= set(cfg.chars)
    if cfg.data:
        rows = load_rows(cfg.data, cfg.split)  # DataError (a UserError) names file, row and field
        n = 0
        for row in rows:
            n += 1
            for text in _strings(row):
                found |= set(text)
        if not n:
            raise UserError(f"data '{cfg.data}' has no rows to take characters from")
    if not cfg.chars and not cfg.data:
        return list(CHARS)
    if not found:
        raise UserError("no characters found in " + " or ".join(
            f"{k} '{v}'" for k, v in (("chars", cfg.chars), ("data", cfg.data)) if v))
    return sorted(found)


def init_model(cfg: InitModelConfig) -> dict:
    """Write a random-init model + character tokenizer to `cfg.out`; returns what it wrote."""
    out = model_out_dir(cfg.out, cfg.overwrite)
    chars = vocabulary(cfg)  # every input is checked before anything is written
    restore = quiet_hf_progress()  # a one-file save: HF's "Writing model shards" bar is noise
    try:
        model, tokenizer = make_tiny_model(
            out, family=cfg.family, seed=cfg.seed, chars=chars, hidden_size=cfg.hidden_size,
            num_layers=cfg.layers, num_heads=cfg.heads, num_kv_heads=cfg.kv_heads,
            intermediate_size=cfg.intermediate_size or 3 * cfg.hidden_size,
            max_position_embeddings=cfg.max_position_embeddings)
    finally:
        restore()
    params = sum(p.numel() for p in model.parameters())
    summary = {"out": str(out), "family": cfg.family, "parameters": params, "vocab_size": len(tokenizer),
               "chars": "".join(chars), "special_tokens": list(SPECIAL_TOKENS)}
    shown = repr("".join(chars))[1:-1]  # whitespace as \n, \t; other characters as they are
    print(f"init-model: wrote {out}: {cfg.family}, {cfg.layers} layers, hidden {cfg.hidden_size}, "
          f"{params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)} = {len(chars)} characters "
          f"+ {len(SPECIAL_TOKENS)} special: {shown[:80]}{'...' if len(shown) > 80 else ''}")
    return summary
