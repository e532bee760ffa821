"""A tiny model from scratch: a real transformers config with random weights and a tokenizer
built locally with `tokenizers`, saved in HF format.

Why not a toy module: every code path downstream (from_pretrained, save_pretrained, generate,
chat templates, LoRA targets) is then the one a real model takes, yet it trains in seconds on CPU.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>",
                  "<|end|>"]
# Everything the embedded tasks and ordinary English text need, one token per character.
CHARS = list(string.digits + string.ascii_letters + " \n\t" + string.punctuation) + ["×", "÷", "−"]

# A minimal chat template in the tokenizer, so conversational data takes the real
# apply_chat_template path. The assistant turn ends with <|end|>, which is also a stop token.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def char_tokenizer(chars: Iterable[str] | None = None) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: a BPE model with no merges splits text into characters.

    `chars`: the vocabulary's characters, one token each in the order given (repeats dropped);
    default CHARS. A character outside them encodes as <unk>."""
    chars = CHARS if chars is None else unique_chars(chars)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # join characters back without inserting spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    # add_bos_token: its post-processor starts every encoded text with <bos>, as Llama's does; tether
    # prepends BOS to plain text only when the tokenizer itself would (tether.data.bos_ids)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", add_bos_token=True)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    return fast


def unique_chars(chars: Iterable[str]) -> list[str]:
    """`chars` as a list of distinct single characters in first-seen order; ValueError otherwise."""
    out = list(dict.fromkeys(chars))
    bad = [c for c in out if not isinstance(c, str) or len(c) != 1]
    if bad:
        raise ValueError(f"chars must be single characters; got {bad[0]!r}")
    if not out:
        raise ValueError("chars is empty: the tokenizer needs at least one character")
    return out


def tiny_config(vocab_size: int, family: str = "llama", hidden_size: int = 128,
                num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 384, max_position_embeddings: int = 512,
                bos_token_id: int = 1, eos_token_id: int = 2, pad_token_id: int = 0,
                sliding_window: int = 32):
    """A transformers config of the Llama or Qwen2 family (GQA, RoPE, SwiGLU, RMSNorm), or of Gemma 3
    (``gemma3``: four norms a layer, q/k norms, gelu-tanh MLP, scaled embedding; its layers alternate
    local attention over ``sliding_window`` tokens, RoPE base 10k, and global attention, base 1M)."""
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                  tie_word_embeddings=True, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                  pad_token_id=pad_token_id, rope_theta=10000.0)
    if family == "llama":
        return LlamaConfig(**kwargs)
    if family == "qwen2":
        return Qwen2Config(**kwargs)
    if family == "gemma3":
        kwargs.pop("rope_theta")
        head_dim = hidden_size // num_heads
        return Gemma3TextConfig(**kwargs, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                                sliding_window=sliding_window,
                                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                             for i in range(num_layers)])
    raise ValueError(f"tiny model family must be 'llama', 'qwen2' or 'gemma3'; got {family!r}")


def make_tiny_model(out_dir: str | Path | None = None, family: str = "llama", seed: int = 0,
                    chars: Iterable[str] | None = None, **shape):
    """Random-init tiny model + char tokenizer over `chars` (default CHARS, see char_tokenizer);
    saved to `out_dir` in HF format when given. `shape`: tiny_config's sizes. From the command
    line, with the characters read from your data: `tether init-model` (tether/init_model.py)."""
    import torch

    tokenizer = char_tokenizer(chars)
    cfg = tiny_config(len(tokenizer), family=family, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    return model, tokenizer
