"""Helpers for the data-layer tests (no tests here): a local char-level tokenizer with a chat
template, fixture paths and small file writers. Nothing touches the network or ../shared."""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

FIXTURES = Path(__file__).parent / "fixtures" / "data"

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]

# ChatML-like: BOS from the template, "\n" printed after each <|im_end|> (must not be trained on).
CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Zephyr-like: plain-text role headers, EOS closes every turn, a default system prompt is
# injected when none is given (templates that alter the conversation must still mask right).
ZEPHYR = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.</s>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(template: str | None = CHATML, bos: bool = True) -> PreTrainedTokenizerFast:
    """One token per character (ASCII + Latin-1/Latin Extended + typographic quotes), with
    <s>/</s>/<pad>/<unk> and ChatML markers as special tokens. Builds in about a millisecond."""
    chars = sorted(set(string.printable) | {chr(c) for c in range(0xA0, 0x250)} | set("’‘“”—–…"))
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    # bos=True: Llama-like, the post-processor starts every text with <s> (tether prepends BOS to
    # plain text only when the tokenizer itself would); bos=False: no BOS token at all (Qwen-like)
    kwargs = {"bos_token": "<s>", "add_bos_token": True} if bos else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", extra_special_tokens=["<|im_start|>", "<|im_end|>"],
                                  **kwargs)
    tok.chat_template = template
    return tok


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def masked_text(tok, example: dict) -> str:
    """The text of the tokens the loss trains on."""
    ids = [t for t, m in zip(example["input_ids"], example["completion_mask"]) if m]
    return tok.decode(ids)


def assert_one_line(err: BaseException, *parts: str) -> str:
    """The error message is exactly one line and contains every part (file, row, field, ...)."""
    msg = str(err)
    assert "\n" not in msg and msg.strip() == msg and msg, repr(msg)
    for p in parts:
        assert p in msg, f"{p!r} not in {msg!r}"
    return msg
