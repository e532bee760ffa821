"""Run under torchrun (2 processes, gloo): distributed.cat_ranks on uneven row counts and several
dtypes must equal the concatenation every rank's rows make in rank order, and max_float the
largest value or NaN when any rank has one; distributed.accumulation over a model sharded with
defer_grad_sync reduces nothing before the last micro-batch and then the same gradient as a
backward-by-backward reduction; distributed.replicate and sum_gradients; an untied LM head sharded
as its own FSDP2 unit under the chunked head; FSDP2's bf16 gradient reduction (tests/test_distributed.py)."""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TETHER_DIST_BACKEND", "gloo")
from tether import distributed  # noqa: E402


def rows(rank: int, dtype) -> torch.Tensor:
    n = 3 if rank == 0 else 1  # uneven: the longer rank's padding must not leak into the result
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, 2, generator=g) * 10
    return x > 0 if dtype == torch.bool else x.to(dtype)


distributed.init()
r, bad = distributed.rank(), []
for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
    got = distributed.cat_ranks(rows(r, dtype))
    want = torch.cat([rows(k, dtype) for k in range(distributed.world_size())])
    if got.dtype != dtype or not torch.equal(got, want):
        bad.append(str(dtype))
got = distributed.cat_ranks(torch.empty(0) if r else torch.arange(3.0))  # a rank with no rows
if not torch.equal(got, torch.arange(3.0)):
    bad.append("empty rank")
try:  # ranks that disagree on dtype: one clear error on every rank (a gloo collective of mismatched dtypes aborts the process)
    distributed.cat_ranks(torch.zeros(2, dtype=torch.int64 if r else torch.float32))
    bad.append("mismatched dtypes accepted")
except ValueError as e:
    if "differ in dtype" not in str(e):
        bad.append("mismatch message")
try:  # trailing dims that disagree: the same
    distributed.cat_ranks(torch.zeros(2, 3 + r))
    bad.append("mismatched shapes accepted")
except ValueError:
    pass
got = distributed.cat_ranks(torch.arange(6.0).view(2, 3).t() + r)  # non-contiguous rows: [3, 2] each
if not torch.equal(got, torch.cat([torch.arange(6.0).view(2, 3).t() + k for k in range(2)])):
    bad.append("non-contiguous")
if distributed.max_float(float(r) - 5) != -4.0:  # the larger of -5 and -4
    bad.append("max_float")
if not math.isnan(distributed.max_float(float("nan") if r == 1 else 3.0)):  # one rank's NaN wins
    bad.append("max_float nan")


def accumulated(defer: bool):
    """Three micro-batches of a tiny 3-layer model (per-rank data), then one more backward outside
    the loop; deferred: sharded with 2 layers a unit (a full and a partial group). Returns (whether
    any sharded gradient existed after the first backward, the local gradient shards after the
    loop, after the extra backward)."""
    from tether.models.tiny import tiny_config
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(40, hidden_size=32, num_layers=3, num_heads=2,
                                                         num_kv_heads=1, intermediate_size=64)).float()
    distributed.shard(model, list(model.model.layers), defer_grad_sync=defer, unit_layers=2 if defer else 1)
    g = torch.Generator().manual_seed(10 + r)

    def backward():
        ids = torch.randint(3, 40, (2, 6), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()

    def grads():
        return [None if p.grad is None else distributed.local(p.grad).clone() for p in model.parameters()]
    early = None
    for i in distributed.accumulation(model, range(3)):
        backward()
        if i == 0:
            early = any(p.grad is not None for p in model.parameters())
    after_loop = grads()
    backward()  # outside any loop: the sync must be back on (the generator's finally)
    return early, after_loop, grads()


def differ(a, b) -> bool:
    return any(x is None or y is None or float((x - y).abs().max()) > 1e-6 for x, y in zip(a, b))


early_plain, plain, plain_more = accumulated(False)
early_defer, deferred, deferred_more = accumulated(True)
if not early_plain or early_defer:  # reduced after every backward vs only after the last
    bad.append(f"deferral (reduced after the first backward: plain {early_plain}, deferred {early_defer})")
if differ(plain, deferred):
    bad.append("deferred gradient")
if differ(plain_more, deferred_more):  # still deferred after the loop: the extra backward unreduced
    bad.append("sync not restored after the loop")


def replicated_sum():
    """distributed.replicate + sum_gradients: rank 1's different initial weights become rank 0's;
    after per-rank backwards the gradients are the sum of what each rank computed (checked against
    a plain model fed both ranks' data), over several buckets (a bucket smaller than the embedding,
    so that one goes alone); a parameter only rank 1 used gets rank 1's gradient on both, one no
    rank used keeps None."""
    from tether.models.tiny import tiny_config
    from transformers import AutoModelForCausalLM
    torch.manual_seed(r)  # different on each rank: replicate must broadcast rank 0's
    cfg = tiny_config(40, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    model = AutoModelForCausalLM.from_config(cfg).float()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float()  # rank 0's weights, fed every rank's data
    distributed.replicate(model)
    extra, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    data = [torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(20 + k)) for k in range(2)]
    model(input_ids=data[r], labels=data[r]).loss.backward()
    if r == 1:
        (extra * 2.0).sum().backward()
    for ids in data:
        ref(input_ids=ids, labels=ids).loss.backward()
    keep, distributed.GRAD_BUCKET_BYTES = distributed.GRAD_BUCKET_BYTES, 4096
    try:
        distributed.sum_gradients(list(model.parameters()) + [extra, unused])
    finally:
        distributed.GRAD_BUCKET_BYTES = keep
    out = []
    if any(not torch.equal(p, q) for p, q in zip(model.state_dict().values(), ref.state_dict().values())):
        out.append("replicate broadcast")
    if any(float((p.grad - q.grad).abs().max()) > 1e-5 for p, q in zip(model.parameters(), ref.parameters())):
        out.append("summed gradient")
    if extra.grad is None or not torch.equal(extra.grad, torch.full((3,), 2.0)) or unused.grad is not None:
        out.append("gradient of a parameter one rank or no rank used")
    return out


bad += replicated_sum()


def untied_head():
    """An untied head is an FSDP2 unit of its own (distributed.shard) and the chunked LM head still
    runs on it (models/logprobs._split_head knows FSDP2's Linear): two forward/backward passes on
    per-rank data, with a no-grad forward between (the head must be resharded after it: the hook),
    give the summed gradients of a plain model fed both ranks' data."""
    from torch.distributed.fsdp import FSDPModule
    from tether.models import logprobs
    from tether.models.tiny import tiny_config
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(40, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float()
    distributed.shard(model, list(model.model.layers))
    out = []
    if not isinstance(model.lm_head, FSDPModule) or logprobs._split_head(model) is None:
        out.append("untied head: not its own unit, or the chunked head refused it")
    keep, logprobs.HEAD_CHUNK_ELEMENTS = logprobs.HEAD_CHUNK_ELEMENTS, 40 * 4  # 4 tokens a chunk
    try:
        def batch(k):
            ids = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(30 + k))
            cm = torch.ones_like(ids)
            cm[:, :3] = 0
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": cm}

        def loss(m, k):
            lp, _ = logprobs.completion_token_logps(m, batch(k), 1.0, torch.autocast("cpu", enabled=False))
            return -(lp * torch.arange(7.0)).sum()
        for step in range(2):
            loss(model, 2 * step + r).backward()
            with torch.no_grad():
                loss(model, 9)
            if not isinstance(model.lm_head.weight, torch.distributed.tensor.DTensor):
                out.append("untied head: still gathered after a no-grad forward")
            for k in (2 * step, 2 * step + 1):
                loss(ref, k).backward()
    finally:
        logprobs.HEAD_CHUNK_ELEMENTS = keep
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.grad is None or float((distributed.full(p.grad) - q.grad).abs().max()) > 1e-5:
            out.append(f"untied head: gradient of {name}")
            break
    return out


bad += untied_head()


def bf16_reduction():
    """model.fsdp_reduce=bf16 (distributed.shard reduce_bf16): FSDP2 sums the ranks' bf16
    gradients in bf16 — the sharded fp32 gradient differs from the fp32-reduced one by bf16's
    rounding (nonzero, within 2^-7 relative) — and keeps it in fp32 beside the fp32 weights."""
    from tether.models.tiny import tiny_config
    from transformers import AutoModelForCausalLM
    grads = {}
    for reduce_bf16 in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(40, hidden_size=32, num_layers=2, num_heads=2,
                                                             num_kv_heads=1, intermediate_size=64)).float()
        distributed.shard(model, list(model.model.layers), bf16=True, reduce_bf16=reduce_bf16)
        ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(40 + r))
        model(input_ids=ids, labels=ids).loss.backward()
        if any(p.grad.dtype != torch.float32 for p in model.parameters()):
            return ["bf16 reduction: sharded gradients not fp32"]
        grads[reduce_bf16] = [distributed.full(p.grad) for p in model.parameters()]
    rel = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(grads[False], grads[True]))
    return [] if 0 < rel <= 2 ** -7 else [f"bf16 reduction: relative difference {rel}"]


bad += bf16_reduction()
if r == 0:
    print("BAD " + ",".join(bad) if bad else "OK")
distributed.leave()  # together, and without aborting at exit (see there)
