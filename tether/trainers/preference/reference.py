"""The offline trainer's per-sequence log-probs and its reference log-probs, computed once per run
and cached (docs/dpo.md, "Reference log-probs").

Cache: `<run>/reference_logps.safetensors` holds, per split, the reference model's per-sequence
summed completion log-probs (`train.chosen`, `train.rejected` for pairs; `train.completion` and
`train.kl` — the mismatched pairs KTO's reference point needs — for unpaired rows).
`reference_logps.json` holds a fingerprint of everything the numbers depend on (token ids of every
example, the reference model's config and weight-file sizes, dtype and precision, the KL pairing);
a cache whose fingerprint differs is stale and recomputed.

Under torchrun the ranks share the reference forwards out (the reference model, when one is
loaded, sharded like the policy), every rank gets every number, and rank 0 alone reads and writes
the cache. With whole micro-batches per rank the batches are one process's, and so is the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import torch

from tether import distributed
from tether.data import sequence_sums
from tether.models import load_model
from tether.models.load import hf_progress
from tether.models.logprobs import completion_token_logps, packing_layout
from tether.models.lora import adapters_off
from tether.trainers.preference.data import KL_PAIRING_SEED, collate, collate_mismatched, kl_partners

logger = logging.getLogger("tether.offline")
CACHE_FILE, CACHE_META = "reference_logps.safetensors", "reference_logps.json"


def completion_logps(model, batch: dict, device, amp) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion log-prob [N], completion length [N]) for every sequence of a batch: the
    rows of a padded one, the sequences of a packed one (tether.data.pack_batch), in order.

    Only completion positions get logits (`models.logprobs.completion_token_logps`: the LM head
    over the completion tokens, chunked when the logits are large), which saves the LM head's matmul
    and the largest activation on the prompt part.
    """
    keys = ("input_ids", "attention_mask", "completion_mask", "position_ids", "sequence_ids", "sequence_ends")
    on = {k: batch[k].to(device, non_blocking=True) for k in keys if k in batch}
    logps, _ = completion_token_logps(model, on, 1.0, amp)  # 0 outside the completions
    if "sequence_ids" not in on:
        return logps.sum(-1).float(), on["completion_mask"][:, 1:].sum(-1).float()
    # packed: a sequence's first token is never a target (its completion mask is 0 there)
    return sequence_sums(logps, on).float(), sequence_sums(on["completion_mask"].float(), on)


def training_forwards(order, n: int, batch_size: int) -> list[list[int]]:
    """Row indices of every training forward of the first epoch, in order: each step's rows
    (under torchrun each rank's part, `order.part`) cut into micro-batches of `batch_size`, as
    `offline.train_step` cuts them. With whole micro-batches per rank these are one process's.

    Why: the reference pass runs these very batches, so at step 1 (before any update) the policy's
    forward sees the same tensors as the reference's did — same rows, same padding, same matmul
    shapes — and its log-ratios are exactly 0 (margins 0, accuracy 0: ties count as wrong). Batched
    in file order instead, a row's log-prob differed by ~1e-7 through padding and kernel shapes,
    which made step 1's accuracy a coin toss (0.25 on SmolLM2)."""
    forwards = []
    for position in range(math.ceil(n / order.batch_size)):
        batch = order.global_batch_at(position)
        for rank in range(order.world_size):  # under torchrun: every rank's part, as each cuts it
            rows = order.part(batch, rank)
            forwards += [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    return forwards


@torch.no_grad()
def reference_logps(net, splits: dict, paired: dict, cfg, pad_id: int, device, amp,
                    forwards: dict | None = None) -> dict:
    """Summed completion log-probs of every example of every split under `net` (eval mode).
    `forwards[split]`: the batches (row indices) to run, as the trainer will (:func:`training_forwards`);
    a row in several keeps its first; rows in none, or a split without an entry (held-out data,
    batched as the evaluation batches it), go in consecutive chunks of `cfg.data.batch_size`.

    Under torchrun the batches are shared out among the ranks (`net` may be sharded: every rank
    runs as many forwards) and every rank gets all the numbers: the same batches as in one
    process, so the same values wherever a batch ran."""
    was = net.training
    net.eval()
    out = {}
    batch_size = cfg.data.batch_size
    packing = packing_layout(net, cfg.data.packing)  # as the trainer collates: the same tensors
    for name, examples in splits.items():
        if not examples:
            continue
        n = len(examples)
        partners = None if paired[name] else kl_partners(n)
        keys = ("chosen", "rejected") if paired[name] else ("completion", "kl")
        values = {k: torch.zeros(n) for k in keys}
        done = torch.zeros(n, dtype=torch.bool)
        listed = (forwards or {}).get(name, [])
        covered = {i for rows in listed for i in rows}
        left = [i for i in range(n) if i not in covered]
        batches = [rows for rows in listed + [left[i:i + batch_size] for i in range(0, len(left), batch_size)]
                   if rows]
        mine = []
        for turn in distributed.rank_share(batches, 1):
            # None: a forward that counts for nothing (sharded forwards are collective)
            chunk = [examples[i] for i in (turn[0] if turn is not None else batches[0])]
            logps, _ = completion_logps(net, collate(chunk, paired[name], pad_id, packing), device, amp)
            if paired[name]:
                got = {"chosen": logps[:len(chunk)], "rejected": logps[len(chunk):]}
            else:
                kl = collate_mismatched(chunk, examples, partners, pad_id, cfg.data.max_length, packing)
                got = {"completion": logps, "kl": completion_logps(net, kl, device, amp)[0]}
            if turn is not None:
                mine.append({k: v.cpu() for k, v in got.items()})
        for rows, got in zip(batches, distributed.rank_unshare(mine, len(batches))):
            for pos, i in enumerate(rows):
                if not done[i]:
                    done[i] = True
                    for k in keys:
                        values[k][i] = got[k][pos]
        out.update({f"{name}.{k}": v for k, v in values.items()})
    net.train(was)
    return out


def get_reference(cfg, run_path: Path, model, fresh: bool, splits: dict, paired: dict, pad_id,
                  device, amp, forwards: dict | None = None) -> tuple[dict, str]:
    """The cached reference log-probs, computing (and caching) them if needed, batched as
    `forwards` says (:func:`reference_logps`). Returns (tensors, where they came from)."""
    ref_model, spec = cfg.preference.ref_model, cfg.model
    ref_source = ref_model or spec.path
    precision = f"{spec.dtype}/{spec.mixed_precision if device.type == 'cuda' else 'no'}/{device.type}"
    from tether.trainers.core.sharding import sharding_bf16
    if distributed.active() and spec.fsdp and sharding_bf16(cfg, device):
        precision += "/fsdp-bf16"  # FSDP2's bf16 policy rounds otherwise than one process's autocast
    if cfg.data.packing:  # packed forwards round differently (~1e-7): step 1's zero margins need them
        precision += f"/packed-{packing_layout(model, True)}"
    fingerprint = cache_fingerprint(ref_source, splits, precision, forwards)
    # Under torchrun rank 0 reads (and below writes) the cache and hands it to every rank: one
    # decision for all (a rank that recomputed alone would wait forever in a sharded forward).
    cached = distributed.on_main(lambda: load_cache(run_path, fingerprint))
    if cached is not None:
        return cached, "cache"
    # A resumed run has restored the training RNG already: loading a model here must not move it.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if fresh and not ref_model:
            # Step 0: the policy is the initial model, i.e. the reference (LoRA: B = 0, adapters are a no-op).
            tensors = reference_logps(model, splits, paired, cfg, pad_id, device, amp, forwards)
            how = "policy at step 0"
        elif spec.lora_r > 0 and not ref_model:
            with adapters_off(model):
                tensors = reference_logps(model, splits, paired, cfg, pad_id, device, amp, forwards)
            how = "base with adapters disabled"
        else:
            with hf_progress(cfg.run.progress):
                net = load_model(ref_source, dtype=spec.dtype, device=spec.device,
                                 attn_implementation=spec.attn_implementation)
            net.eval().requires_grad_(False)  # frozen: under the bf16 policy sharded from bf16 weights
            if distributed.active():
                from tether.trainers.core.sharding import shard_model
                shard_model(net, cfg)  # each rank holds its shard only, as of the policy
            tensors, how = reference_logps(net, splits, paired, cfg, pad_id, device, amp, forwards), \
                "reference model"
            del net  # not held during training
            if device.type == "cuda":
                torch.cuda.empty_cache()
    # every rank has every number; rank 0 writes them (no forward in it)
    distributed.on_main(lambda: save_cache(run_path, tensors, fingerprint, {
        "reference": ref_source, "computed_with": how, "rows": {k: len(v) for k, v in splits.items()}}))
    return tensors, how


# ---- the cache ----------------------------------------------------------------------------------

def model_fingerprint(path: str) -> dict:
    """What identifies a model without reading its weights: config + weight-file names and sizes
    (a hub id is taken as is)."""
    p = Path(path)
    if p.suffix.lower() == ".gguf" and p.is_file():  # a GGUF file: its content, as its conversion cache
        from tether.models.gguf import file_sha256
        return {"gguf": file_sha256(p)}
    if not p.is_dir():
        return {"id": path}
    cfg = (p / "config.json").read_text() if (p / "config.json").exists() else ""
    files = sorted((f.name, f.stat().st_size) for f in p.iterdir()
                   if f.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
    return {"config": hashlib.sha256(cfg.encode()).hexdigest(), "files": files}


def data_fingerprint(splits: dict[str, list[dict]]) -> str:
    h = hashlib.sha256()
    for name, examples in sorted(splits.items()):
        h.update(name.encode())
        for ex in examples:
            keys = ("prompt_ids", "chosen_ids", "rejected_ids", "completion_ids")
            h.update(json.dumps([ex.get(k) for k in keys]).encode())
    return h.hexdigest()


def cache_fingerprint(ref_source: str, splits: dict, precision: str, forwards: dict | None = None) -> str:
    # the batching is in it too: another one (seed, batch size) moves the numbers by ~1e-7, enough
    # to break step 1's exact zero margins
    batching = hashlib.sha256(json.dumps(forwards or {}, sort_keys=True).encode()).hexdigest()
    blob = json.dumps({"model": model_fingerprint(ref_source), "data": data_fingerprint(splits),
                       "precision": precision, "kl_pairing_seed": KL_PAIRING_SEED,
                       "batching": batching}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def load_cache(run_path: Path, fingerprint: str) -> dict[str, torch.Tensor] | None:
    """The cached tensors, or None if missing or stale (a stale cache is logged and ignored)."""
    meta, data = run_path / CACHE_META, run_path / CACHE_FILE
    if not (meta.exists() and data.exists()):
        return None
    if json.loads(meta.read_text()).get("fingerprint") != fingerprint:
        logger.warning("%s is stale (data, model or precision changed): recomputing", data)
        return None
    from safetensors.torch import load_file
    return load_file(str(data))


def save_cache(run_path: Path, tensors: dict[str, torch.Tensor], fingerprint: str, info: dict) -> None:
    from safetensors.torch import save_file
    run_path.mkdir(parents=True, exist_ok=True)
    tmp = run_path / (CACHE_FILE + ".tmp")
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, run_path / CACHE_FILE)
    (run_path / CACHE_META).write_text(json.dumps({"fingerprint": fingerprint, **info}, indent=2) + "\n")
