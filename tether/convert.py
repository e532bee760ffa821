"""`tether convert model=<file.gguf> out=<dir>`: a GGUF checkpoint (llama.cpp's quantized
single-file format) as a normal bf16 Hugging Face folder with its tokenizer and chat template,
which every command then takes as `model=` with no gguf package involved. `chat_template=FILE`
gives the tokenizer a template when the GGUF has none (a base model) or replaces the file's;
`tokenizer=DIR` writes that folder's tokenizer instead of the file's (it must hold the file's
vocabulary), for transformers versions that misread a GGUF's tokenizer (5.17 and Gemma 3).

The conversion itself is tether.models.gguf (dequantized by transformers' own GGUF loader, the
quantizer detached). Trainers do not need this command: a `model=` path ending in .gguf is
converted on first use into a cache (docs/models.md); this command is for a folder of your own.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tether.errors import UserError
from tether.models.gguf import convert_gguf
from tether.models.load import model_out_dir


@dataclass
class ConvertConfig:
    model: str = ""
    "the GGUF file to convert (*.gguf; reading it needs `pip install 'tether[gguf]'`)"
    out: str = ""
    "directory to write the bf16 HF model to (config.json, model.safetensors, tokenizer files); must not hold a model unless overwrite=true"
    overwrite: bool = False
    "replace a model already in `out`"
    chat_template: str = ""
    "a Jinja chat template file for the tokenizer, replacing the GGUF's (a base model's GGUF often has none, and environments and chat need one); '' keeps the file's"
    tokenizer: str = ""
    "an HF tokenizer folder to write instead of the GGUF's own (for a transformers version that misreads the file's tokenizer); it must hold the GGUF's vocabulary, every token at its id; '' reads the file's"


def run_convert(cfg: ConvertConfig) -> dict:
    if not cfg.model:
        raise UserError("convert: `model` is required (the .gguf file to convert)")
    template = None
    if cfg.chat_template:
        path = Path(cfg.chat_template).expanduser()
        if not path.is_file():
            raise UserError(f"convert: chat_template file '{path}' does not exist")
        template = path.read_text()
    if cfg.tokenizer and not (Path(cfg.tokenizer).expanduser() / "tokenizer_config.json").is_file():
        raise UserError(f"convert: tokenizer folder '{cfg.tokenizer}' holds no tokenizer_config.json")
    out = model_out_dir(cfg.out, cfg.overwrite)
    t0 = time.perf_counter()
    # checks the file (exists, GGUF, gguf installed) and the tokenizer before writing
    convert_gguf(cfg.model, out, chat_template=template, tokenizer=cfg.tokenizer or None)
    seconds = time.perf_counter() - t0
    print(f"convert: wrote {out} (bf16) from {cfg.model} in {seconds:.1f} s", file=sys.stderr)
    return {"out": str(out), "model": cfg.model, "seconds": round(seconds, 1)}
