"""`tether <command> [--config file.yaml] [key=value ...]`

Every command is a dataclass config plus a function that takes it. The registry below is the
whole CLI: adding a command is one line. Modules are imported lazily so `tether --help` does not
pay for importing every trainer's dependencies unless it has to list their options.
"""

from __future__ import annotations

import importlib
import os
import sys

# Before torch is imported: CUDA memory in segments that grow in place instead of fixed blocks, so
# the mix of sizes an RL step allocates (sampler cache, chunked logits, activations) fragments
# less (H100 GRPO step, bench/grpo_step.py: 5.69 -> 5.26 GB peak reserved). A value the user set wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from tether.config import ConfigError, format_help, load_config  # noqa: E402

# name -> (module, config class, entry function, one-line doc)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "quickstart": ("tether.quickstart", "QuickstartConfig", "run_quickstart",
                   "pretrain -> SFT (-> RL) a tiny model on arithmetic on CPU, with a before/after table"),
    "sft": ("tether.trainers.sft", "SFTConfig", "train_sft",
            "supervised fine-tuning: language modelling or prompt->completion (completion-only loss)"),
    "grpo": ("tether.trainers.online", "GRPOConfig", "train_grpo",
             "online RL, critic-free family: GRPO, Dr.GRPO, RLOO, ReMax, REINFORCE++, GSPO, DAPO clip-higher"),
    "rloo": ("tether.trainers.online", "RLOOConfig", "train_grpo", "the grpo loop preset to RLOO: leave-one-out baseline, k1 KL in the reward"),
    "remax": ("tether.trainers.online", "ReMaxConfig", "train_grpo", "the grpo loop preset to ReMax: one sample + greedy baseline per prompt, KL in the reward"),
    "ppo": ("tether.trainers.ppo", "PPOConfig", "train_ppo",
            "PPO-RLHF: policy + frozen reference + reward model(s) + value model, GAE, KL in the reward"),
    "study overoptimization": ("tether.studies.overoptimization", "OveroptimizationConfig", "run_overoptimization",
                               "gold-reward lab: proxy RM, PPO β sweep and best-of-n vs a known gold reward"),
    "study frontier": ("tether.studies.frontier", "FrontierConfig", "run_frontier",
                       "reward-KL frontier of DPO/cDPO/rDPO/IPO/hinge/KTO/SimPO/ORPO vs PPO on the gold-reward world"),
    "dpo": ("tether.trainers.offline", "DPOConfig", "train_offline", "offline preference: DPO, cDPO, rDPO, IPO, hinge (loss=...)"),
    "kto": ("tether.trainers.offline", "KTOConfig", "train_offline", "KTO on unpaired labelled completions (pairs are split)"),
    "simpo": ("tether.trainers.offline", "SimPOConfig", "train_offline", "SimPO: reference-free, length-normalized, margin γ"),
    "orpo": ("tether.trainers.offline", "ORPOConfig", "train_offline", "ORPO: SFT + odds-ratio preference term, no reference"),
    "rm": ("tether.trainers.rm", "RMConfig", "train_rm",
           "reward model: Bradley-Terry on preference pairs (margin, centering; ensembles = runs by seed)"),
    "bon": ("tether.trainers.best_of_n", "BoNConfig", "run_bon",
            "best-of-n sampling with any reward (gold vs proxy vs KL_BoN); rft=true fine-tunes on the best"),
    "init-model": ("tether.init_model", "InitModelConfig", "init_model", "a small random-init model + character tokenizer from your data's characters, to train from scratch"),
    "memory": ("tether.memory", "MemoryConfig", "run_memory",
               "estimate GPU memory per component for an algorithm and model size"),
}


def _load(name: str):
    module, cfg_name, fn_name, _ = COMMANDS[name]
    mod = importlib.import_module(module)
    return getattr(mod, cfg_name), getattr(mod, fn_name)


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: tether <command> [--config file.yaml] [key=value ...]", "",
             "Post-train language models with RL and preference optimization.", "", "commands:"]
    lines += [f"  {n:<{width}}  {doc}" for n, (_, _, _, doc) in COMMANDS.items()]
    lines += ["", "Options of each command (set with key=value, or in the YAML file):"]
    for n in COMMANDS:
        cfg_cls, _ = _load(n)
        lines += ["", f"tether {n}:", format_help(cfg_cls)]
    return "\n".join(lines)


def _command_help(name: str) -> str:
    cfg_cls, _ = _load(name)
    return "\n".join([f"usage: tether {name} [--config file.yaml] [key=value ...]", "",
                      COMMANDS[name][3], "", "options:", format_help(cfg_cls)])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from tether import __version__
        print(f"tether {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name == "study" and rest and not rest[0].startswith("-") and "=" not in rest[0]:
        name, rest = f"study {rest[0]}", rest[1:]  # studies are two-word commands
    if name not in COMMANDS:
        print(f"tether: unknown command '{name}'; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in rest):
        print(_command_help(name))
        return 0
    config_file, overrides = None, []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--config":
            if i + 1 >= len(rest):
                print("tether: --config needs a file path", file=sys.stderr)
                return 2
            config_file = rest[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        elif arg.startswith("--") and "=" not in arg and i + 1 < len(rest) and "=" not in rest[i + 1]:
            overrides.append(f"{arg[2:]}={rest[i + 1]}")  # `--model 7e9` reads as model=7e9
            i += 2
            continue
        else:
            overrides.append(arg[2:] if arg.startswith("--") else arg)
        i += 1
    cfg_cls, fn = _load(name)
    try:
        cfg = load_config(cfg_cls, config_file, overrides)
    except ConfigError as e:
        print(f"tether {name}: {e}", file=sys.stderr)
        return 2
    from tether.errors import UserError  # data/model errors are one line, not a traceback
    try:
        fn(cfg)
    except UserError as e:
        print(f"tether {name}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tether {name}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
