"""The language-model side of AI feedback: chat prompts as token ids, generation through the fast
sampler (tether.rollout), and the log-probabilities of a few answer tokens read from one forward.

Why the answer is read as log-probabilities instead of parsed from generated text: the judge's
probability P(A) is what the swap debiasing averages and what a soft label keeps (Bai et al. 2022
§4.1 use the normalized probabilities of the options; Lee et al. 2023, RLAIF §2.1, the same), and
one forward over a batch of contexts gives it for every pair at once, with no sampling noise.
"""

from __future__ import annotations

import torch

from tether.data.chat import ChatTemplateError, common_prefix, encode_text, render
from tether.errors import UserError


def chat_text(tokenizer, messages: list[dict]) -> str:
    """`messages` rendered with the tokenizer's chat template, ending with the assistant prompt."""
    try:
        return render(tokenizer, messages, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise UserError(f"the judge/generator model's tokenizer: {e}") from None


def generate(model, tokenizer, conversations: list[list[dict]], *, max_new_tokens: int,
             temperature: float, seed: int, batch_size: int = 0) -> list[str]:
    """One assistant reply per conversation, sampled with tether's KV-cached sampler (greedy at
    temperature 0). Prompts go in as token ids of the chat template (which writes BOS itself)."""
    from tether.rollout import sample

    ids = [encode_text(tokenizer, chat_text(tokenizer, c)) for c in conversations]
    if not ids:
        return []
    ro = sample(model, tokenizer, ids, n=1, seed=seed, temperature=temperature,
                max_new_tokens=max_new_tokens, max_batch_size=batch_size)
    return [t.strip() for t in ro.texts]


def answer_contexts(tokenizer, texts: list[str], answers: tuple[str, ...]) -> tuple[list[list[int]], list[list[int]]]:
    """Per text: the context token ids and the id of each answer's first token after it.

    The boundary is found on token ids (text + answer tokenized whole, longest common prefix with
    the text alone), so a tokenizer that merges the answer with the text's last characters still
    reads the token the model would really produce. The answers' first tokens must differ."""
    contexts, answer_ids = [], []
    for text in texts:
        base = encode_text(tokenizer, text)
        fulls = [encode_text(tokenizer, text + a) for a in answers]
        k = min(common_prefix(base, f) for f in fulls)
        ids = [f[k] if len(f) > k else None for f in fulls]
        if None in ids or len(set(ids)) < len(ids):
            raise UserError(f"judge answers {list(answers)} do not start with distinct tokens for this "
                            f"tokenizer (first tokens {ids}); choose other answer strings")
        contexts.append(fulls[0][:k])
        answer_ids.append(ids)
    return contexts, answer_ids


@torch.no_grad()
def answer_logprobs(model, contexts: list[list[int]], answer_ids: list[list[int]],
                    batch_size: int = 8, pad_id: int = 0) -> torch.Tensor:
    """log π(a | context) for each context's answer tokens: [N, K] float32.

    One forward per batch of contexts, left-padded so every row's last position is its last token
    (positions count real tokens only, as the sampler's), logits kept for that position alone;
    contexts are batched by length so padding stays small."""
    n = len(contexts)
    out = torch.empty((n, len(answer_ids[0]) if n else 0), dtype=torch.float32)
    device = next(model.parameters()).device
    order = sorted(range(n), key=lambda i: len(contexts[i]))
    was_training = model.training
    model.eval()
    try:
        for s in range(0, n, max(1, batch_size)):
            idx = order[s:s + max(1, batch_size)]
            width = max(len(contexts[i]) for i in idx)
            ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, width - len(contexts[i]):] = torch.tensor(contexts[i])
                mask[r, width - len(contexts[i]):] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            kw = dict(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device))
            try:
                logits = model(**kw, logits_to_keep=1).logits[:, -1]
            except TypeError:  # a model class without logits_to_keep
                logits = model(**kw).logits[:, -1]
            lp = torch.log_softmax(logits.float(), -1)
            tok = torch.tensor([answer_ids[i] for i in idx], device=lp.device)
            out[idx] = lp.gather(1, tok).cpu()
    finally:
        model.train(was_training)
    return out
