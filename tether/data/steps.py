"""Steps of a completion, as a process reward model (PRM) reads them.

TRL's stepwise format holds a completion as a list of steps (`completions`) with one label each;
a PRM reads the prompt, then every step followed by a separator string, and is scored at the last
token of each step + separator (:func:`tether.data.tokenize.encode_stepwise`, as TRL's PRMTrainer).
To score a completion that was *generated* as one text, the same steps are recovered by cutting
the text at the separator (:func:`split_steps`) and encoded exactly as training encoded them
(:func:`encode_steps`), so the PRM sees at scoring time the token sequence it was trained on.
"""

from __future__ import annotations

from .chat import encode_text
from .tokenize import text_prompt_ids


def split_steps(text: str, separator: str) -> list[str]:
    """`text` cut at every `separator` (removed, as in the stepwise `completions`). A text ending in
    the separator (or in it and whitespace) has no empty last step; a text with no separator is
    one step. Joining the steps, each followed by the separator, gives the text back (plus one
    separator at the end when it had none)."""
    if not separator:
        raise ValueError("the step separator must be a non-empty string")
    pieces = text.split(separator)
    return pieces[:-1] if len(pieces) > 1 and not pieces[-1].strip() else pieces


def encode_steps(tokenizer, prompt: str, steps: list[str], separator: str,
                 max_length: int | None = None) -> tuple[list[int], list[int]]:
    """(token ids, index of the last token of each step) for `prompt` + Σ (step + separator),
    tokenized exactly as encode_stepwise does (prompt with BOS as the tokenizer adds it, each step
    + separator on its own). Over `max_length` only whole steps are kept, as in training; steps
    left out have no index (the list is shorter than `steps`)."""
    ids, ends = text_prompt_ids(tokenizer, prompt), []
    for step in steps:
        piece = encode_text(tokenizer, step + separator)
        if max_length is not None and len(ids) + len(piece) > max_length:
            break
        ids += piece
        ends.append(len(ids) - 1)
    return ids, ends
