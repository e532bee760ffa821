"""Generic sampling through Hugging Face `generate`: works for any causal LM.

This is the fallback path (and, until the fast engine lands, the only one): batched prompts of
different lengths are left-padded, completions are cut at EOS and decoded.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 64,
             do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, batch_size: int = 64, add_bos: bool = True) -> list[str]:
    """Completions (text after the prompt, special tokens dropped) for each prompt."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[str] = []
    bos = tokenizer.bos_token if add_bos and tokenizer.bos_token else ""
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        ids = [tokenizer(bos + p if not p.startswith(bos) else p, add_special_tokens=False).input_ids
               for p in chunk]
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        attn = torch.zeros((len(ids), width), dtype=torch.long)
        for j, seq in enumerate(ids):  # left padding: every prompt ends where generation starts
            input_ids[j, width - len(seq):] = torch.tensor(seq)
            attn[j, width - len(seq):] = 1
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad,
                      eos_token_id=tokenizer.eos_token_id)
        if do_sample:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
        else:  # silence "temperature is set but do_sample=False" from generation_config defaults
            kwargs.update(temperature=None, top_p=None, top_k=None)
        seqs = model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device),
                              **kwargs)
        for row in seqs[:, width:]:
            out.append(tokenizer.decode(row, skip_special_tokens=True))
    if was_training:
        model.train()
    return out
