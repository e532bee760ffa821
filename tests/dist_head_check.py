"""Run under torchrun (tests/test_distributed.py): the chunked LM head of an FSDP2-sharded model
(models/logprobs._sharded_chunked_head) gives the log-probs, entropies and gradients of the plain
full-logits forward of the unsharded model. Prints one JSON line on rank 0."""

import copy
import json
import sys

import torch

import tether.models.logprobs as L
from tether import distributed
from transformers import AutoModelForCausalLM

from tether.models.tiny import tiny_config
from tether.models.load import decoder_layers

distributed.init()
torch.manual_seed(0)
family, tied = (sys.argv[1:] + ["llama", "tied"])[:2]
cfg = tiny_config(120, family=family)
cfg.tie_word_embeddings = tied == "tied"  # untied: the head is its own weight (Qwen2.5-7B's shape)
model = AutoModelForCausalLM.from_config(cfg)
model.float()
plain = copy.deepcopy(model)
distributed.shard(model, decoder_layers(model))

g = torch.Generator().manual_seed(1)
B, T = 8, 14
ids = torch.randint(3, 100, (B, T), generator=g)
cmask = torch.zeros(B, T, dtype=torch.long)
for b in range(B):  # completions of different lengths: per-rank token counts differ
    cmask[b, 5 + b % 4:] = 1
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": cmask}
weights = torch.randn(B, T, generator=g)
n_global = float(cmask[:, 1:].sum())

# the plain path: the unsharded model, full logits (chunk budget above B*T*V)
L.HEAD_CHUNK_ELEMENTS = 1 << 30
ref_lp, ref_ent = L.completion_token_logps(plain, batch, 0.7, torch.autocast("cpu", enabled=False),
                                           want_entropy=True, entropy_grad=True)
((ref_lp * weights).sum() / n_global + 0.1 * ref_ent).backward()

# the sharded chunked path: this rank's rows, a budget of a few tokens per chunk
L.HEAD_CHUNK_ELEMENTS = 3 * model.config.vocab_size
rows = list(range(distributed.rank(), B, distributed.world_size()))
mine = {k: v[rows] for k, v in batch.items()}
assert L._split_head(model) is not None
lp, ent = L.completion_token_logps(model, mine, 0.7, torch.autocast("cpu", enabled=False),
                                   want_entropy=True, entropy_grad=True)
# entropy is a per-rank mean: weight it by the rank's token share to make the global mean
n_mine = float(mine["completion_mask"][:, 1:].sum())
((lp * weights[rows]).sum() / n_global + 0.1 * ent * n_mine / n_global).backward()

lp_err = float((lp - ref_lp[rows]).detach().abs().max())
ent_all = distributed.sum_floats([float(ent.detach()) * n_mine])[0] / n_global
grads = {n: distributed.full(p.grad) for n, p in model.named_parameters()}
grad_err = max(float((grads[n] - p.grad).abs().max()) for n, p in plain.named_parameters())
errs = distributed.all_gather_object(lp_err)
if distributed.rank() == 0:
    print(json.dumps({"lp_err": max(errs), "ent_err": abs(ent_all - float(ref_ent)), "grad_err": grad_err,
                      "head_grad_norm": float(grads["lm_head.weight"].norm())
                      if "lm_head.weight" in grads else float(grads["model.embed_tokens.weight"].norm())}))
distributed.leave()  # together, and without aborting at exit (see there)
