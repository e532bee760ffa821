"""`tether eval`: evaluate a model on held-out data, write eval.json and print a table.

    tether eval model=<dir> data=prompts.jsonl reward_funcs=[arithmetic]     # generation: pass@k, rewards
    tether eval model=rm:<dir> data=pairs.jsonl                              # reward model: accuracy
    tether eval policy=<dir> ref=<dir> data=pairs.jsonl beta=0.1             # DPO implicit rewards
    tether eval model=<dir> data=sft.jsonl                                   # perplexity
    tether eval model=<dir> env=calculator data=env                          # episodes: pass@k

The mode follows from the model and the data (mode=auto): a reward model or a policy/ref pair
needs preference pairs; a causal LM is sampled on prompt-only data and scored on SFT data
(prompt-completion / language-modeling; mode=generation samples their prompts instead). Everything
about the input is checked before a model loads: the data (file:row:field), the reward functions,
the k of pass@k against n.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Optional

from tether.config import ConfigError, flat_init, to_dict
from tether.constraints import DirPath, NonNegativeInt, Positive, PositiveInt, Range, Seed
from tether.data.pipeline import load_data
from tether.errors import UserError
from tether.evaluation.generation import GenerationSettings
from tether.envs.rollouts import EnvSection, env_data
from tether.evaluation.report import print_table, write_eval

MODES = ("auto", "generation", "preference", "perplexity")
SFT_FORMATS = ("language-modeling", "prompt-completion")


@dataclass
class EvalModelSection:
    PRIMARY: ClassVar[str] = "path"  # `model=<dir>` sets model.path

    path: str = ""
    "the model: a causal LM directory or hub id, or 'rm:<dir>[,<dir>...]' for a reward model (or ensemble)"
    rm: Optional[str] = None
    "a reward model to score preference pairs with (= model=rm:<dir>): a `tether rm` checkpoint or run directory; 'a,b' is an ensemble"
    policy: Optional[str] = None
    "DPO implicit rewards: the trained policy (needs ref; model=<dir> with ref also works)"
    ref: Optional[str] = None
    "DPO implicit rewards: the reference model (the policy's starting point)"
    dtype: str = "auto"
    "weight dtype: auto (as stored) | fp32 | bf16 | fp16"
    device: str = "auto"
    "cuda | cpu | auto"
    attn_implementation: Optional[str] = None
    "attention kernel passed to from_pretrained (sdpa, eager, flash_attention_2)"


@dataclass
class EvalDataSection:
    PRIMARY: ClassVar[str] = "path"  # `data=<file>` sets data.path

    path: str = ""
    "held-out data: .jsonl/.json/.parquet/.csv, a save_to_disk directory or a hub dataset"
    split: str = "train"
    "split to read when `data` is a dataset directory or hub name"
    columns: dict[str, str] = field(default_factory=dict)
    "rename the data's columns, e.g. columns='{question: prompt}'"
    mode: Literal[MODES] = "auto"
    "auto: preference pairs for rm / policy+ref, sampling for prompt-only data, perplexity for SFT data; or force one"
    limit: NonNegativeInt = 0
    "evaluate the first N rows only (0 = all)"
    max_prompt_length: PositiveInt = 512
    "generation: longest prompt in tokens (longer ones keep their end, or are dropped per truncation)"
    max_length: PositiveInt = 1024
    "perplexity and DPO pairs: longest prompt + completion in tokens"
    truncation: Literal["truncate", "drop"] = "truncate"
    "what to do with an over-long example: cut it, or drop it (both are counted in eval.json)"
    batch_size: PositiveInt = 16
    "rows per forward (pairs, perplexity) or prompts per sampler call (generation)"


@dataclass
class EvalGenerationSection:
    decoding: Literal["both", "greedy", "sampled"] = "both"
    "greedy (temperature 0, one completion per prompt: pass@1 = accuracy), sampled (n per prompt), or both"
    n: PositiveInt = 8
    "completions sampled per prompt (sampled decoding)"
    k: list[PositiveInt] = field(default_factory=list)
    "the k of pass@k, each <= n (default: 1, 2, 4, ... and n)"
    temperature: Positive = 1.0
    "sampling temperature (sampled decoding)"
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    "nucleus sampling (1 = off)"
    top_k: NonNegativeInt = 0
    "top-k sampling (0 = off)"
    max_new_tokens: PositiveInt = 256
    "most tokens generated per completion (a completion cut there counts as truncated)"
    stop: list[str] = field(default_factory=list)
    "stop strings ending a completion (besides EOS)"
    seed: Seed = 0
    "sampling seed: the same seed, model and data draw the same completions"
    threshold: float = 1.0
    "a completion passes when its reward >= threshold (pass@k); an unscored one never passes"
    pass_reward: Optional[str] = None
    "the reward function (by name) that decides passing (default: the weighted total)"


@dataclass
class EvalRewardSection:
    reward_funcs: list[str] = field(default_factory=list)
    "generation: reward functions as in training: built-in names, 'module:function', 'file.py:function', 'rm:<dir>'"
    reward_weights: list[float] = field(default_factory=list)
    "weight of each reward function in the total (default: all 1.0)"


@dataclass
class EvalPreferenceSection:
    beta: Positive = 0.1
    "β of DPO's implicit reward r = β·(log π − log π_ref) (the run's preference.beta): margins scale with it, accuracy does not"


@dataclass
class EvalOutputSection:
    name: str = "eval"
    "output name: eval.json goes to <runs_dir>/<name>/ unless `out` is given"
    runs_dir: DirPath = "runs"
    "parent directory of run directories"
    out: Optional[str] = None
    "output directory (default <runs_dir>/<name>/; a training run's directory is fine): eval.json and completions.jsonl go there"
    table: bool = True
    "print the metrics as a table"


@flat_init
@dataclass
class EvalConfig:
    model: EvalModelSection = field(default_factory=EvalModelSection)
    "what is evaluated and how it runs"
    data: EvalDataSection = field(default_factory=EvalDataSection)
    "held-out data and the evaluation mode"
    generation: EvalGenerationSection = field(default_factory=EvalGenerationSection)
    "generation mode: sampling and pass@k"
    reward: EvalRewardSection = field(default_factory=EvalRewardSection)
    "generation mode: the reward functions"
    preference: EvalPreferenceSection = field(default_factory=EvalPreferenceSection)
    "preference mode with policy + ref"
    output: EvalOutputSection = field(default_factory=EvalOutputSection)
    "where the results go"
    environment: EnvSection = field(default_factory=EnvSection)
    "episodes of an environment instead of one completion per prompt: pass@k of episodes (data=env: the environment's own rows)"

    def __post_init__(self):
        m, g = self.model, self.generation
        if not self.data.path:
            raise ConfigError("config key 'data.path' is required: data=<file or dataset>")
        if m.path and m.rm:
            raise ConfigError("give the model once: model=rm:<dir> or rm=<dir>, not both")
        if m.policy and m.path:
            raise ConfigError("give the policy once: policy=<dir> or model=<dir> (with ref), not both")
        if m.policy and not m.ref:
            raise ConfigError("config key 'model.policy' needs model.ref: ref=<the reference model>")
        if m.ref and (m.rm or m.path.startswith("rm:")):
            raise ConfigError("model.ref is for DPO implicit rewards; a reward model (rm) needs none")
        if not (m.path or m.rm or m.policy):
            raise ConfigError("config key 'model.path' is required: model=<dir>, model=rm:<dir> or policy=<dir> ref=<dir>")
        if g.decoding != "greedy" and any(k > g.n for k in g.k):
            raise ConfigError(f"config key 'generation.k' must be <= generation.n (pass@k draws k of the n "
                              f"samples per prompt); got k={g.k}, n={g.n}")
        if self.reward.reward_weights and len(self.reward.reward_weights) != len(self.reward.reward_funcs):
            raise ConfigError(f"config key 'reward.reward_weights': {len(self.reward.reward_weights)} weights "
                              f"for {len(self.reward.reward_funcs)} reward functions")

    # -- what is evaluated ------------------------------------------------------------------------
    def rm_spec(self) -> Optional[str]:
        if self.model.rm:
            return self.model.rm if self.model.rm.startswith("rm:") else f"rm:{self.model.rm}"
        return self.model.path if self.model.path.startswith("rm:") else None

    def policy_path(self) -> str:
        return self.model.policy or self.model.path

    def settings(self) -> GenerationSettings:
        g = self.generation
        return GenerationSettings(
            decoding=("greedy", "sampled") if g.decoding == "both" else (g.decoding,), n=g.n, k=tuple(g.k),
            temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_new_tokens=g.max_new_tokens,
            stop=tuple(g.stop), seed=g.seed, threshold=g.threshold, pass_reward=g.pass_reward,
            batch_size=self.data.batch_size)

    def out_dir(self) -> Path:
        o = self.output
        return Path(o.out) if o.out else Path(o.runs_dir) / o.name


def resolve_mode(cfg: EvalConfig, fmt: str) -> str:
    """The evaluation mode for this model and data format (one-line UserError if they do not fit)."""
    src, mode = cfg.data.path, cfg.data.mode
    pairs = cfg.rm_spec() is not None or bool(cfg.model.ref)
    if pairs or mode == "preference":
        if not pairs:
            raise UserError(f"{src}: preference accuracy needs a reward model (model=rm:<dir>) or a "
                            f"DPO pair (policy=<dir> ref=<dir>)")
        if mode not in ("auto", "preference"):
            raise UserError(f"mode={mode} needs a causal LM: a reward model / policy+ref scores preference pairs")
        if fmt not in ("preference", "implicit-preference"):
            raise UserError(f"{src}: preference accuracy needs pairs (prompt, chosen, rejected); the data is {fmt}")
        return "preference"
    if fmt in ("preference", "implicit-preference"):
        raise UserError(f"{src}: preference pairs are scored by a reward model (model=rm:<dir>) or a DPO "
                        f"policy and its reference (policy=<dir> ref=<dir>)")
    if mode == "auto":
        mode = "generation" if fmt == "prompt-only" else "perplexity"
        if mode == "perplexity" and cfg.reward.reward_funcs:
            raise UserError(f"{src}: {fmt} data is scored for perplexity, which uses no reward_funcs; "
                            f"set mode=generation to sample its prompts and score them")
    if mode == "perplexity" and fmt not in SFT_FORMATS:
        raise UserError(f"{src}: perplexity needs prompt-completion or language-modeling data; the data is {fmt}")
    if mode == "generation" and fmt == "language-modeling":
        raise UserError(f"{src}: generation needs a `prompt` column; the data is {fmt}")
    return mode


def run_eval(cfg: EvalConfig) -> dict:
    """Evaluate per `cfg`; returns what eval.json holds (written to cfg.out_dir())."""
    from tether.evaluation import runners  # the model-loading side: only when evaluating

    started = time.time()
    d = cfg.data
    if cfg.environment.env:  # episodes: the data's prompt rows, or data=env the environment's held-out rows
        rows = env_data(cfg.environment, cfg.generation.seed, held_out=True) if d.path == "env" else \
            load_data(d.path, split=d.split, rename=d.columns, expect="prompt-only")
        fmt, mode = "prompt-only", "episodes"
    else:
        # read and validated once (file:row:field); implicit-prompt pairs come back explicit
        rows = load_data(d.path, split=d.split, rename=d.columns)
        fmt = rows.format
        mode = resolve_mode(cfg, fmt)
    rows = list(rows)[:d.limit] if d.limit else rows
    if mode == "episodes":
        result = runners.run_episodes(cfg, rows)
    elif mode == "generation":
        result = runners.run_generation(cfg, rows)
    elif mode == "perplexity":
        result = runners.run_perplexity(cfg, rows)
    elif cfg.rm_spec() is not None:
        result = runners.run_reward_model(cfg, rows)
    else:
        result = runners.run_dpo(cfg, rows)
    records = result.pop("records", [])
    out = {"mode": mode, "kind": result.pop("kind"), "metrics": result.pop("metrics"),
           "settings": result.pop("settings", {}),
           "model": {"path": cfg.model.path or None, "rm": cfg.rm_spec(), "policy": cfg.model.policy,
                     "ref": cfg.model.ref, "dtype": cfg.model.dtype},
           "data": {"path": d.path, "split": d.split, "format": fmt, "rows": len(rows), "limit": d.limit,
                    **result.pop("data", {})},
           **result, "seconds": round(time.time() - started, 3), "config": to_dict(cfg)}
    path = cfg.out_dir()
    # the config goes inside eval.json, not into config.yaml: `out` may be a training run's
    # directory, whose config.yaml a resume checks against
    write_eval(path, out, records)
    if cfg.output.table:
        print_table(out, path / "eval.json")
    return out


__all__ = ["EvalConfig", "run_eval", "resolve_mode", "MODES"]
