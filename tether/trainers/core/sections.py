"""The config sections every trainer shares, written once: `model`, `optim`, `run`, `data`
(+ `rollout` and `reward` for the trainers that sample). Each trainer's config is these plus its
algorithm's own section, and sets its own defaults for a shared section with
`field(default_factory=lambda: OptimSection(lr=1e-6))`.

A field is also reachable by its last name alone where one section has it, so `lr=1e-5` on the
command line, a flat YAML file and `SFTConfig(lr=1e-5)` in Python all set `optim.lr`
(tether.config.route).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal, Optional

from tether.config import ConfigError
from tether.constraints import (DirPath, Fraction, NonNegative, NonNegativeInt, Positive,
                                PositiveInt, Range, Seed, fsdp_conflict)
from tether.rollout.sampling import SamplingConfig
from tether.trackers import log_targets

Beta = Annotated[float, Range(ge=0, lt=1)]  # an AdamW β: 1 would never forget, > 1 diverges


@dataclass
class ModelSection:
    PRIMARY: ClassVar[str] = "path"  # `model=<dir>` sets model.path

    path: str = ""
    "model to train: a local HF directory, a hub id, or a .gguf file (converted once to a bf16 folder in a cache; docs/models.md) (also the frozen reference, when there is one)"
    dtype: str = "fp32"
    "weight dtype: fp32 (master weights; use with mixed_precision) | bf16 | fp16 | auto"
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    "bf16 autocast on CUDA when supported ('auto'), forced, or off; no effect on CPU"
    device: str = "auto"
    "cuda | cpu | auto"
    attn_implementation: Optional[str] = None
    "attention kernel passed to from_pretrained (sdpa, eager, flash_attention_2)"
    gradient_checkpointing: bool = False
    "recompute activations in backward to save memory"
    compile: bool = False
    "torch.compile each decoder layer of the trained and frozen models, for dynamic shapes (H100, Qwen2.5-0.5B shape: forward+backward -30 %; the first step pays 5-15 s of compilation, a new sequence length none)"
    lora_r: NonNegativeInt = 0
    "LoRA rank (0 = full fine-tuning); checkpoints then hold the adapter only, and the reference is the base with adapters disabled (no copy)"
    lora_alpha: PositiveInt = 16
    "LoRA scaling numerator (the update is scaled by alpha / r)"
    lora_dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    "dropout on the LoRA input"
    lora_targets: str = "all-linear"
    "modules to adapt: 'all-linear' or comma-separated names (q_proj,v_proj)"
    fsdp: bool = True
    "under torchrun (WORLD_SIZE > 1): shard parameters, gradients and optimizer state over the processes (FSDP2); false = the whole model on every process as one process holds it, gradients summed by bucketed all-reduces at each step (no FSDP2 hooks: faster for a model whose training state fits one GPU; docs/distributed.md)"
    fsdp_offload: bool = False
    "under torchrun: keep sharded parameters, gradients and optimizer state in CPU memory between uses (FSDP2 CPUOffloadPolicy)"
    fsdp_reshard: bool = True
    "under torchrun: free gathered parameters after each layer's forward (false keeps them until backward: faster, more memory)"
    fsdp_unit_layers: PositiveInt = 1
    "under torchrun with FSDP2: consecutive decoder layers per sharding unit (one all-gather and one reduce-scatter each: fewer, larger collectives, for more gathered weights live at once; the per-layer hooks stay)"
    fsdp_defer_sync: bool = False
    "under torchrun with several micro-batches a step per process: reduce the gradients once, after the last micro-batch (the earlier ones accumulate unsharded: + a whole fp32 gradient per GPU), not after each (distributed.accumulation)"
    fsdp_reduce: Literal["fp32", "bf16"] = "fp32"
    "under torchrun with FSDP2 and mixed precision: the dtype gradients are reduce-scattered in. fp32 (default) sums the ranks' bf16 gradients in fp32; bf16 halves the reduce-scatter's bytes and drops its fp32 copy of each unit's gradients (accelerate's FSDP2 default, so TRL's), rounding the sum to bf16"
    offload_activations: bool = False
    "on CUDA, the activations a training forward keeps for backward (under gradient_checkpointing, each decoder layer's input) in pinned CPU memory: copied out during forward and back one layer ahead of backward on a side stream, values unchanged; the step's peak drops by them for PCIe traffic overlapped with compute (H200, Qwen2.5-0.5B GRPO, 32 × 384 tokens a micro-batch, compiled, checkpointed: 5.84 -> 5.42 GB allocated, 0.60 -> 0.62 s a step; models/offload.py); single process"
    head_fp32: bool = False
    "under mixed precision, the trainer's LM head (the logits of its log-probs) in float32 from the master weights: bf16 logits are a part of the training-inference mismatch an fp32 sampler sees (models/logprobs.HEAD_DTYPE); single process (FSDP2 gathers bf16 weights)"


    def __post_init__(self):
        bad = fsdp_conflict(self.fsdp, self.fsdp_offload, self.fsdp_reduce, self.fsdp_defer_sync)
        if bad:
            raise ValueError(f"model.{bad[1]}")


@dataclass
class OptimSection:
    lr: Positive = 2e-5
    "peak learning rate (AdamW)"
    weight_decay: NonNegative = 0.0
    "AdamW weight decay (never applied to norms and biases)"
    adam_betas: list[Beta] = field(default_factory=lambda: [0.9, 0.999])
    "AdamW (beta1, beta2)"
    fused_adamw: Literal["auto", "on", "off"] = "auto"
    "AdamW's fused kernel: auto = on CUDA only; on = on CPU too (faster, rounds differently from the per-tensor loop)"
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    "learning-rate shape after warmup"
    warmup_steps: NonNegativeInt = 0
    "linear warmup, in optimizer updates (0 = use warmup_ratio)"
    warmup_ratio: Fraction = 0.0
    "warmup as a fraction of all optimizer updates when warmup_steps is 0"
    min_lr_ratio: Fraction = 0.0
    "final learning rate as a fraction of the peak"
    max_grad_norm: NonNegative = 1.0
    "gradient clipping by global norm (0 = off)"
    max_steps: int = -1
    "steps to run (a step = one batch), >= 1; -1 = derive from epochs"
    epochs: Positive = 1.0
    "passes over the data when max_steps is -1"
    max_skipped_steps: int = 10
    "stop the run with an error after this many consecutive skipped steps (non-finite loss, gradient or update; 0 = never)"

    # Fields a resumed run may change (the rest must equal the checkpointed run's config.yaml):
    # the run's length. The schedule follows the new length from the step it resumes at.
    RESUMABLE: ClassVar[tuple[str, ...]] = ("max_steps", "epochs", "max_skipped_steps")

    def __post_init__(self):
        if len(self.adam_betas) != 2:
            raise ValueError("adam_betas must be two numbers")
        if self.max_steps == 0 or self.max_steps < -1:  # 0 is no length: -1 says "from epochs"
            raise ValueError(f"max_steps must be >= 1, or -1 to derive it from epochs; got {self.max_steps}")


@dataclass
class RunSection:
    name: str = "run"
    "run name: everything is written to <runs_dir>/<name>/"
    runs_dir: DirPath = "runs"
    "parent directory of run directories"
    seed: Seed = 0
    "seed for data order, initialization of new heads and sampling"
    log_every: PositiveInt = 10
    "write metrics every N steps"
    eval_every: NonNegativeInt = 0
    "evaluate every N steps (0 = only at the end)"
    num_samples: NonNegativeInt = 4
    "completions written to samples.jsonl at each log / eval point"
    save_every: NonNegativeInt = 0
    "checkpoint every N steps (0 = only at the end)"
    keep_last: NonNegativeInt = 2
    "step-N checkpoints to keep (older ones are deleted; 0 = keep all); checkpoints/best is never deleted"
    keep_best: Optional[str] = None
    "keep the policy of the eval point with the best value of this eval metric as checkpoints/best (e.g. eval/pass@1 = eval/greedy/pass@1, eval/loss, eval/rewards/accuracies, eval/accuracy); its step and value go to checkpoints/best/best.json and summary.json's `best`"
    keep_best_mode: Literal["auto", "max", "min"] = "auto"
    "is keep_best's metric better high (max) or low (min)? auto: by its name (accuracy, pass@k, reward, margin: max; loss, perplexity, kl: min)"
    resume: bool = False
    "continue from the latest checkpoint in the run directory"
    log_with: list[Literal["none", "tensorboard", "wandb", "trackio", "mlflow"]] = field(default_factory=list)
    "experiment trackers beside metrics.jsonl (a list, or `log_with=wandb,tensorboard`; none = []): tensorboard (<run>/tensorboard), wandb (<run>/wandb, offline without an API key: `wandb sync` later), trackio ($TRACKIO_DIR), mlflow (run.mlflow_uri); each is its extra (pip install 'tether[wandb]'); one that fails mid-run is warned about once and left out (docs/architecture.md, Experiment trackers)"
    tracker_project: Optional[str] = None
    "the trackers' project (wandb, trackio) / experiment (mlflow); default: $WANDB_PROJECT, $TRACKIO_PROJECT, $MLFLOW_EXPERIMENT_NAME, else 'tether'"
    mlflow_uri: Optional[str] = None
    "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else a SQLite store in the run directory: sqlite:///<run>/mlflow.db, artifacts in <run>/mlruns)"
    progress: bool = True
    "show a progress bar with ETA and live metrics"
    overwrite: bool = False
    "a fresh run into a directory that holds a previous run replaces it (default: refused, to keep its results)"
    save_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    "dtype of the model weights in checkpoints: auto = the dtype model.path is stored in (a bf16 model trained with fp32 master weights is saved as bf16; exact weights for resume go to master_weights.safetensors); LoRA adapters and reward models are saved as trained"

    # Fields a resumed run may change: where and how often it logs, evaluates and saves, and
    # how it shows progress; none of them changes what is trained.
    RESUMABLE: ClassVar[tuple[str, ...]] = ("name", "runs_dir", "log_every", "eval_every", "num_samples",
                                            "save_every", "keep_last", "keep_best", "keep_best_mode", "resume",
                                            "log_with", "tracker_project", "mlflow_uri", "progress", "overwrite",
                                            "save_dtype")

    def __post_init__(self):
        self.log_with = log_targets(self.log_with)  # one name or "a,b" from Python; "none" = []


def check_columns(columns: dict) -> None:
    """`data.columns` is a mapping of column names to column names, no two onto the same one."""
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in columns.items()):
        raise ValueError(f"columns must map column names to column names, e.g. {{question: prompt}}; got {columns!r}")
    targets = list(columns.values())
    if len(set(targets)) < len(targets):
        twice = next(t for t in targets if targets.count(t) > 1)
        raise ValueError(f"columns maps two columns onto {twice!r}")


@dataclass
class DataSection:
    """Examples with targets (SFT, reward model, preference pairs)."""
    PRIMARY: ClassVar[str] = "path"  # `data=<file>` sets data.path

    path: str = ""
    "training data: .jsonl/.json/.parquet/.csv file, a save_to_disk directory, or a hub dataset name"
    split: str = "train"
    "split to read when `data` is a dataset directory or hub name"
    eval_data: Optional[str] = None
    "held-out data in the same format (default: carve eval_fraction out of `data`), evaluated every run.eval_every steps and at the end: eval/loss (+ eval/perplexity for sft, eval/rewards/... for dpo-family, eval/accuracy for rm)"
    eval_fraction: Annotated[float, Range(ge=0, lt=1)] = 0.0
    "fraction of `data` held out for eval when eval_data is not given"
    max_length: PositiveInt = 1024
    "longest tokenized example (prompt + completion)"
    truncation: Literal["truncate", "drop"] = "truncate"
    "what to do with an example over max_length: cut its end, or drop it (both are counted)"
    batch_size: PositiveInt = 8
    "examples per micro-batch"
    grad_accum: PositiveInt = 1
    "micro-batches per optimizer step (effective batch = batch_size * grad_accum)"
    packing: bool = False
    "padding-free batches (sft, rm, dpo family): a micro-batch's sequences laid end to end in rows no longer than its longest (one row under flash attention), positions restarting per sequence, attention kept inside each; the same loss as padded up to float rounding, fewer tokens through the model when lengths vary (tether.data.pack_batch, docs/architecture.md)"
    columns: dict[str, str] = field(default_factory=dict)
    "rename the data's columns to the format's, e.g. columns='{question: prompt, answer: completion}' (GSM8K); applies to eval_data too"

    def __post_init__(self):
        check_columns(self.columns)


@dataclass
class PromptSection:
    """Prompt-only rows for the trainers that sample their own completions (GRPO, PPO, best-of-n)."""
    PRIMARY: ClassVar[str] = "path"

    path: str = ""
    "prompt-only data: a `prompt` column (+ extra columns, passed to reward functions by name)"
    split: str = "train"
    "split to read when `data` is a dataset directory or hub name"
    eval_data: Optional[str] = None
    "held-out prompts in the same format (columns renamed alike): greedy pass@1 and mean rewards (reward.eval_reward_funcs, default the training rewards) logged as eval/greedy/... every run.eval_every steps and at the end (tether.evaluation, as `tether eval`)"
    max_prompt_length: PositiveInt = 512
    "longest prompt in tokens (longer ones keep their end, or are dropped per `truncation`)"
    truncation: Literal["truncate", "drop"] = "truncate"
    "what to do with a prompt over max_prompt_length"
    batch_size: PositiveInt = 8
    "prompts per step (each gets num_generations completions)"
    columns: dict[str, str] = field(default_factory=dict)
    "rename the data's columns, e.g. columns='{question: prompt}' (GSM8K; its `answer` column then reaches the reward functions as is)"

    def __post_init__(self):
        check_columns(self.columns)


@dataclass
class RolloutSection:
    """How completions are sampled (tether.rollout): the same knobs for every sampling trainer."""
    num_generations: PositiveInt = 8
    "completions sampled per prompt"
    max_new_tokens: PositiveInt = 256
    "most tokens generated per completion"
    temperature: Positive = 1.0
    "sampling temperature; log-probs (sampler and trainer) are taken at this temperature"
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    "nucleus sampling (1 = off); note the trained log-probs are then over the full vocabulary"
    top_k: NonNegativeInt = 0
    "top-k sampling (0 = off)"
    stop: list[str] = field(default_factory=list)
    "stop strings ending a completion (besides EOS)"
    sampler_copy: bool | Literal["auto"] = "auto"
    "one process (grpo family, ppo): sample from a copy of the policy whose weights are in the compute dtype (bf16 on CUDA with fp32 weights under mixed precision; its KV cache too), refreshed after each update, instead of from the fp32 weights themselves; costs 2 B a parameter (the bf16 KV cache still borrows the idle fp32 gradient buffer's bytes). auto: a copy exactly when the trainer computes in bf16 over fp32 weights, so that the sampled policy is the one the gradient is taken for (docs/grpo.md); under torchrun the copy always exists"
    release_replica: bool = False
    "grpo family and ppo with a sampling copy (under torchrun, or rollout.sampler_copy): free the copy's weights and the sampler's KV cache once a batch is sampled (for the frozen models' forwards and the update) and rebuild them before the next rollout; the training step then holds neither (tether memory release_replica=true), at the cost of building the cache and capturing the CUDA graphs anew each step"

    def check_release(self) -> None:
        """rollout.release_replica needs a sampling copy to release (refused, not ignored)."""
        if self.release_replica and self.sampler_copy is not True and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            from tether.config import ConfigError
            raise ConfigError("config key 'rollout.release_replica': one process samples from the policy "
                              "itself (its KV cache already in the idle gradient buffer): nothing to release; "
                              "set rollout.sampler_copy=true, or run under torchrun")

    def sampling(self):
        """The sampler's config for these knobs (the engine's other settings keep their defaults)."""
        return SamplingConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, stop=list(self.stop))


@dataclass
class RewardSection:
    reward_funcs: list[str] = field(default_factory=list)
    "reward functions: built-in names (math, arithmetic, format, length_penalty, code), 'module:function' (the working directory is importable), a file 'path/to/file.py:function', or a reward model 'rm:<dir>'"
    reward_weights: list[float] = field(default_factory=list)
    "weight of each reward function (default: all 1.0)"
    eval_reward_funcs: list[str] = field(default_factory=list)
    "rewards not trained on (e.g. a gold reward next to a learned proxy), each weight 1.0: the held-out prompts (data.eval_data) are scored with them instead of the training rewards (eval/greedy/...); ppo also logs them on its training samples (eval_rewards/<name>/mean)"


def check_env(cfg) -> None:
    """What an environment's episodes do not combine with (one-line errors, before anything loads)."""
    if not cfg.environment.env:
        if cfg.data.path == "env":
            raise ConfigError("data=env draws the rows from the environment: set env=<environment>")
        return
    if getattr(cfg, "queue", None) is not None and cfg.queue.partial:
        raise ConfigError("config key 'queue.partial': partial rollouts continue single-turn completions; "
                          "an environment's episodes run whole")
    if cfg.rollout.stop:
        raise ConfigError("config key 'rollout.stop': an episode's turns end at the chat template's end of "
                          "turn; stop strings do not combine with env=")
