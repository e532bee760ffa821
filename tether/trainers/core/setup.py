"""One setup for every trainer: `setup_training(cfg, load_data)` builds what a loop needs and hands
it back as a `Training`, so each `train_*` function holds only its algorithm (torchtune's recipe
`_setup_*` methods, as one function).

The order is part of the contract:
    seed -> tokenizer -> data (read, validated, tokenized: bad input fails before a model loads)
    -> trained model (+ LoRA adapters, from the checkpoint on resume) -> frozen reference (the
       *initial* policy, also on resume; under LoRA the same module with adapters disabled)
    -> gradient checkpointing, compile -> the run directory (touched only now: locked, and a
       previous run's files removed only with run.overwrite=true)
    -> optimizer, schedule, data order -> on resume: their state, the RNG, the loop's carried
       state (metrics window, histories), the log rows after the checkpoint -> config.yaml.
Before any of it, the cheap refusals: a `run.log_with` tracker not installed, another run holding
the directory, a previous run there (without resume or overwrite), a resume whose config differs from the checkpointed run's in a
field its section does not declare RESUMABLE (`check_resumable`). Every trainer thereby gets LoRA, compile, gradient
checkpointing, exact resume, TensorBoard, samples, plots, the non-finite guard and (on CUDA)
the attention-backward guard from this one place.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from tether import distributed
from tether.config import ConfigError, load_config, to_dict
from tether.errors import NonFiniteLossError, TrainingDiverged, UserError
from tether.models import load_model, load_tokenizer
from tether.models.attention import guard_attention_backward
from tether.models.load import DTYPES, compile_layers, hf_progress, stored_dtype
from tether.models import logprobs
from tether.models.logprobs import completion_token_logps
from tether.models.lora import adapters_off, apply_lora
from tether.model_card import CARD, write_best_card, write_model_card
from tether.plots import plot_metrics
from tether.trackers import check_installed
from tether.rollout import native
from tether.rollout.fuse import fuse_projections
from tether.rollout.hf import generate
from tether.run import (RunDir, check_lock, latest_checkpoint, load_master_weights, refuse_previous_run,
                        seed_everything)
from tether.trainers.core import sharding
from tether.trainers.core.common import (EpochSampler, Progress, Window, all_finite, autocast_context,
                                         guarded_step, make_optimizer, make_scheduler, restore_training,
                                         save_training)
from tether.trainers.core.held_out import Best, load_eval_prompts, shown
from tether.trainers.core.ranks import Ranks
from tether.trainers.core.sharding import sampling_copy, shard_model, state_hint, wants_sampler_copy
from tether.envs.rollouts import env_data


@dataclass
class Data:
    """What a trainer's data loader returns: training rows (their count sets the data order), held-out
    rows, the loader's report (goes into summary.json) and anything else the loop needs."""
    train: list
    eval: list = field(default_factory=list)
    report: Any = None
    extra: dict = field(default_factory=dict)


def load_prompt_data(cfg, tokenizer) -> Data:
    """The sampling trainers' data (grpo, ppo, odpo): `data.path`'s prompt-only rows with their token
    ids (+ every extra column, for the reward functions), and the held-out prompts (data.eval_data)."""
    from tether.data import encode_prompts, load_data
    data, env = cfg.data, getattr(cfg, "environment", None)

    from_env = env is not None and bool(env.env)  # data=env / data.eval_data=env: the environment's own rows
    train = env_data(env, cfg.run.seed) if from_env and data.path == "env" else \
        load_data(data.path, expect="prompt-only", split=data.split, rename=data.columns)
    rows, report = encode_prompts(train, tokenizer, data.max_prompt_length, data.truncation, source=data.path)
    if not rows:
        raise UserError(f"{data.path}: no prompts left after encoding")
    if from_env and data.eval_data == "env":
        held = encode_prompts(env_data(env, cfg.run.seed, held_out=True), tokenizer, data.max_prompt_length,
                              data.truncation, source="env")[0]
    else:
        held = load_eval_prompts(cfg, tokenizer)
    return Data(rows, eval=held, report=report)


def report_summary(report) -> dict:
    """A prompt loader's report (load_prompt_data's Data.report) as summary.json's `data`."""
    return {"summary": report.summary(), "rows": report.total, "truncated": report.truncated,
            "dropped": report.dropped}


def load_policy(spec, ckpt: Optional[Path]):
    """The causal LM to train per the `model` section: from the checkpoint on resume; under LoRA
    the base always comes from `spec.path` and the checkpoint holds the adapter (models/lora.py)."""
    kw = dict(dtype=spec.dtype, device=spec.device, attn_implementation=spec.attn_implementation)
    if spec.lora_r > 0:
        return apply_lora(load_model(spec.path, **kw), spec, ckpt)
    return load_model(str(ckpt) if ckpt else spec.path, **kw)


def checkpoint_dtype(cfg, model) -> Optional[torch.dtype]:
    """The dtype checkpoints write the model's weights in (`run.save_dtype`; None = as they are).
    'auto': the dtype `model.path` is stored in when the weights are wider (fp32 master weights of
    a bf16 model are saved as bf16, as it was published: half the size), else as they are (an fp32
    model stays fp32, a model trained in bf16 is not widened). LoRA adapters and reward models
    (not a plain HF model) are saved as trained."""
    from transformers import PreTrainedModel

    if cfg.model.lora_r > 0 or not isinstance(model, PreTrainedModel):
        return None
    if cfg.run.save_dtype != "auto":
        return DTYPES[cfg.run.save_dtype]
    live, stored = model.dtype, stored_dtype(cfg.model.path)
    wider = stored is not None and torch.finfo(live).bits > torch.finfo(stored).bits
    return stored if wider else None


@dataclass
class Training(Ranks):
    """The handles a training loop needs, and the few things every loop does the same way (with the
    rank idioms of ranks.py: turns, rows and sums over torchrun's ranks)."""
    cfg: Any
    run: RunDir
    tokenizer: Any
    data: Data
    model: torch.nn.Module
    trainable: torch.nn.Module
    reference: Optional[torch.nn.Module]
    device: torch.device
    amp: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    order: EpochSampler
    total_steps: int
    ckpt: Optional[Path]
    step: int = 0
    skipped: int = 0
    time_offset: float = 0.0
    save_extra: Optional[Callable[[Path], None]] = None
    "writes a trainer's extra state into each checkpoint directory (PPO's critic and β)"
    save_dtype: Optional[torch.dtype] = None
    "dtype of the model's weights in checkpoints (checkpoint_dtype; None = as trained)"
    bar: Any = None
    watches: list = field(default_factory=list)
    "(name, metric keys, floor, message) checked on every logged row (see watch)"
    warnings: dict = field(default_factory=dict)
    "warnings given so far, by name (each once); summary.json lists them"
    window: Window = field(default_factory=Window)
    "metrics summed over the current log window (for loops that log means); checkpointed"
    history: dict = field(default_factory=dict)
    "per-step values a summary reports (GRPO's reward_history); checkpointed"
    skipped_in_a_row: int = 0
    replica: Optional[torch.nn.Module] = None
    "under torchrun, or with rollout.sampler_copy: a whole copy of the policy the sampler runs on (rollout_model)"
    replica_stale: bool = True
    replica_shapes: Optional[dict] = None
    "rollout.release_replica: the replica's parameter shapes while its memory is lent to training"
    gather_seconds: float = 0.0
    "time spent gathering the shards into the replica (reported as gather_time)"
    best: Optional[Best] = None
    "run.keep_best's race: the best eval value so far and its step (held_out.Best); checkpointed"
    eval_shown: dict = field(default_factory=dict)
    "the last eval point's headline number, for the progress bar's postfix"
    restore_process_state: Callable[[], None] = lambda: None
    "puts back what _set_process_state changed for this run: head dtype, attention guard (release() calls it)"

    def guarded_step(self, loss_value: float, keep_grads: bool = False) -> float:
        """Clip and step when loss, gradient norm and the updated weights are finite (else the
        step is undone, counted and NonFiniteLossError raised: a NaN never reaches the weights or
        AdamW's moments). `optim.max_skipped_steps` refusals in a row stop the run with
        TrainingDiverged: every update refused means nothing is learnt, and such a run must not
        end as a success. Returns the gradient norm."""
        try:
            norm = guarded_step(self.trainable, self.optimizer, self.scheduler,
                                self.cfg.optim.max_grad_norm, loss_value, keep_grads=keep_grads)
        except NonFiniteLossError as e:
            self.skipped += 1
            self.skipped_in_a_row += 1
            limit = self.cfg.optim.max_skipped_steps
            if 0 < limit <= self.skipped_in_a_row:
                raise TrainingDiverged(
                    f"{self.cfg.run.name}: stopped at step {self.step + 1}: {self.skipped_in_a_row} "
                    f"updates in a row were refused (last: {e}); the weights or the loss diverged. "
                    f"Checkpoints hold only finite weights; lower optim.lr (now {self.cfg.optim.lr:g}) "
                    f"or set optim.max_grad_norm, then rerun or resume") from None
            raise
        self.skipped_in_a_row = 0
        self.replica_stale = True
        return norm

    def rollout_model(self) -> torch.nn.Module:
        """The model to sample from: the trained model itself in one process (unless
        rollout.sampler_copy); under torchrun, or with that option, the replica
        (setup_training(rollout_replica=True)), refreshed from the shards / weights when an update
        happened since (collective under torchrun: every rank calls this at the same points)."""
        if self.replica is None:
            return self.model
        if self.replica_shapes is not None:  # lent to the training pass: memory of its own again
            for name, p in self.replica.named_parameters():
                p.data = torch.empty(self.replica_shapes[name], dtype=p.dtype, device=p.device)
            if native.FUSE_PROJECTIONS:  # q/k/v and gate/up in one buffer each again (sampling_copy)
                fuse_projections(self.replica)
            self.replica_shapes, self.replica_stale = None, True
        if self.replica_stale:
            started = time.perf_counter()
            distributed.copy_full_weights(self.model, self.replica)
            self.gather_seconds += time.perf_counter() - started
            self.replica_stale = False
        return self.replica

    @contextlib.contextmanager
    def replica_turn(self, sampler):
        """Around sampling with `sampler` from rollout_model(): the replica brought up to date first
        (collective under torchrun), the trained model in eval mode meanwhile (dropout off), and
        after it, with rollout.release_replica, the replica's memory and `sampler`'s cache lent to
        the training pass (lend_rollout_memory)."""
        self.rollout_model()
        self.model.eval()
        yield
        self.model.train()
        self.lend_rollout_memory(sampler)

    def gather_time(self, since: float) -> dict:
        """{'gather_time': the seconds spent refreshing the replica since `since` (a reading of
        gather_seconds)} when there is a replica, else {}."""
        return {"gather_time": self.gather_seconds - since} if self.replica is not None else {}

    def lend_rollout_memory(self, sampler) -> None:
        """rollout.release_replica, before a training pass: the replica's weights and `sampler`'s KV
        cache and graphs freed, so the pass can use their memory (2 B a parameter, and the cache);
        rollout_model() brings the replica back in new memory — the sampler then builds its cache
        and captures its graphs anew, which is the option's time cost."""
        if not self.cfg.rollout.release_replica or self.replica is None or self.replica_shapes is not None:
            return
        sampler.release()
        self.free_replica()

    def free_replica(self) -> None:
        """The replica's weights freed until rollout_model() brings them back (new memory, refreshed
        from the model). A no-op without a replica or when it is freed already."""
        if self.replica is None or self.replica_shapes is not None:
            return
        self.replica_shapes = {name: p.shape for name, p in self.replica.named_parameters()}
        for p in self.replica.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def optimizer_step(self, loss_value: float, keep_grads: bool = False) -> float:
        """`guarded_step`, a refused step returning a NaN gradient norm instead of raising."""
        try:
            return self.guarded_step(loss_value, keep_grads)
        except NonFiniteLossError:
            return float("nan")

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def due(self, every: int) -> bool:
        """True at every `every`-th step before the last (the last step has its own final work)."""
        return every > 0 and self.step % every == 0 and self.step < self.total_steps

    def log_due(self) -> bool:
        return self.step % self.cfg.run.log_every == 0 or self.step == self.total_steps

    def log(self, metrics: dict) -> None:
        self.run.log(self.step, metrics, time_offset=self.time_offset)
        for name, keys, floor, message in self.watches:
            for key in keys:
                value = metrics.get(key)
                if isinstance(value, (int, float)) and value < floor:  # NaN never warns
                    self.warn(name, message.format(key=key, value=value, step=self.step, floor=floor))

    def log_eval(self, metrics: dict) -> None:
        """Log an eval point's metrics; keep its policy as checkpoints/best when it holds the best
        value of run.keep_best so far (collective under torchrun: every rank calls this)."""
        self.log(metrics)
        self.eval_shown = shown(metrics, self.best.metric if self.best else None) or self.eval_shown
        if self.best is not None:
            self.best.update(self, metrics)

    def watch(self, name: str, keys: tuple, floor: float, message: str) -> None:
        """Warn (once, see `warn`) when a logged metric of `keys` falls below `floor`; `message` is
        formatted with key, value, step and floor. A trainer's early alarm on a number that looks
        fine to the loss (the offline trainer's chosen log-prob drift)."""
        self.watches.append((name, tuple(keys), floor, message))

    def warn(self, name: str, text: str) -> None:
        """Say `text` once per run and `name`: on stderr at once (above the progress bar), and in
        summary.json's `warnings` at the end."""
        if name in self.warnings or not self.run.is_main:
            return
        self.warnings[name] = text
        from tqdm import tqdm  # tqdm.write clears and redraws a live bar around the line
        tqdm.write(f"{self.cfg.run.name}: warning: {text}", file=sys.stderr)

    def add_samples(self, rows: list[dict]) -> None:
        self.run.add_samples(self.step, rows[:self.cfg.run.num_samples])

    def sample(self, prompts: list, max_new_tokens: int) -> list[str]:
        """Completions of `prompts` (texts or token ids) for samples.jsonl, sampled at temperature 1
        under an RNG seeded by (seed, step) and forked, so sampling never shifts the training RNG
        stream (a resumed run must see the same random numbers as an uninterrupted one)."""
        if not prompts:
            return []
        model = self.rollout_model()  # under torchrun every rank samples the same prompts
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.cfg.run.seed + self.step)
            return generate(model, self.tokenizer, prompts, max_new_tokens, do_sample=True,
                            temperature=1.0)

    def checkpoint(self, name: Optional[str] = None, extra: Optional[Callable[[Path], None]] = None) -> Path:
        """checkpoints/step-<step> (exactly resumable; rotated by keep_last), or with `name` the
        model alone as checkpoints/<name> (+ `extra(dir)`; keep_best's `best`, never rotated)."""
        # The step guard keeps weights finite; this is the last line, for anything that changes
        # them outside it (a trainer's own edit, a broken load): never write a poisoned checkpoint.
        if not all_finite(self.trainable.parameters()):
            bad = next(n for n, p in self.trainable.named_parameters() if not all_finite([p]))
            raise TrainingDiverged(f"{self.cfg.run.name}: step {self.step}: parameter {bad} is not "
                                   f"finite; checkpoint not written")
        carry = {"window": self.window.state_dict(), "history": self.history,
                 "skipped_in_a_row": self.skipped_in_a_row,
                 **({"best": self.best.state_dict()} if self.best is not None else {})}
        with hf_progress(self.cfg.run.progress):  # "Writing model shards"
            return save_training(self.run, self.step, self.model, self.tokenizer, self.optimizer,
                                 self.scheduler, self.order, self.skipped, self.time_offset,
                                 self.cfg.run.keep_last, extra=extra if name else self.save_extra,
                                 carry=carry, dtype=self.save_dtype, trainable=self.trainable, name=name)

    @torch.no_grad()
    def reference_logps(self, batch: dict, temperature: float) -> torch.Tensor:
        """Per-token log-probs of the completion tokens under the frozen reference."""
        if self.reference is not None:
            return completion_token_logps(self.reference, batch, temperature, self.amp)[0]
        with adapters_off(self.model):  # LoRA: the base under the adapters is the reference
            return completion_token_logps(self.model, batch, temperature, self.amp)[0]

    def release(self) -> None:
        """Put back the process-wide settings this run changed (once; later calls do nothing): its
        head_fp32 (logprobs.HEAD_DTYPE) and attention guard do not outlive it (`tether eval`, the next
        run in a notebook, library use). finish() calls it, and so does every train_* entry point
        when its run ends another way (`releases_process_state`: an error, Ctrl-C)."""
        restore, self.restore_process_state = self.restore_process_state, lambda: None
        restore()
        _OPEN[:] = [t for t in _OPEN if t is not self]

    def finish(self, summary: dict) -> dict:
        """Final checkpoint, summary.json (steps, skipped steps and checkpoint added), the final
        checkpoint's model card (and keep_best's) rewritten with the summary's numbers, plots."""
        self.bar.close()
        try:
            path = self.checkpoint()
            summary = {"steps": self.step, "skipped_steps": self.skipped, **summary,
                       "checkpoint": str(path)}
            if self.best is not None:
                summary["best"] = self.best.summary(self.run.path)
            if self.warnings:
                summary["warnings"] = list(self.warnings.values())
            self.run.write_summary(summary)
            if self.run.is_main:  # the final model's card: the summary's final eval and best
                with self.run.writing(f"checkpoints/{path.name}/{CARD}"):
                    write_model_card(path, self.run.path, step=self.step, summary=summary)
                if self.best is not None:  # keep_best's: its own step's numbers, the run's beside them
                    with self.run.writing(f"checkpoints/best/{CARD}"):
                        write_best_card(self.run.path, summary)
        finally:  # also when the last checkpoint fails
            self.release()
        if self.run.is_main:
            with self.run.writing("plots"):
                plot_metrics(self.run.path)
        self.run.close()
        return summary


_OPEN: list = []  # runs set up in this process and not yet released (Training.release)


def releases_process_state(train: Callable) -> Callable:
    """Decorator of every train_* entry point: however it ends, the runs it set up are released
    (Training.release: head dtype, attention guard) — finish() does it for a run that completes;
    this covers a run stopped by an error (TrainingDiverged, out of memory) or Ctrl-C."""
    @functools.wraps(train)
    def entry(*args, **kwargs):
        depth = len(_OPEN)
        try:
            return train(*args, **kwargs)
        finally:
            while len(_OPEN) > depth:
                _OPEN[-1].release()
    return entry


def setup_training(cfg, load_data: Callable[[Any], Data], *, build: Optional[Callable] = None,
                   reference: bool = False, rows_per_step: Optional[int] = None,
                   updates_per_step: int = 1, rollout_replica: bool = False) -> Training:
    """Build everything a loop needs from `cfg`'s sections (see the module doc for the order).

    load_data(tokenizer) -> Data. build(cfg, ckpt) -> the trained model, or (model, trainable) when
    the optimizer covers more than the checkpointed model (PPO: policy + critic); default: the
    causal LM of `cfg.model` (+ LoRA). reference: also build the frozen reference policy.
    rows_per_step: training rows a step draws (default batch_size × grad_accum). updates_per_step:
    optimizer updates per step (GRPO's μ, PPO's epochs × minibatches), for the schedule's length.
    rollout_replica: under torchrun (or in one process with `rollout.sampler_copy`), keep a whole
    (bf16 on CUDA) copy of the policy to sample from (`Training.rollout_model()`), gathered from the
    shards (copied from the weights) after each optimizer step.

    `run.progress=false` also silences Hugging Face's own bars while models load here and while
    checkpoints are written (`hf_progress`: put back as they were, also when something raises).
    """
    with hf_progress(cfg.run.progress):  # "Loading weights"
        return _setup(cfg, load_data, build, reference, rows_per_step, updates_per_step, rollout_replica)


def _setup(cfg, load_data, build, reference, rows_per_step, updates_per_step, rollout_replica) -> Training:
    command = cfg.run.name
    if not cfg.model.path:
        raise UserError(f"{command}: `model` is required (a local HF directory or hub id)")
    if not cfg.data.path:
        raise UserError(f"{command}: `data` is required (a file, a saved dataset directory, or a hub name)")
    distributed.init()  # under torchrun: join the process group (nothing otherwise)
    # Under torchrun FSDP2 gathers bf16 weights: not the master weights head_fp32 promises
    head_fp32 = getattr(cfg.model, "head_fp32", False)
    if head_fp32 and distributed.world_size() > 1:
        raise ConfigError("config key 'model.head_fp32' runs in one process (FSDP2 gathers bf16 weights)")
    offload = getattr(cfg.model, "offload_activations", False)
    if offload and distributed.world_size() > 1:
        raise ConfigError("config key 'model.offload_activations' runs in one process")
    run_path = Path(cfg.run.runs_dir) / cfg.run.name
    ckpt = latest_checkpoint(run_path) if cfg.run.resume else None
    check_installed(cfg.run.log_with)  # a tracker's missing package: one line, before anything loads

    def refusals():  # on rank 0 only: the others would see its lock (and say it all N times)
        check_lock(run_path)  # another run holds the directory: refused before anything loads
        if ckpt is not None:
            check_resumable(cfg, run_path)
        elif cfg.run.resume:
            # Resuming what never saved a checkpoint is starting it (a requeued job passes resume=true
            # every time, its first start included); rows a run killed before its first checkpoint
            # left are dropped and produced again, as on any resume.
            print(f"{command}: resume=true but {run_path} has no checkpoint: starting from step 0",
                  file=sys.stderr)
        else:
            refuse_previous_run(run_path, cfg.run.overwrite)
    distributed.on_main(refusals)
    seed_everything(cfg.run.seed)

    tokenizer = load_tokenizer(str(ckpt) if ckpt else cfg.model.path)
    data = load_data(tokenizer)
    if not data.train:
        raise UserError(f"{command}: no training rows left in {cfg.data.path}")
    # Under torchrun on GPUs the whole model is loaded into CPU memory and sharding moves only each
    # rank's shards to its GPU (fully_shard does): a 7B model in fp32 never sits whole on one GPU.
    gpu_later = distributed.active() and distributed.uses_cuda()
    spec = dataclasses.replace(cfg.model, device="cpu") if gpu_later else cfg.model
    built = (build or (lambda c, k: load_policy(spec, k)))(cfg, ckpt)
    model, trainable = built if isinstance(built, tuple) else (built, built)
    if ckpt:  # a checkpoint saved in a narrower dtype than trained in keeps the exact weights beside
        load_master_weights(model, ckpt)
    device = distributed.device() if gpu_later else next(model.parameters()).device
    ref = None
    if reference and cfg.model.lora_r == 0:
        # The reference is the *initial* policy, also on resume; copied before any wrapping below.
        ref = load_model(cfg.model.path, dtype=cfg.model.dtype, device=spec.device,
                         attn_implementation=cfg.model.attn_implementation) if ckpt else copy.deepcopy(model)
        ref.eval().requires_grad_(False)
    if cfg.model.gradient_checkpointing:
        # non-reentrant under FSDP2: the reentrant variant re-enters forward hooks out of order.
        # Reentrant for eager layers whose activations go to the host: it saves a layer's input
        # through the saved-tensor hooks, where the non-reentrant one holds it itself (compiled
        # layers checkpoint inside their region and save it through the hooks: load.checkpoint_inside)
        reentrant = False if distributed.active() else (
            True if getattr(cfg.model, "offload_activations", False) and not cfg.model.compile else None)
        model.gradient_checkpointing_enable(**({"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
                                               if reentrant is not None else {}))
        model.config.use_cache = False
        if cfg.model.lora_r > 0:  # frozen embeddings: inputs must require grad for checkpointed blocks
            model.enable_input_require_grads()
    if cfg.model.compile:
        for m in (model, ref):
            if m is not None:
                compile_layers(m)
    replica = None
    # a plain copy to sample from, refreshed after each step: under torchrun from the shards; in one
    # process (rollout.sampler_copy) in the compute dtype instead of the fp32 weights
    bf16 = sharding.sharding_bf16(cfg, device)
    if rollout_replica and (distributed.active() or wants_sampler_copy(cfg, bf16)):
        replica = sampling_copy(model, device, bf16=bf16)
    elif rollout_replica and native.FUSE_PROJECTIONS:
        # the sampler reads the trained weights themselves: q|k|v and gate|up each in one buffer, so
        # it runs one GEMM per group and RoPE inside its attention kernel (Qwen2.5-0.5B's GRPO decode
        # step on an H200: 457 kernels, 1.50 ms of GPU work unfused; the fused layout's 237, 1.06 ms).
        # Values and Parameter objects stay; the optimizer and backward see no difference
        # (rollout/fuse.py), and checkpoints are written per tensor (run.save_model_as).
        fuse_projections(model)
    hint = None
    if distributed.active() and distributed.uses_cuda() and cfg.model.fsdp:
        hint = state_hint((model, ref, trainable), torch.cuda.get_device_properties(device).total_memory)
    if distributed.active():
        for m in (model, ref):
            if m is not None:
                shard_model(m, cfg)
    trainable.train()
    run = RunDir(run_path, resume=ckpt is not None, log_with=cfg.run.log_with,
                 tracker_project=cfg.run.tracker_project, mlflow_uri=cfg.run.mlflow_uri,
                 overwrite=cfg.run.overwrite or cfg.run.resume)
    restore = _set_process_state(head_fp32, device, offload)  # before the first forward (compile traces it)
    try:
        t = _start(cfg, run, data, model, trainable, ref, device, tokenizer, ckpt,
                   rows_per_step, updates_per_step)
        t.replica, t.restore_process_state = replica, restore
        if hint:
            t.warn("fsdp_small_model", hint)
        _OPEN.append(t)  # released by finish(), or by its entry point's releases_process_state
        return t
    except BaseException:
        run.close()  # the lock goes with a start that failed
        restore()
        raise


# -- resume guard -----------------------------------------------------------------------------------

def check_resumable(cfg, run_path: Path) -> None:
    """A resume continues the checkpointed run, so its config must be that run's, except the
    fields a section declares RESUMABLE (length, logging, saving). Else one line listing every
    difference. The saved config.yaml may be flat (keys without sections): load_config routes them."""
    saved_file = run_path / "config.yaml"
    if not saved_file.exists():
        return
    try:
        saved = load_config(type(cfg), str(saved_file))
    except (ConfigError, UserError, ValueError) as e:
        raise UserError(f"{cfg.run.name}: cannot check the resume against {saved_file}: {e}") from None
    resumable, now, then = set(), _flat_config(cfg), _flat_config(saved)
    for f in dataclasses.fields(cfg):
        resumable |= {f"{f.name}.{k}" for k in getattr(getattr(cfg, f.name), "RESUMABLE", ())}
    changed = [f"{k} {then.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(now) | set(then))
               if k not in resumable and now.get(k) != then.get(k)]
    if changed:
        raise UserError(f"{cfg.run.name}: resume=true with a config that differs from {saved_file}: "
                        f"{'; '.join(changed)}. Resume with the run's settings (only "
                        f"{', '.join(sorted(resumable))} may change), or start a new run (another "
                        f"name=, or overwrite=true)")


def _flat_config(cfg) -> dict:
    """{"section.key": value} (top-level non-section fields by their own name)."""
    out = {}
    for key, value in to_dict(cfg).items():
        if dataclasses.is_dataclass(getattr(cfg, key)):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _set_process_state(head_fp32: bool, device: torch.device, offload: bool = False) -> Callable[[], None]:
    """What a run changes for the whole process until its release: the LM head's dtype under mixed
    precision (logprobs.HEAD_DTYPE), whether training forwards keep their activations on the host
    (logprobs.OFFLOAD_ACTIVATIONS), on CUDA the attention guard. Returns the call undoing them
    (each back to what it was: a run inside a run's process leaves the outer one's)."""
    previous = logprobs.HEAD_DTYPE, logprobs.OFFLOAD_ACTIVATIONS
    logprobs.HEAD_DTYPE = torch.float32 if head_fp32 else None
    logprobs.OFFLOAD_ACTIVATIONS = offload
    restore_attention = guard_attention_backward(device)

    def restore():
        logprobs.HEAD_DTYPE, logprobs.OFFLOAD_ACTIVATIONS = previous
        restore_attention()
    return restore


def _start(cfg, run, data, model, trainable, ref, device, tokenizer, ckpt, rows_per_step,
           updates_per_step) -> Training:
    """Optimizer, schedule and data order, their state on resume, config.yaml: the Training."""
    per_step = rows_per_step or cfg.data.batch_size * getattr(cfg.data, "grad_accum", 1)
    distributed.split_evenly(per_step, "rows per step (the global batch)")
    o = cfg.optim
    total = o.max_steps if o.max_steps > 0 else max(1, math.ceil(o.epochs * len(data.train) / per_step))
    updates = total * updates_per_step
    optimizer = make_optimizer(trainable, o.lr, o.weight_decay, betas=tuple(o.adam_betas),
                               fused={"auto": None, "on": True, "off": False}[o.fused_adamw])
    scheduler = make_scheduler(optimizer, o.schedule, o.warmup_steps or int(o.warmup_ratio * updates),
                               updates, o.min_lr_ratio)
    t = Training(cfg=cfg, run=run, tokenizer=tokenizer, data=data, model=model, trainable=trainable,
                 reference=ref, device=device, amp=autocast_context(device, cfg.model.mixed_precision),
                 optimizer=optimizer, scheduler=scheduler,
                 order=EpochSampler(len(data.train), per_step, cfg.run.seed, rank=distributed.rank(),
                                    world_size=distributed.world_size()),
                 total_steps=total, ckpt=ckpt,
                 save_dtype=checkpoint_dtype(cfg, model),
                 best=Best(cfg.run.keep_best, cfg.run.keep_best_mode) if cfg.run.keep_best else None)
    run.warn = t.warn  # a tracker left out mid-run: said once, and listed in summary.json
    if ckpt:
        t.step, t.time_offset, t.skipped, carry = restore_training(ckpt, run, trainable, optimizer, scheduler,
                                                                   t.order)
        if "window" in carry:  # checkpoints older than the carried state have none
            t.window.load_state_dict(carry["window"])
        t.history, t.skipped_in_a_row = carry.get("history", {}), carry.get("skipped_in_a_row", 0)
        if t.best is not None and "best" in carry:
            t.best.load_state_dict(carry["best"])
    run.write_config(cfg)
    t.bar = Progress(total, t.step, cfg.run.name, enabled=cfg.run.progress and run.is_main)
    return t
