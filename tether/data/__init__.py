"""tether's data layer: load rows, detect/validate formats, tokenize with loss masks, collate.

Typical use by a trainer::

    from tether.data import load_data, encode_sft, pad_batch
    rows = load_data("data/train.jsonl", expect=("language-modeling", "prompt-completion"))
    examples, report = encode_sft(rows, tokenizer, max_length=1024)
    batch = pad_batch(examples[:8], tokenizer.pad_token_id)

Every problem with user data is a one-line :class:`DataError`: ``<file>:<row>:<field>: <what>``.
See docs/data.md.
"""

from .chat import encode_messages, encode_prompt_response, render
from .collate import (LengthGroupedBatchSampler, collate_sequences, join_prompt_response, pack_batch, pad_batch,
                      pad_preference_batch, sequence_sums)
from .errors import DataError
from .formats import FORMATS, ROLES, RowChecker, check_format, detect_format, detect_style, validate
from .load import load_rows
from .pipeline import load_data, prepare
from .prompts import (extract_shared_messages, extract_shared_prompt, hh_to_conversational, hh_to_messages,
                      to_explicit_prompt)
from .rows import Rows, StreamingRows, as_rows
from .tokenize import (EncodeReport, bos_ids, encode_lm, encode_preference, encode_prompt_completion,
                       encode_prompts, encode_sft, encode_stepwise, encode_unpaired)

__all__ = [
    "DataError", "Rows", "StreamingRows", "as_rows",
    "load_rows", "load_data", "prepare",
    "FORMATS", "ROLES", "detect_format", "detect_style", "check_format", "validate", "RowChecker",
    "extract_shared_prompt", "extract_shared_messages", "to_explicit_prompt", "hh_to_messages",
    "hh_to_conversational",
    "render", "encode_messages", "encode_prompt_response", "bos_ids",
    "EncodeReport", "encode_lm", "encode_prompt_completion", "encode_sft", "encode_preference",
    "encode_unpaired", "encode_prompts", "encode_stepwise",
    "pad_batch", "pack_batch", "collate_sequences", "sequence_sums", "join_prompt_response",
    "pad_preference_batch", "LengthGroupedBatchSampler",
]
