"""`tether memory`: estimate GPU memory per component for an algorithm and a model size.

The accounting (bytes per parameter, which models each algorithm holds, the activation and KV-cache
formulas, and why each number is what it is) is written out in docs/memory.md; comments here say
only why a line is the way it is. GB means 1e9 bytes throughout. `estimate(cfg)` returns a dict
(the JSON output); `run_memory(cfg)` prints it as a table or as JSON. Which model, and its shape,
comes from model_shape.py. With `gpus` > 1 (N processes under torchrun, tether/distributed.py) the
per-GPU accounting is sharded.py's for FSDP2 and replicated.py's for plain replication, which is
this module's `one_process_rows` for each GPU's share of the batch plus what torchrun adds (the
package __init__ picks); with gpus=1 neither applies (tether wraps no model in one process), so the
single-GPU numbers are exactly this module's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

# Shape, guess_shape, parse_count and resolve_model stay importable from here (tests, scripts)
from tether.constraints import NonNegative, PositiveInt, check_values, fsdp_conflict
from tether.model_shape import Shape, fmt_count, guess_shape, parse_count, resolve_model  # noqa: F401

GB = 1e9
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# optimizer state bytes per trained parameter
OPT_BYTES = {"adamw": 8.0, "adamw_bf16": 4.0, "adamw8bit": 2.0, "sgd": 0.0}
OPT_NOTE = {"adamw": "AdamW m + v in fp32", "adamw_bf16": "AdamW m + v in 16-bit",
            "adamw8bit": "8-bit AdamW m + v (block scales ignored)", "sgd": "plain SGD keeps no state"}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PAIRWISE = ("rm", "dpo", "simpo", "orpo")  # a batch element is a chosen + rejected pair
ONLINE = ("ppo", "grpo", "rloo")  # generate rollouts, so they hold a KV cache


@dataclass
class MemoryConfig:
    model: str = "7e9"
    "Hugging Face id, local config (a directory with config.json, or the file), or a parameter count like 7e9, 7B, 0.5b"
    algo: Literal["sft", "rm", "dpo", "kto", "simpo", "orpo", "ppo", "grpo", "rloo"] = "ppo"
    "algorithm; decides which models are held and which are trained (docs/memory.md)"
    weight_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    "dtype of every model's weights (and of full fine-tuning gradients)"
    optimizer: Literal["adamw", "adamw_bf16", "adamw8bit", "sgd"] = "adamw"
    "adamw: fp32 m+v (8 B/param); adamw_bf16: 16-bit m+v (4 B, torch AdamW on bf16 params); adamw8bit: 2 B; sgd: none"
    master_weights: bool = False
    "keep an fp32 master copy of the trained weights for the optimizer step (+4 B/param when weights are 16-bit)"
    lora: bool = False
    "train LoRA adapters instead of all weights; the reference is the base with adapters off (no copy)"
    lora_rank: PositiveInt = 16
    "LoRA rank r; each targeted linear gets r*(d_in+d_out) fp32 parameters"
    lora_targets: list[str] = field(default_factory=lambda: list(LINEARS))
    "linear layers that get adapters (Llama names: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)"
    gradient_checkpointing: bool = False
    "recompute each decoder layer in backward: keep only its input (7B: activations ~14x smaller)"
    offload_activations: bool = False
    "one GPU: the activations saved for backward in pinned CPU memory (model.offload_activations): two layers' worth stay on the GPU, in flight"
    attention: Literal["sdpa", "eager"] = "sdpa"
    "sdpa/flash never materialise the s x s attention matrix; eager keeps the probabilities for backward"
    offload: bool = False
    "move optimizer state (and fp32 master weights) to CPU memory: listed, but not counted on the GPU"
    batch_size: PositiveInt = 4
    "training micro-batch: sequences per forward/backward (pairs for rm/dpo/simpo/orpo, i.e. 2x sequences)"
    seq_len: PositiveInt = 1024
    "tokens per sequence, prompt + completion (training activations and the rollout KV cache)"
    rollout_batch: PositiveInt = 8
    "ppo/grpo/rloo: prompts generated at once; the KV cache holds rollout_batch*num_generations sequences"
    num_generations: PositiveInt = 8
    "grpo/rloo: completions sampled per prompt (ppo samples one)"
    reward: Literal["model", "verifier"] = "model"
    "ppo/grpo/rloo: reward from a frozen reward model held on the GPU, or from a verifier function (no model)"
    beta: NonNegative = 0.04
    "ppo/grpo/rloo KL coefficient; only whether it is 0 matters here: beta=0 needs no reference model"
    precompute_ref: bool = False
    "dpo/kto: cache the reference log-probs before training, so the reference is not held"
    value_init: Literal["separate", "shared"] = "separate"
    "ppo value function: a separate trained model (backbone + scalar head) or a scalar head on the policy's trunk"
    gpus: PositiveInt = 1
    "processes under torchrun, one GPU each; every number is then per GPU (docs/memory.md, 'Many GPUs')"
    sharding: Literal["fsdp", "replicate", "none"] = "fsdp"
    "gpus > 1: fsdp = FSDP2 shards weights, gradients and optimizer state 1/N (the trainers' fsdp=true); replicate = each GPU holds what one process holds for its share of the batch, gradients summed in bucketed all-reduces (fsdp=false); none = one process holding everything (gpus=1)"
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    "gpus > 1 with weight_dtype=fp32: gathered layers (fsdp) or autocast's weight casts (replicate), activations, rollout replica and KV cache in bf16, gradients reduced in fp32 (the trainers' model.mixed_precision); no = all in fp32"
    fsdp_offload: bool = False
    "gpus > 1 with fsdp: sharded weights, gradients and optimizer state live in CPU memory (model.fsdp_offload; replicate ignores it)"
    fsdp_reshard: bool = True
    "gpus > 1 with fsdp: free a layer's gathered weights after its forward; false keeps the whole model gathered from forward to backward (model.fsdp_reshard; replicate ignores it)"
    fsdp_unit_layers: PositiveInt = 1
    "gpus > 1 with fsdp: consecutive decoder layers per FSDP2 unit (model.fsdp_unit_layers): that many layers gathered, and their gradients unsharded, at once (replicate ignores it)"
    fsdp_reduce: Literal["fp32", "bf16"] = "fp32"
    "gpus > 1 with fsdp and mixed precision: the gradients' reduce-scatter dtype (model.fsdp_reduce); bf16: no fp32 copy of a unit's gradients (replicate ignores it)"
    fsdp_defer_sync: bool = False
    "gpus > 1 with fsdp: gradients reduced once a step, the micro-batches' accumulating unsharded in fp32 on every GPU in between (model.fsdp_defer_sync; replicate ignores it)"
    sampler_copy: bool | Literal["auto"] = "auto"
    "gpus = 1, online algorithms: sample from a copy of the policy in the compute dtype (rollout.sampler_copy: bf16 for fp32 weights), kept all run, its KV cache in that dtype; auto (the trainers' default): a copy for fp32 weights under mixed precision; gpus > 1 ignores it (each GPU samples from its replica)"
    release_replica: bool = False
    "gpus > 1, online algorithms: the rollout replica and the sampler's KV cache freed for each training pass (rollout.release_replica): the training step holds neither"
    grad_accum: PositiveInt = 1
    "micro-batches per step in one process (global batch = batch_size x grad_accum); gpus > 1: each GPU's micro-batch is min(batch_size, global batch / gpus)"
    format: Literal["table", "json"] = "table"
    "print a table, or a JSON dict of components and totals for scripts"

    def __post_init__(self):
        check_values(self)  # the ranges above, for Python callers too (the CLI checks them as it reads)
        bad = [t for t in self.lora_targets if t not in LINEARS]
        if bad:
            raise ValueError(f"config key 'lora_targets': unknown {', '.join(bad)}; allowed: {', '.join(LINEARS)}")
        if self.sampler_copy is True and self.algo not in ONLINE:
            raise ValueError(f"config key 'sampler_copy': {self.algo} does not sample (ppo, grpo and rloo do)")
        if self.gpus > 1:
            if self.sharding == "none":
                raise ValueError(f"config key 'sharding': none is one process holding everything (gpus=1); "
                                 f"for gpus={self.gpus} use fsdp (the trainers' default) or replicate (fsdp=false)")
            if self.release_replica and self.algo not in ONLINE:
                raise ValueError(f"config key 'release_replica': {self.algo} holds no rollout replica")
            bad = fsdp_conflict(self.sharding == "fsdp", self.fsdp_offload, self.fsdp_reduce,
                                self.fsdp_defer_sync)  # what the trainers' model section refuses
            if bad:
                raise ValueError(f"config key '{bad[0]}': {bad[1]}")
            # the trainers refuse a global batch that does not divide (distributed.split_evenly)
            key, size = ("rollout_batch", self.rollout_batch) if self.algo in ONLINE else \
                ("batch_size x grad_accum", self.batch_size * self.grad_accum)
            if size % self.gpus:
                raise ValueError(f"config key '{key}': {size} does not divide among gpus={self.gpus} "
                                 f"(every process takes an equal share of the global batch)")
            if self.offload_activations:  # as the trainers refuse it under torchrun
                raise ValueError(f"config key 'offload_activations': one process only (gpus=1), not gpus={self.gpus}")


@dataclass
class _Held:
    """One model on the GPU: `weights` params in weight_dtype, `adapters` fp32 LoRA params,
    `trainable` params that get gradients and optimizer state, stored with `trainable_bytes` each."""
    name: str
    weights: int
    note: str
    trainable: int = 0
    trainable_bytes: int = 2
    adapters: int = 0
    activations: str | None = None  # "lm" (with vocab logits), "scalar" (value/reward head), None
    layered: bool = True  # a decoder stack (FSDP2 gathers it layer by layer); False: a head on another model


def held_models(cfg: MemoryConfig, n: int, shape: Shape) -> list[_Held]:
    d = DTYPE_BYTES[cfg.weight_dtype]
    backbone = n - shape.lm_head() + shape.hidden  # a scalar head replaces the (untied) LM head
    lora = shape.lora_params(cfg.lora_rank, cfg.lora_targets) if cfg.lora else 0

    def trained(name, weights, note, kind, head=0):
        if cfg.lora:  # PEFT keeps adapters (and the trained head) in fp32 even on a 16-bit base
            return _Held(name, weights, note + ", base frozen + LoRA adapters", lora + head, 4, lora + head, kind)
        return _Held(name, weights, note, weights, d, 0, kind)

    if cfg.algo == "rm":
        return [trained("reward model", backbone, "trained; backbone + scalar head", "scalar", shape.hidden)]
    models = [trained("policy", n, "trained", "lm")]
    uses_ref = (cfg.algo in ("dpo", "kto") and not cfg.precompute_ref) or (cfg.algo in ONLINE and cfg.beta != 0)
    if uses_ref and not cfg.lora:  # with LoRA the reference is the base with adapters disabled: no copy
        models.append(_Held("reference", n, "frozen copy of the policy"))
    if cfg.algo in ONLINE and cfg.reward == "model":
        models.append(_Held("reward model", backbone, "frozen; backbone + scalar head, no LM head"))
    if cfg.algo == "ppo":
        if cfg.value_init == "separate":
            models.append(trained("value model", backbone, "trained; backbone + scalar head", "scalar", shape.hidden))
        else:
            models.append(_Held("value head", shape.hidden, "trained scalar head on the policy's trunk",
                                shape.hidden, 4 if cfg.lora else d, layered=False))
    return models


def activation_bytes(cfg: MemoryConfig, shape: Shape, seqs: int, d: int | None = None) -> int:
    """Saved-for-backward bytes of the decoder layers for `seqs` x seq_len tokens (docs/memory.md).
    Per layer per token, what HF Llama-style layers keep for backward:
      2 RMSNorms: fp32 upcast input (4h) + normalised and output in weight dtype (2*d*h)
      attention:  q, k, v (h + 2 kv_dim) and the output + its contiguous copy (2h), times d
      SwiGLU:     gate, up, silu(gate), gate*up (4 i), times d
      eager attention adds the s x s probabilities: fp32 softmax output + its d-byte copy, per head.
    d: bytes of the compute dtype (default the weight dtype; sharded bf16 compute passes 2)."""
    d, h, s = d or DTYPE_BYTES[cfg.weight_dtype], shape.hidden, cfg.seq_len
    kv = shape.kv_heads * shape.head_dim
    per_token_layer = 2 * (4 * h + 2 * d * h) + d * (3 * h + 2 * kv) + 4 * d * shape.intermediate
    if cfg.attention == "eager":
        per_token_layer += shape.heads * s * (4 + d if d < 4 else 4)
    tokens = seqs * s
    # offload_activations: what is saved goes to the host as it is made and comes back a layer ahead
    # of backward (models/offload.py), so about two layers' worth is on the GPU at once
    kept = min(2, shape.layers) if cfg.offload_activations else shape.layers
    if cfg.gradient_checkpointing:  # each layer's input is kept; one layer is recomputed at a time in backward
        return tokens * (kept * d * h + per_token_layer)
    return tokens * kept * per_token_layer


# The RL and preference trainers apply the LM head themselves, chunk by chunk (models/logprobs.py,
# `_HeadLogps`, for the plain-head families: Llama / Mistral / Qwen / GPT-2-style / Gemma 3): at most
# this many logits at once,
# with ~14 bytes of transients each (bf16 logits, float32 logits, probabilities, log-probs, bf16 grad).
HEAD_CHUNK_LOGITS, HEAD_CHUNK_BYTES_PER_LOGIT = 1 << 25, 14


def whole_logits(cfg: MemoryConfig, shape: Shape, seqs: int) -> bool:
    """Whether a forward of `seqs` sequences holds its logits whole: the code decides by *count*
    (models/logprobs.uses_chunked_head: B·T·V > 2^25 logits on CUDA is chunked), SFT included."""
    return seqs * cfg.seq_len * shape.vocab <= HEAD_CHUNK_LOGITS


def logits_bytes(cfg: MemoryConfig, shape: Shape, seqs: int) -> int:
    """Logits in weight dtype + the fp32 log-softmax kept for backward + its fp32 gradient in backward,
    where they fit one chunk; larger, every trainer (SFT too: sft._micro_loss goes through
    models.logprobs.completion_token_logps) applies the head in chunks and holds one chunk
    (HEAD_CHUNK_LOGITS)."""
    full = seqs * cfg.seq_len * shape.vocab * (DTYPE_BYTES[cfg.weight_dtype] + 8)
    return full if whole_logits(cfg, shape, seqs) else HEAD_CHUNK_LOGITS * HEAD_CHUNK_BYTES_PER_LOGIT


def component(name: str, group: str, nbytes, params=None, bpp=None, note="", device="gpu") -> dict:
    """One row of an estimate's `components`."""
    return {"component": name, "group": group, "params": params, "bytes_per_param": bpp,
            "bytes": int(nbytes), "gb": nbytes / GB, "device": device, "note": note}


def one_process_rows(cfg: MemoryConfig, n: int, shape: Shape) -> list[dict]:
    """What one process holds for its models, batch and options, the sampler's KV cache aside:
    the resident, gradients and training rows. Also each GPU's rows under replication
    (replicated.py: every rank holds exactly what one process holds for its share of the batch)."""
    d, opt = DTYPE_BYTES[cfg.weight_dtype], OPT_BYTES[cfg.optimizer]
    rows: list[dict] = []

    def add(*args, **kw):
        rows.append(component(*args, **kw))

    models = held_models(cfg, n, shape)
    for m in models:
        add(f"{m.name} weights", "resident", m.weights * d, m.weights, d, m.note)
        if m.adapters:
            add(f"{m.name} LoRA adapters", "resident", m.adapters * 4, m.adapters, 4,
                f"rank {cfg.lora_rank} on {len(cfg.lora_targets)} linears/layer, fp32")
    where = "cpu" if cfg.offload else "gpu"
    for m in (m for m in models if m.trainable):
        if cfg.master_weights and m.trainable_bytes < 4:
            add(f"{m.name} fp32 master weights", "resident", m.trainable * 4, m.trainable, 4, "", where)
        add(f"{m.name} optimizer state", "resident", m.trainable * opt, m.trainable, opt,
            OPT_NOTE[cfg.optimizer] + (" (offloaded to CPU)" if cfg.offload else ""), where)
    for m in (m for m in models if m.trainable):
        add(f"{m.name} gradients", "gradients", m.trainable * m.trainable_bytes, m.trainable, m.trainable_bytes,
            "same dtype as the trained weights")
    seqs = cfg.batch_size * (2 if cfg.algo in PAIRWISE else 1)
    ckpt = "checkpointed" if cfg.gradient_checkpointing else "no checkpointing"
    # fp32 weights train under bf16 autocast (trainers/core/common.autocast_context, model.mixed_precision):
    # activations and logits are bf16, and every matmul saves the bf16 cast of its weight for backward
    # (measured, 1 x H200, bench/memory_check.py: the plain formulas over-predicted such runs by 11-47 %)
    mixed = d == 4 and cfg.mixed_precision != "no"
    c = 2 if mixed else d
    if mixed:
        unit = shape.layer_params() + (shape.lora_params(cfg.lora_rank, cfg.lora_targets) // shape.layers
                                       if cfg.lora else 0)
        for m in (m for m in models if m.activations and m.layered):
            whole = m.weights + m.adapters
            kept = whole if not cfg.gradient_checkpointing else max(0, whole - shape.layers * unit) + unit
            add(f"{m.name} bf16 weight casts", "training", kept * c,
                note="autocast: " + ("every layer's bf16 weights, saved for backward" if not cfg.gradient_checkpointing
                                     else "the root's and one recomputed layer's bf16 weights"))
    for m in (m for m in models if m.activations):
        add(f"{m.name} activations", "training", activation_bytes(cfg, shape, seqs, c),
            note=f"{seqs} seq x {cfg.seq_len} tok, {ckpt}, {cfg.attention}" + (", bf16 autocast" if mixed else ""))
        if m.activations == "lm" and mixed:  # as per GPU (sharded.py): bf16 logits + their gradient
            full = seqs * cfg.seq_len * shape.vocab * c * 2
            chunk = HEAD_CHUNK_LOGITS * HEAD_CHUNK_BYTES_PER_LOGIT
            whole = whole_logits(cfg, shape, seqs)
            lb = full if whole else chunk
            add(f"{m.name} logits", "training", lb,
                note=(f"chunked LM head: {HEAD_CHUNK_LOGITS} logits at a time" if not whole else
                      f"{seqs} x {cfg.seq_len} x {shape.vocab} vocab, bf16 logits + their gradient"))
        elif m.activations == "lm":
            lb = logits_bytes(cfg, shape, seqs)
            chunked = not whole_logits(cfg, shape, seqs)
            add(f"{m.name} logits", "training", lb,
                note=("one chunk of the LM head (plain-head families; others hold all " if chunked else "")
                + f"{seqs} x {cfg.seq_len} x {shape.vocab} vocab: {d} B + fp32 log-probs + fp32 grad"
                + (")" if chunked else ""))
    return rows


def estimate(cfg: MemoryConfig) -> dict:
    """Components and totals (bytes and GB) for `cfg`; the JSON output of `tether memory`."""
    info = resolve_model(cfg.model)
    n, shape = info["params"], info["shape"]
    d = DTYPE_BYTES[cfg.weight_dtype]
    rows = one_process_rows(cfg, n, shape)
    if cfg.algo in ONLINE:
        # rollout.sampler_copy: the sampler reads a copy in the compute dtype (sharding.sampling_copy;
        # bf16 for fp32 weights under mixed precision), refreshed after each step, kept all run
        bf16 = d == 4 and cfg.mixed_precision != "no"  # fp32 weights, bf16 compute
        copied = cfg.sampler_copy is True or (cfg.sampler_copy == "auto" and bf16)
        sd = 2 if copied and bf16 else d  # the sampler's dtype
        if copied:
            lora = shape.lora_params(cfg.lora_rank, cfg.lora_targets) if cfg.lora else 0
            rows.append(component("sampling copy", "resident", (n + lora) * sd, n + lora, sd,
                                  "rollout.sampler_copy: the policy in the compute dtype, for the sampler"))
        gen = cfg.rollout_batch * (cfg.num_generations if cfg.algo != "ppo" else 1)
        rows.append(component("KV cache (rollouts)", "rollout", gen * cfg.seq_len * shape.kv_bytes_per_token(sd),
                              note=f"{gen} seq x {cfg.seq_len} tok x {shape.kv_bytes_per_token(sd)} B/token"))

    def total(*groups, device="gpu"):
        return sum(r["bytes"] for r in rows if r["group"] in groups and r["device"] == device)

    resident = total("resident")
    grads = total("gradients")
    training, rollout = total("training"), total("rollout")
    # Generation and the training step never overlap, but the sampler keeps its KV cache between
    # calls (its CUDA graphs point at it). When the cache fits in the gradients, the RL trainers put
    # it inside their flat gradient buffer (common.flat_grad_buffer): generation then holds the
    # buffer, training the buffer as gradients, and the cache costs nothing more. Otherwise
    # gradients are freed while sampling and the cache is held through the training step too.
    lent = cfg.algo in ONLINE and 0 < rollout <= grads
    step_total = resident + grads + training + (0 if lent else rollout)
    during_rollout = resident + (grads if lent else rollout)
    peak = max(step_total, during_rollout)
    totals = {"weights_and_optimizer": resident, "with_gradients": resident + grads,
              "training_step": step_total,
              "rollout": during_rollout if cfg.algo in ONLINE else None, "peak": peak,
              "cpu_offloaded": total("resident", device="cpu")}
    return {"model": info["name"], "params": n, "source": info["source"], "shape": asdict(shape),
            "algo": cfg.algo, "config": asdict(cfg), "unit": "GB = 1e9 bytes", "components": rows,
            "kv_in_gradient_buffer": lent,
            "totals_bytes": totals, "totals_gb": {k: None if v is None else v / GB for k, v in totals.items()}}


def format_table(est: dict, format_sharded=None) -> str:
    c, s, t = est["config"], est["shape"], est["totals_gb"]
    mode = f"LoRA r={c['lora_rank']}" if c["lora"] else "full fine-tuning"
    lines = [f"tether memory: {est['algo']} on {est['model']} ({fmt_count(est['params'])} params)",
             f"shape: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads ({s['kv_heads']} kv, "
             f"head_dim {s['head_dim']}), intermediate {s['intermediate']}, vocab {s['vocab']}"
             f"{', tied embeddings' if s['tied'] else ''} [{est['source']}]",
             f"weights {c['weight_dtype']}, optimizer {c['optimizer']}, {mode}, "
             f"{'gradient checkpointing' if c['gradient_checkpointing'] else 'no gradient checkpointing'}"
             f"{', offload' if c['offload'] else ''}"
             f"{', activations on the host' if c.get('offload_activations') else ''}; GB = 1e9 bytes", ""]
    if est.get("per_gpu"):
        fsdp = c["sharding"] == "fsdp"
        lines.insert(3, f"per GPU of {c['gpus']} (torchrun): "
                     + (f"FSDP2 sharding{', CPU offload' if c['fsdp_offload'] else ''}"
                        f"{', no reshard after forward' if not c['fsdp_reshard'] else ''}" if fsdp
                        else "replicated (fsdp=false): one process's model on every GPU, gradients summed "
                             "in bucketed all-reduces")
                     + f", mixed precision {c['mixed_precision']}")
    width = 32
    head = f"{'component':<{width}} {'params':>8} {'B/param':>7} {'GB':>9}  note"
    rule = "-" * (len(head) + 30)

    def row(r):
        p = fmt_count(r["params"]) if r["params"] is not None else ""
        b = f"{r['bytes_per_param']:g}" if r["bytes_per_param"] is not None else ""
        gb = f"({r['gb']:.2f})" if r["device"] == "cpu" else f"{r['gb']:.2f}"
        return f"{r['component']:<{width}} {p:>8} {b:>7} {gb:>9}  {r['note']}"

    def tot(label, value, note=""):
        return f"{label:<{width + 17}} {value:>9.2f}  {note}"

    if est.get("per_gpu"):  # sharded.py's or replicated.py's table body (they build on this module; the package passes it)
        return "\n".join(lines + format_sharded(est, [head], row, tot, rule))
    by = {g: [r for r in est["components"] if r["group"] == g] for g in ("resident", "gradients", "training", "rollout")}
    lines += [head, rule, *map(row, by["resident"]), rule,
              tot("= weights + optimizer state", t["weights_and_optimizer"],
                  "the seed table's accounting (7B: PPO ~170, GRPO ~98, DPO ~84 GB)"),
              *map(row, by["gradients"]),
              tot("= + gradients", t["with_gradients"]), *map(row, by["training"])]
    if by["rollout"]:
        lines += [tot("= training step", t["training_step"], "resident + gradients + activations" + (
                      "" if est["kv_in_gradient_buffer"] else " + the sampler's KV cache (below), kept between calls")),
                  *map(row, by["rollout"]),
                  tot("= rollout generation", t["rollout"],
                      "resident + gradient buffer, the KV cache inside it" if est["kv_in_gradient_buffer"]
                      else "resident + KV cache (grads freed, no activations)")]
    lines += [rule, tot("total (peak estimate)", t["peak"],
                        "max(training step, rollout generation)" if by["rollout"]
                        else "resident + gradients + activations")]
    if t["cpu_offloaded"]:
        lines.append(f"(offloaded to CPU memory, not counted above: {t['cpu_offloaded']:.2f} GB)")
    return "\n".join(lines)
