"""Sampling settings, the per-sequence random streams, and one sampling step on a [B, V] logit row.

Which distribution the returned log-probs belong to (the trainer's ratio must use the same one):

    logprob_t = log_softmax(z_t / T)[y_t]      z_t: the raw logits, full vocabulary, T = temperature

i.e. temperature-scaled, and *not* renormalized over the top-k / top-p / min-p support. This is what
``tether.objectives.logprobs.token_logps(logits, input_ids, temperature=T)`` computes from a training
forward, and what TRL and verl use for the PPO/GRPO ratio. Truncation only decides which tokens may be
drawn. Greedy decoding (``temperature=0``) returns log-probs at T = 1 (``Rollout.logprob_temperature``).

Randomness: each sequence owns a stream of uniforms keyed by (seed, its prompt's token ids, how many
sequences with the same prompt came before it). A token is drawn by inverse-CDF sampling with one
uniform per step, so a sequence's tokens do not depend on which other prompts share its batch, on
padding, on batch compaction or on the device's RNG — only on the seed and the logits.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .kernels import block_stats, draw, sampling_available


@dataclass
class SamplingConfig:
    max_new_tokens: int = 256
    "most tokens generated per sequence (finish reason 'length' when reached)"
    temperature: float = 1.0
    "softmax temperature; 0 = greedy (argmax), its log-probs are then reported at temperature 1"
    top_k: int = 0
    "sample among the k most likely tokens only (0 = off)"
    top_p: float = 1.0
    "nucleus: the smallest set of most likely tokens holding at least this probability (1 = off)"
    min_p: float = 0.0
    "drop tokens whose probability is below min_p x the most likely token's (0 = off)"
    stop: list[str] = field(default_factory=list)
    "stop strings: a sequence ends with the token that completes one (kept in ids and text)"
    stop_token_ids: list[int] = field(default_factory=list)
    "extra end-of-sequence token ids besides the tokenizer's / generation_config's EOS"
    ignore_eos: bool = False
    "keep generating past EOS (benchmarks: every sequence gets max_new_tokens)"
    add_bos: bool = True
    "string prompts: prepend BOS when the tokenizer itself would (tether.data.bos_ids; skipped if present)"
    max_batch_size: int = 0
    "sequences decoded at once; more are run in consecutive waves (0 = all at once)"
    backend: str = "auto"
    "'native' (own forward for Llama/Mistral/Qwen2/Qwen3/Gemma 3 over the HF modules), 'hf' (HF forward + DynamicCache), or 'auto'"
    cuda_graphs: bool = True
    "capture the decode step in CUDA graphs (native backend on CUDA only)"
    sync_every: int = 0
    "decode steps between host checks for finished rows and stop strings (0 = 1 on CPU, 8 on CUDA)"
    prefill_tokens: int = 0
    "native backend: prompt tokens per prefill chunk, bounding the prefill's activations (0 = a quarter of the batch's prompt tokens, within 2048..8192)"

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("top_k must be >= 0 and max_new_tokens >= 1")
        if self.backend not in ("auto", "native", "hf"):
            raise ValueError(f"backend must be 'auto', 'native' or 'hf', got {self.backend!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def graph_key(self) -> tuple:
        """The settings baked into a captured decode step."""
        return (self.temperature, self.top_k, self.top_p, self.min_p, self.ignore_eos)


def draw_seed() -> int:
    """A seed from torch's global RNG, so callers that fork or seed it get reproducible samples."""
    return int(torch.randint(0, 2**62, (1,)).item())


def sequence_keys(seed: int, prompts: list[list[int]]) -> list[int]:
    """One 63-bit key per sequence: hash(seed, prompt ids, occurrence of that prompt so far).
    The occurrence index keeps n samples of one prompt (and repeated prompts) distinct."""
    seen: Counter = Counter()
    keys = []
    for ids in prompts:
        ident = ",".join(map(str, ids))
        j = seen[ident]
        seen[ident] += 1
        digest = hashlib.blake2b(f"{seed}|{j}|{ident}".encode(), digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little") >> 1)
    return keys


def uniforms(keys: list[int], steps: int) -> Tensor:
    """[len(keys), steps] float32 uniforms in [0, 1), row i from a generator seeded by keys[i]."""
    out = torch.empty(len(keys), steps)
    g = torch.Generator()
    for i, k in enumerate(keys):
        g.manual_seed(k)
        torch.rand(steps, generator=g, out=out[i])
    return out


# Inverse-CDF sampling runs in two levels over blocks of this many tokens: block sums (a fast
# reduction), a scan over ~V/CDF_BLOCK block sums, then a scan inside one block per row. A scan over
# the whole vocabulary is several times slower on GPU than a reduction (cumsum kernels are latency
# bound); with V = 152k the two-level draw costs about one pass over the probabilities.
CDF_BLOCK = 1024


def _inverse_cdf(w: Tensor, u: Tensor) -> Tensor:
    """Index of the first token whose cumulative weight reaches u * sum(w), per row ([B, 1] int64).
    ``w`` [B, V] float32, non-negative, unnormalized; ``u`` [B] in [0, 1)."""
    B, V = w.shape
    if V <= 2 * CDF_BLOCK:
        # One block (small vocabularies, e.g. the quickstart's 108 characters): the same sums and
        # scan as below with the block levels elided — the same draw, a third of the ops (on CPU a
        # decode step is op-bound: 90-99 -> 24 us per draw at batch 32 x 108, of a ~1.7 ms step).
        total = w.sum(-1, keepdim=True)
        target = (u.to(w.dtype)[:, None] * total).clamp_min(torch.finfo(w.dtype).tiny)
        wb = w.cumsum(-1)
        return torch.minimum(torch.searchsorted(wb, target), torch.searchsorted(wb, wb[:, -1:].contiguous()))
    blk = CDF_BLOCK
    nb = -(-V // blk)
    head = w[:, :(nb - 1) * blk].reshape(B, nb - 1, blk).sum(-1)
    cs = torch.cat([head, w[:, (nb - 1) * blk:].sum(-1, keepdim=True)], 1).cumsum_(-1)
    target = (u.to(cs.dtype)[:, None] * cs[:, -1:]).clamp_min(torch.finfo(cs.dtype).tiny)
    bi = torch.searchsorted(cs, target).clamp_max(nb - 1)  # the block holding the target
    before = cs.gather(1, (bi - 1).clamp_min(0)).masked_fill(bi == 0, 0.0)
    cols = bi * blk + torch.arange(blk, device=w.device)
    wb = w.gather(1, cols.clamp_max(V - 1)).masked_fill_(cols >= V, 0.0).cumsum_(-1)
    j = torch.searchsorted(wb, target - before)
    # Rounding (block sums vs the in-block scan) may push the target past the block's last
    # positive-weight token; never go beyond it, so a zero-weight (filtered) token is never drawn.
    j = torch.minimum(j, torch.searchsorted(wb, wb[:, -1:].contiguous()))
    return bi * blk + j


def _sample_blockwise(logits: Tensor, u: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Full-vocabulary sampling at ``temperature`` in two Triton kernels: per-block statistics (one
    read of the logits, :func:`kernels.block_stats`), then the draw from them (:func:`kernels.draw`,
    one program a row: the block, then the token inside it, and its log-prob) — the same inverse-CDF
    draw as :func:`_inverse_cdf` on softmax(z / T), without materializing the float32 [B, V]
    probabilities (on an H100 at batch 256 those cost a bf16 → fp32 copy and a softmax, 0.33 ms of a
    3 ms decode step) and in two kernels where torch's ops of the same draw take fifteen."""
    V = logits.shape[1]
    blk = CDF_BLOCK if V > 2 * CDF_BLOCK else V
    M, S = block_stats(logits, temperature, blk)
    return draw(logits, M, S, u, temperature, blk)


def sample_tokens(logits: Tensor, u: Tensor, cfg: SamplingConfig) -> tuple[Tensor, Tensor]:
    """Draw one token per row of ``logits`` [B, V] with uniforms ``u`` [B].

    Returns (token ids [B] int64, log-probs [B] float32) with the log-prob under the full-vocabulary
    temperature-scaled softmax (module docstring). Every op is shape-static, so the function can be
    captured in a CUDA graph.
    """
    if cfg.greedy:
        lp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        y = logits.argmax(-1)
        return y, lp.gather(1, y[:, None]).squeeze(1)
    if (cfg.top_k == 0 and cfg.top_p >= 1.0 and cfg.min_p == 0.0 and logits.stride(-1) == 1
            and sampling_available(logits)):  # CUDA + Triton: the common RL setting, no [B, V] copy
        return _sample_blockwise(logits, u, cfg.temperature)
    # The full tempered distribution (its log at the drawn token is the returned log-prob: equal to
    # log_softmax to ~1e-7); at T = 1 the float32 upcast is fused into the softmax.
    if cfg.temperature == 1.0:
        p = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        p = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    w = p  # weights to draw from; truncation zeroes some, none is renormalized
    top = None
    if 0 < cfg.top_k < p.shape[-1]:
        top = torch.topk(p, cfg.top_k, dim=-1).values  # sorted, descending
        w = w.masked_fill(p < top[:, -1:], 0.0)  # ties with the k-th are kept, as in HF
    if cfg.top_p < 1.0:
        # after top-k only its k values matter: no sort over the whole vocabulary
        ws = top if top is not None else torch.sort(w, dim=-1, descending=True).values
        cum = ws.cumsum(-1)
        # keep a token if the mass strictly before it is < top_p (of what top-k left): the most
        # likely token always stays. Filtering by value keeps ties at the boundary.
        kept = ((cum - ws) < cfg.top_p * cum[:, -1:]).sum(-1, keepdim=True)
        w = w.masked_fill(w < ws.gather(1, kept - 1), 0.0)
    if cfg.min_p > 0.0:
        w = w.masked_fill(w < cfg.min_p * w.amax(-1, keepdim=True), 0.0)
    y = _inverse_cdf(w, u)
    return y.squeeze(1), p.gather(1, y).log_().squeeze(1)
