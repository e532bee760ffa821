"""`tether <command> [--config file.yaml] [key=value ...]`

Every command is a dataclass config plus a function that takes it. The registry below is the
whole CLI: adding a command is one line. Modules are imported lazily so `tether --help` does not
pay for importing every trainer's dependencies unless it has to list their options.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

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
    "grpo": ("tether.trainers.grpo", "GRPOConfig", "train_grpo",
             "online RL, critic-free family: GRPO, Dr.GRPO, RLOO, ReMax, REINFORCE++, GSPO, DAPO clip-higher"),
    "rloo": ("tether.trainers.grpo", "RLOOConfig", "train_grpo", "the grpo loop preset to RLOO: leave-one-out baseline, k1 KL in the reward"),
    "remax": ("tether.trainers.grpo", "ReMaxConfig", "train_grpo", "the grpo loop preset to ReMax: one sample + greedy baseline per prompt, KL in the reward"),
    "ppo": ("tether.trainers.ppo", "PPOConfig", "train_ppo",
            "PPO-RLHF: policy + frozen reference + reward model(s) + value model, GAE, KL in the reward"),
    "study overoptimization": ("tether.studies.overoptimization", "OveroptimizationConfig", "run_overoptimization",
                               "gold-reward lab: proxy RM, PPO β sweep and best-of-n vs a known gold reward"),
    "study frontier": ("tether.studies.frontier", "FrontierConfig", "run_frontier",
                       "reward-KL frontier of DPO/cDPO/rDPO/IPO/hinge/KTO/SimPO/ORPO vs PPO on the gold-reward world"),
    "study prm": ("tether.studies.prm", "PRMStudyConfig", "run_prm_study",
                  "process vs outcome reward models on arithmetic with exact step truth: best-of-n selection, Math-Shepherd label quality"),
    "label steps": ("tether.labeling.steps", "LabelStepsConfig", "label_steps",
                    "Math-Shepherd step labels: roll out K completions from every step prefix of sampled solutions (hard/soft)"),
    "study judges": ("tether.studies.judges", "JudgesConfig", "run_judges",
                     "AI judges with known position/verbosity biases vs gold (labels, proxy RM, PPO); an LM judge vs HH-RLHF labels"),
    "dpo": ("tether.trainers.preference.offline", "DPOConfig", "train_offline", "offline preference: DPO, cDPO, rDPO, IPO, hinge (loss=...)"),
    "odpo": ("tether.trainers.preference.online", "ODPOConfig", "train_odpo",
             "online / iterative DPO: k samples per prompt from the current policy, best vs worst by a reward (or self), DPO steps; reference=fixed|reset"),
    "kto": ("tether.trainers.preference.offline", "KTOConfig", "train_offline", "KTO on unpaired labelled completions (pairs are split)"),
    "simpo": ("tether.trainers.preference.offline", "SimPOConfig", "train_offline", "SimPO: reference-free, length-normalized, margin γ"),
    "orpo": ("tether.trainers.preference.offline", "ORPOConfig", "train_offline", "ORPO: SFT + odds-ratio preference term, no reference"),
    "rm": ("tether.trainers.rm", "RMConfig", "train_rm",
           "reward model: Bradley-Terry on preference pairs (margin, centering; ensembles = runs by seed)"),
    "prm": ("tether.trainers.prm", "PRMConfig", "train_prm",
            "process reward model: per-step BCE on stepwise data (TRL format); use as prm:<run>?aggregate=min"),
    "bon": ("tether.trainers.best_of_n", "BoNConfig", "run_bon",
            "best-of-n sampling with any reward (gold vs proxy vs KL_BoN); rft=true fine-tunes on the best"),
    "init-model": ("tether.init_model", "InitModelConfig", "init_model", "a small random-init model + character tokenizer from your data's characters, to train from scratch"),
    "convert": ("tether.convert", "ConvertConfig", "run_convert", "a GGUF checkpoint as a bf16 HF folder with its tokenizer and chat template (needs `pip install 'tether[gguf]'`)"),
    "eval": ("tether.evaluation.command", "EvalConfig", "run_eval",
             "evaluate on held-out data: pass@k + rewards (greedy, sampled), RM / DPO preference accuracy, perplexity"),
    "chat": ("tether.chat", "ChatConfig", "run_chat",
             "chat with a model in the terminal over tether's sampler, streamed; env= runs an environment's tools"),
    "serve": ("tether.serve", "ServeConfig", "run_serve",
              "an OpenAI-compatible chat completions endpoint over tether's sampler, token ids in every response (needs tether[studio])"),
    "label pairs": ("tether.feedback.label", "LabelPairsConfig", "label_pairs",
                    "AI feedback: an instruct-model judge labels response pairs under a constitution (swap-debiased) -> preference JSONL"),
    "cai": ("tether.feedback.cai", "CAIConfig", "run_cai",
            "Constitutional AI data: response -> critique -> revision rounds under sampled principles -> SFT rows"),
    "memory": ("tether.memory", "MemoryConfig", "run_memory",
               "estimate GPU memory per component for an algorithm and model size"),
    "studio": ("tether.studio.command", "StudioConfig", "run_studio",
               "local web app: runs and live curves, preference labeler, GRPO/memory/reward-hacking explorers (needs tether[studio])"),
}


def load_command(name: str):
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
        cfg_cls, _ = load_command(n)
        lines += ["", f"tether {n}:", format_help(cfg_cls)]
    return "\n".join(lines)


def _command_help(name: str) -> str:
    cfg_cls, _ = load_command(name)
    return "\n".join([f"usage: tether {name} [--config file.yaml] [key=value ...]", "",
                      COMMANDS[name][3], "", "options:", format_help(cfg_cls)])


# two-word commands: `tether study frontier`, `tether label pairs`; the group word -> what it lists
GROUPS = {"study": "studies", "label": "labelers"}


def _members(group: str) -> dict[str, str]:
    return {n.split(" ", 1)[1]: doc for n, (_, _, _, doc) in COMMANDS.items() if n.startswith(group + " ")}


def _group_help(group: str) -> str:
    members = _members(group)
    width = max((len(n) for n in members), default=4)
    return "\n".join([f"usage: tether {group} <name> [--config file.yaml] [key=value ...]", "", f"{GROUPS[group]}:"]
                      + [f"  {n:<{width}}  {doc}" for n, doc in members.items()]
                      + ["", f"options of one: tether {group} <name> --help"])


def _where(e: BaseException) -> str:
    """Where an unexpected exception was raised, as file:line in function: the innermost frame in
    code the user can act on (tether's, or their own reward function's), not in a library."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "site-packages" not in f.filename and "/lib/python" not in f.filename]
    f = (ours or frames or [None])[-1]
    if f is None:
        return ""
    path = Path(f.filename)
    parts = path.parts
    short = "/".join(parts[len(parts) - 1 - parts[::-1].index("tether"):]) if "tether" in parts else path.name
    return f" at {short}:{f.lineno} in {f.name}()"


def main(argv: list[str] | None = None) -> int:
    """Run a command; every error is one line on stderr (config errors exit 2, others 1), and the
    traceback is printed only with --debug or TETHER_DEBUG=1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("TETHER_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    name = argv[0] if argv else ""
    # A file-size limit (`ulimit -f`) kills a process with SIGXFSZ by default, silently; ignored, the
    # write fails with EFBIG and the run stops with one line naming the run and its last checkpoint
    # (tether.run: a full disk). signal() works in the main thread only.
    if hasattr(signal, "SIGXFSZ") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if name in GROUPS and len(argv) > 1 and not argv[1].startswith("-") and "=" not in argv[1]:
        name = f"{name} {argv[1]}"
    # Under torchrun every rank runs this. Bad input (config, data) fails the same way on every
    # rank and is said once, by rank 0; anything else may be one rank's own, so each rank says its
    # own, prefixed with its rank. torchrun stops the other ranks when one exits with an error.
    rank = int(os.environ.get("RANK", "0"))
    where = f"[rank {rank}] " if rank else ""
    try:
        code = _main(argv)
        _leave_process_group()  # on success only: see _leave_process_group
        return code
    except KeyboardInterrupt:
        print(f"{where}tether {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's contract: one line, never a bare traceback
        from tether.errors import UserError
        if debug:
            traceback.print_exc()
        text = " ".join(str(e).split()) or "(no message)"
        if isinstance(e, (ConfigError, UserError)):  # the message names file, row, field
            if rank == 0 or getattr(e, "rank_local", False):  # (distributed.rank_local)
                print(f"{where}tether {name}: error: {text}", file=sys.stderr)
            return 2 if isinstance(e, ConfigError) else 1
        hint = "" if debug else " (--debug or TETHER_DEBUG=1 for the traceback)"
        print(f"{where}tether {name}: error: {type(e).__name__}{_where(e)}: {text}{hint}", file=sys.stderr)
        return 1


def _leave_process_group() -> None:
    """Leave torch.distributed's process group if a command joined one (torchrun): see
    distributed.leave (a barrier, then the group destroyed; without them a rank can abort at exit).
    Only after a success: when a rank failed, a barrier or a destroy would wait for peers that are
    gone, and torchrun stops the job anyway. Imported lazily: plain commands never load torch here."""
    if "torch.distributed" in sys.modules:  # else no group was joined (and torch stays unloaded)
        from tether import distributed
        distributed.leave()


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from tether import __version__
        print(f"tether {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name in GROUPS and rest and not rest[0].startswith("-") and "=" not in rest[0]:
        name, rest = f"{name} {rest[0]}", rest[1:]  # `study x`, `label x`: two-word commands
    if name in GROUPS:  # `tether study --help`: what studies there are
        if not any(a in ("-h", "--help") for a in rest):
            raise ConfigError(f"name one of the {GROUPS[name]}: {', '.join(_members(name))} (tether {name} --help)")
        print(_group_help(name))
        return 0
    if name not in COMMANDS:
        group = name.split(" ", 1)[0]
        known = (f"{GROUPS[group]}: {', '.join(_members(group))}" if group in GROUPS and " " in name
                 else f"commands: {', '.join(COMMANDS)}")
        print(f"tether: error: unknown command '{name}'; {known}", file=sys.stderr)
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
                raise ConfigError("--config needs a file path")
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
    cfg_cls, fn = load_command(name)
    fn(load_config(cfg_cls, config_file, overrides, command=name))  # errors: one line, in main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
