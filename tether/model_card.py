"""Model cards: the README.md that makes a checkpoint folder a complete Hugging Face model page.

Every checkpoint (`checkpoints/step-N/`, `checkpoints/best/`) and the final model carry a README.md
with the Hub's YAML metadata block, as TRL's `push_to_hub` / `create_model_card` writes one, so
`huggingface-cli upload <repo> runs/<name>/checkpoints/step-N` publishes a complete model page:

    ---
    base_model: HuggingFaceTB/SmolLM2-135M-Instruct   model.path, when it reads as a hub id org/name
    library_name: transformers                          peft for a LoRA adapter
    license: apache-2.0                                 when the base model's own card says so
    datasets: [pairs.jsonl]                             the training and held-out data as given
    tags: [tether, dpo, preference-optimization]        the algorithm and its family
    pipeline_tag: text-generation                       text-classification for reward models
    ---
    the base model, the algorithm with its paper (and BibTeX), the data, the command that
    reproduces the run and its resolved config, the eval numbers, framework versions, trackers.

PPO's critic (`<checkpoint>/value/`) gets its own card (`value_model_card`): text-classification,
PPO's papers, the model it started from, the policy in the parent folder it is the critic of.

Everything comes from the run directory as plain data: config.yaml (the algorithm is read off its
sections: `grpo.advantage`, `preference.method` and `loss`, ...), metrics.jsonl (a step's card:
the last eval point at or before that step), summary.json (the final card: its final eval and
`best`) and trackers.json ({name: link}, when the run had trackers). `model_card(...)` renders;
`write_model_card(dir, run_path, ...)` reads those files and writes `<dir>/README.md`.
`RunDir.save_checkpoint` calls it inside each checkpoint's atomic write, and `Training.finish`
once more on the final checkpoint, with the summary, and on `checkpoints/best` (`write_best_card`:
its own step's eval point as "this checkpoint", the run's final eval and `best` beside it).

The papers are the ones the objectives' docstrings cite (tether/objectives/, docs/objectives.md).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Optional

import yaml

CARD = "README.md"
VALUE = "value"
"PPO's critic, a folder of the policy's checkpoint (trainers/ppo/critic.py)"
TRACKERS = "trackers.json"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
VERSIONS = ("tether", "transformers", "torch", "datasets", "tokenizers")


# -- the papers --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Paper:
    key: str
    "the BibTeX key"
    title: str
    authors: tuple
    "full names in the paper's order; a last entry 'others' stands for the rest (BibTeX's et al.)"
    year: int
    arxiv: Optional[str] = None
    "the arXiv id (YYMM.NNNNN)"
    url: Optional[str] = None
    "where a paper without an arXiv id is published"

    @property
    def link(self) -> str:
        return f"https://arxiv.org/abs/{self.arxiv}" if self.arxiv else self.url

    @property
    def short(self) -> str:
        """Rafailov et al. 2023, as the objectives' docstrings cite it."""
        last = self.authors[0].split()[-1]
        return f"{last} et al. {self.year}" if len(self.authors) > 1 else f"{last} {self.year}"

    def bibtex(self) -> str:
        where = (f"  eprint  = {{arXiv:{self.arxiv}}},\n" if self.arxiv else f"  url     = {{{self.url}}},\n")
        return (f"@{'article' if self.arxiv else 'misc'}{{{self.key},\n"
                f"  title   = {{{{{self.title}}}}},\n"
                f"  author  = {{{' and '.join(self.authors)}}},\n"
                f"  year    = {{{self.year}}},\n{where}}}")


PAPERS = {p.key: p for p in (
    Paper("ouyang2022training", "Training language models to follow instructions with human feedback",
          ("Long Ouyang", "Jeff Wu", "Xu Jiang", "Diogo Almeida", "Carroll L. Wainwright", "Pamela Mishkin",
           "Chong Zhang", "Sandhini Agarwal", "Katarina Slama", "Alex Ray", "John Schulman", "Jacob Hilton",
           "Fraser Kelton", "Luke Miller", "Maddie Simens", "Amanda Askell", "Peter Welinder",
           "Paul Christiano", "Jan Leike", "Ryan Lowe"), 2022, "2203.02155"),
    Paper("lightman2023lets", "Let's Verify Step by Step",
          ("Hunter Lightman", "Vineet Kosaraju", "Yura Burda", "Harri Edwards", "Bowen Baker", "Teddy Lee",
           "Jan Leike", "John Schulman", "Ilya Sutskever", "Karl Cobbe"), 2023, "2305.20050"),
    Paper("schulman2017proximal", "Proximal Policy Optimization Algorithms",
          ("John Schulman", "Filip Wolski", "Prafulla Dhariwal", "Alec Radford", "Oleg Klimov"), 2017, "1707.06347"),
    Paper("shao2024deepseekmath",
          "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
          ("Zhihong Shao", "Peiyi Wang", "Qihao Zhu", "Runxin Xu", "Junxiao Song", "Mingchuan Zhang",
           "Y. K. Li", "Y. Wu", "Daya Guo"), 2024, "2402.03300"),
    Paper("liu2025understanding", "Understanding R1-Zero-Like Training: A Critical Perspective",
          ("Zichen Liu", "Changyu Chen", "Wenjun Li", "Penghui Qi", "Tianyu Pang", "Chao Du", "Wee Sun Lee",
           "Min Lin"), 2025, "2503.20783"),
    Paper("yu2025dapo", "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
          ("Qiying Yu", "others"), 2025, "2503.14476"),
    Paper("ahmadian2024back",
          "Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human Feedback in LLMs",
          ("Arash Ahmadian", "Chris Cremer", "Matthias Gallé", "Marzieh Fadaee", "Julia Kreutzer",
           "Olivier Pietquin", "Ahmet Üstün", "Sara Hooker"), 2024, "2402.14740"),
    Paper("li2023remax",
          "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large "
          "Language Models",
          ("Ziniu Li", "Tian Xu", "Yushun Zhang", "Zhihang Lin", "Yang Yu", "Ruoyu Sun", "Zhi-Quan Luo"),
          2023, "2310.10505"),
    Paper("hu2025reinforce", "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
          ("Jian Hu",), 2025, "2501.03262"),
    Paper("zheng2025group", "Group Sequence Policy Optimization", ("Chujie Zheng", "others"), 2025, "2507.18071"),
    Paper("zhao2025geometric", "Geometric-Mean Policy Optimization", ("Yuzhong Zhao", "others"), 2025, "2507.20673"),
    Paper("rafailov2023direct", "Direct Preference Optimization: Your Language Model is Secretly a Reward Model",
          ("Rafael Rafailov", "Archit Sharma", "Eric Mitchell", "Christopher D. Manning", "Stefano Ermon",
           "Chelsea Finn"), 2023, "2305.18290"),
    Paper("mitchell2023note", "A note on DPO with noisy preferences & relationship to IPO",
          ("Eric Mitchell",), 2023, url="https://ericmitchell.ai/cdpo.pdf"),
    Paper("chowdhury2024provably", "Provably Robust DPO: Aligning Language Models with Noisy Feedback",
          ("Sayak Ray Chowdhury", "Anush Kini", "Nagarajan Natarajan"), 2024, "2403.00409"),
    Paper("azar2023general", "A General Theoretical Paradigm to Understand Learning from Human Preferences",
          ("Mohammad Gheshlaghi Azar", "Mark Rowland", "Bilal Piot", "Daniel Guo", "Daniele Calandriello",
           "Michal Valko", "Rémi Munos"), 2023, "2310.12036"),
    Paper("zhao2023slic", "SLiC-HF: Sequence Likelihood Calibration with Human Feedback",
          ("Yao Zhao", "Rishabh Joshi", "Tianqi Liu", "Misha Khalman", "Mohammad Saleh", "Peter J. Liu"),
          2023, "2305.10425"),
    Paper("pal2024smaug", "Smaug: Fixing Failure Modes of Preference Optimisation with DPO-Positive",
          ("Arka Pal", "Deep Karkhanis", "Samuel Dooley", "Manley Roberts", "Siddartha Naidu", "Colin White"),
          2024, "2402.13228"),
    Paper("pang2024iterative", "Iterative Reasoning Preference Optimization",
          ("Richard Yuanzhe Pang", "Weizhe Yuan", "Kyunghyun Cho", "He He", "Sainbayar Sukhbaatar",
           "Jason Weston"), 2024, "2404.19733"),
    Paper("ethayarajh2024kto", "KTO: Model Alignment as Prospect Theoretic Optimization",
          ("Kawin Ethayarajh", "Winnie Xu", "Niklas Muennighoff", "Dan Jurafsky", "Douwe Kiela"), 2024, "2402.01306"),
    Paper("meng2024simpo", "SimPO: Simple Preference Optimization with a Reference-Free Reward",
          ("Yu Meng", "Mengzhou Xia", "Danqi Chen"), 2024, "2405.14734"),
    Paper("hong2024orpo", "ORPO: Monolithic Preference Optimization without Reference Model",
          ("Jiwoo Hong", "Noah Lee", "James Thorne"), 2024, "2403.07691"),
    Paper("guo2024direct", "Direct Language Model Alignment from Online AI Feedback",
          ("Shangmin Guo", "Biao Zhang", "Tianlin Liu", "Tianqi Liu", "Misha Khalman", "Felipe Llinares",
           "Alexandre Ramé", "Thomas Mesnard", "Yao Zhao", "Bilal Piot", "Johan Ferret", "Mathieu Blondel"),
          2024, "2402.04792"),
    Paper("stiennon2020learning", "Learning to summarize from human feedback",
          ("Nisan Stiennon", "Long Ouyang", "Jeff Wu", "Daniel M. Ziegler", "Ryan Lowe", "Chelsea Voss",
           "Alec Radford", "Dario Amodei", "Paul Christiano"), 2020, "2009.01325"),
)}


# -- the algorithm, read off a resolved config -------------------------------------------------------

@dataclass(frozen=True)
class Algorithm:
    name: str
    "as the card says it: 'DPO', 'GRPO with DAPO clip-higher', 'Reward model (Bradley–Terry)'"
    command: str
    "the `tether <command>` that takes the config (the grpo family's presets: grpo, rloo, remax)"
    tags: tuple
    "the Hub tags after `tether`: the algorithm's, then its family's"
    papers: tuple
    "PAPERS keys, the paper that introduced the method first"
    pipeline_tag: str = "text-generation"


ONLINE = {  # grpo.advantage -> (name, tag, paper, command)
    "grpo": ("GRPO", "grpo", "shao2024deepseekmath", "grpo"),
    "dr_grpo": ("Dr. GRPO", "dr-grpo", "liu2025understanding", "grpo"),
    "rloo": ("RLOO", "rloo", "ahmadian2024back", "rloo"),
    "remax": ("ReMax", "remax", "li2023remax", "remax"),
    "reinforce_pp": ("REINFORCE++", "reinforce-plus-plus", "hu2025reinforce", "grpo"),
    "reinforce_pp_baseline": ("REINFORCE++-baseline", "reinforce-plus-plus", "hu2025reinforce", "grpo"),
}
DPO_LOSSES = {  # preference.loss of method=dpo -> (name, tag, paper)
    "robust": ("rDPO (robust DPO)", "rdpo", "chowdhury2024provably"),
    "ipo": ("IPO", "ipo", "azar2023general"),
    "hinge": ("DPO with SLiC-HF's hinge loss", "slic", "zhao2023slic"),
    "dpop": ("DPO-Positive (DPOP)", "dpop", "pal2024smaug"),
}
PREFERENCE = {  # preference.method other than dpo -> (name, tag, paper)
    "kto": ("KTO", "kto", "ethayarajh2024kto"),
    "simpo": ("SimPO", "simpo", "meng2024simpo"),
    "orpo": ("ORPO", "orpo", "hong2024orpo"),
}
RL_TAGS = ("reinforcement-learning",)
PREFERENCE_TAGS = ("preference-optimization",)


def algorithm_of(config: dict) -> Optional[Algorithm]:
    """The algorithm a run's resolved config (config.yaml, as a dict) trains with, from its sections;
    None for a config no trainer writes."""
    if "grpo" in config:
        return _online(config["grpo"])
    if "ppo" in config:
        return Algorithm("PPO (RLHF)", "ppo", ("ppo", "rlhf", *RL_TAGS),
                         ("schulman2017proximal", "ouyang2022training"))
    if "odpo" in config:  # before `preference`: online DPO has that section too
        reset = config["odpo"].get("reference") == "reset"
        return Algorithm("Iterative DPO" if reset else "Online DPO", "odpo",
                         ("online-dpo", "dpo", *PREFERENCE_TAGS), ("guo2024direct", "rafailov2023direct"))
    if "preference" in config:
        return _preference(config["preference"])
    if "rm" in config:
        return Algorithm("Reward model (Bradley–Terry)", "rm", ("reward-model",), ("ouyang2022training",),
                         pipeline_tag="text-classification")
    if "prm" in config:
        return Algorithm("Process reward model", "prm", ("prm", "process-reward-model", "reward-model"),
                         ("lightman2023lets",), pipeline_tag="text-classification")
    if "sft" in config:
        return Algorithm("SFT", "sft", ("sft",), ("ouyang2022training",))
    if "bon" in config:
        return Algorithm("Best-of-n rejection-sampling fine-tuning", "bon", ("best-of-n", "rft"),
                         ("stiennon2020learning",))
    return None


def _online(g: dict) -> Algorithm:
    advantage = g.get("advantage", "grpo")
    if advantage == "grpo" and g.get("scale_rewards") == "none":
        advantage = "dr_grpo"  # the config's own doc: scale_rewards=none is dr_grpo
    name, tag, paper, command = ONLINE.get(advantage, (advantage, advantage, None, "grpo"))
    extra = []  # (what, tag, paper) of the variants a config turns on
    level = g.get("importance_level", "token")
    if level == "sequence":
        extra.append(("GSPO sequence ratios", "gspo", "zheng2025group"))
    elif level == "gmpo":
        extra.append(("GMPO geometric-mean ratios", "gmpo", "zhao2025geometric"))
    clip_low, clip_high = g.get("clip_low", 0.2), g.get("clip_high")
    for on, what in ((clip_high is not None and clip_high > clip_low, "clip-higher"),
                     (g.get("dynamic_sampling"), "dynamic sampling"),
                     (g.get("overlong_buffer"), "overlong shaping"),
                     (g.get("mask_truncated_completions"), "overlong filtering")):
        if on:
            extra.append((f"DAPO {what}", "dapo", "yu2025dapo"))
    if extra:
        name += " with " + ", ".join(what for what, _, _ in extra)
    tags = _unique([tag, *(t for _, t, _ in extra), *RL_TAGS])
    return Algorithm(name, command, tags, _unique([paper, *(p for _, _, p in extra)]))


def _preference(p: dict) -> Algorithm:
    method = p.get("method", "dpo")
    if method in PREFERENCE:
        name, tag, paper = PREFERENCE[method]
        return Algorithm(name, method, (tag, *PREFERENCE_TAGS), (paper,))
    loss = p.get("loss", "sigmoid")
    name, tag, paper = DPO_LOSSES.get(loss, ("DPO", "dpo", "rafailov2023direct"))
    if loss == "sigmoid" and p.get("label_smoothing"):
        name, tag, paper = "cDPO (conservative DPO)", "cdpo", "mitchell2023note"
    tags, papers = [tag, "dpo"], [paper, "rafailov2023direct"]
    if p.get("rpo_alpha"):
        name, tags, papers = name + " with RPO's NLL term", tags + ["rpo"], papers + ["pang2024iterative"]
    return Algorithm(name, "dpo", _unique([*tags, *PREFERENCE_TAGS]), _unique(papers))


def _unique(items) -> tuple:
    return tuple(dict.fromkeys(i for i in items if i))


# -- the card ------------------------------------------------------------------------------------------

@dataclass
class Evaluation:
    """The numbers a card reports: the eval metrics of one eval point, the keep_best race, and the
    last logged training numbers."""
    metrics: dict = field(default_factory=dict)
    "eval/... -> value at the eval point"
    step: Optional[int] = None
    "the eval point's step"
    final: bool = False
    "the run's final evaluation (summary.json), not a step's"
    best: Optional[dict] = None
    "run.keep_best's race: {metric, mode, step, value}"
    train: dict = field(default_factory=dict)
    "the last logged loss / reward at or before the step"
    train_step: Optional[int] = None
    run_final: Optional[dict] = None
    "{step, metrics}: the run's final eval (summary.json), beside an earlier checkpoint's own (keep_best's)"


def looks_like_hub_id(path: str) -> bool:
    """`org/name`, as a Hub repository id reads (a local folder of that shape reads so too)."""
    return bool(HUB_ID.match(path)) and not path.lower().endswith(".gguf") and ".." not in path


def model_card(config: dict, *, step: int, folder: str, evaluation: Optional[Evaluation] = None,
               adapter: bool = False, trackers: Optional[dict] = None, versions: Optional[dict] = None,
               base_card: Optional[dict] = None, rft_data: Optional[str] = None) -> str:
    """The README.md of a model folder, from plain data.

    config: the resolved config that reproduces the model (config.yaml as a dict); step: the
    training step of the weights; folder: where the folder is (for the usage snippet);
    evaluation: its numbers; adapter: the folder holds a LoRA adapter (library_name peft);
    trackers: {tracker: link}; versions: {package: version}; base_card: the base model's card
    metadata (its license, and its base_model when it is a local folder of our own);
    rft_data: best-of-n's kept samples the model was fine-tuned on (a `tether bon rft=true` run)."""
    evaluation = evaluation or Evaluation()
    algo = algorithm_of(config)
    model, data, run = config.get("model") or {}, config.get("data") or {}, config.get("run") or {}
    base = str(model.get("path") or "")
    base_card = base_card or {}
    hub_base = base if looks_like_hub_id(base) else None
    datasets = _unique(str(d) for d in (data.get("path"), data.get("eval_data")) if d and d != "env")

    meta = {}
    if hub_base:
        meta["base_model"] = hub_base
    meta["library_name"] = "peft" if adapter else "transformers"
    if base_card.get("license"):
        meta["license"] = base_card["license"]
    if datasets:
        meta["datasets"] = list(datasets)
    meta["tags"] = list(_unique(["tether", *(algo.tags if algo else ()), *(("lora", "peft") if adapter else ())]))
    meta["pipeline_tag"] = algo.pipeline_tag if algo else "text-generation"

    name = run.get("name") or "model"
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", "",
             f"# {name}", ""]
    what = "A LoRA adapter" if adapter else ("A reward model" if algo and algo.pipeline_tag != "text-generation"
                                             else "A model")
    if hub_base:
        origin = f"[{base}](https://huggingface.co/{base})"
    elif base:
        origin = f"`{base}` (a local model)"
        if base_card.get("base_model"):
            origin += f", itself trained from [{base_card['base_model']}](https://huggingface.co/{base_card['base_model']})"
    else:
        origin = None  # no config.yaml to say where it started
    lines += [f"{what} trained{' from ' + origin if origin else ''} with tether"
              f"{' (' + algo.name + ')' if algo else ''}, step {step}."]
    if adapter:
        lines += ["", "The folder holds the adapter alone; the base model is loaded under it."]
    lines += [""]
    lines += _usage(folder, algo, adapter)
    lines += _method(algo)
    lines += _data(data, algo, rft_data, (config.get("environment") or {}).get("env"))
    lines += _evaluation(evaluation, step)
    lines += _reproduce(config, algo, trackers)
    lines += _versions(versions or {})
    lines += _citations(algo)
    return "\n".join(lines).rstrip() + "\n"


def _usage(folder: str, algo: Optional[Algorithm], adapter: bool) -> list[str]:
    out = ["## Use", ""]
    if algo and algo.command == "prm":
        out += ["As a process reward (each step scored at its separator; docs/prm.md):", "", "```bash",
                f"tether grpo model=<policy> data=prompts.jsonl reward_funcs=prm:{folder}?aggregate=min", "```"]
    elif algo and algo.pipeline_tag == "text-classification":
        out += ["As a reward (a scalar head on the causal LM, read at the last token; `scalar_head.*`):", "",
                "```bash", f"tether grpo model=<policy> data=prompts.jsonl reward_funcs=rm:{folder}", "```", "",
                "```python", "from tether.models.heads import ScalarHeadModel", "",
                f'rm = ScalarHeadModel.from_pretrained("{folder}")', "```"]
    elif adapter:
        out += ["```python", "from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer",
                "", f'model = AutoPeftModelForCausalLM.from_pretrained("{folder}")  # or the hub id it was uploaded to',
                f'tokenizer = AutoTokenizer.from_pretrained("{folder}")', "```"]
    else:
        out += ["```python", "from transformers import pipeline", "",
                f'generator = pipeline("text-generation", model="{folder}")  # or the hub id it was uploaded to',
                'print(generator("Hello", max_new_tokens=64)[0]["generated_text"])', "```"]
    return out + [""]


def _method(algo: Optional[Algorithm]) -> list[str]:
    if algo is None:
        return []
    first = PAPERS[algo.papers[0]] if algo.papers else None
    out = ["## Method", ""]
    text = f"Trained with **{algo.name}** (`tether {algo.command}`)"
    if first:
        text += f"; paper: [{first.title}]({first.link}) ({first.short}"
        text += f", arXiv:{first.arxiv})." if first.arxiv else ")."
    out.append(text)
    for key in algo.papers[1:]:
        p = PAPERS[key]
        out.append(f"- also: [{p.title}]({p.link}) ({p.short}{', arXiv:' + p.arxiv if p.arxiv else ''})")
    return out + [""]


def _data(data: dict, algo: Optional[Algorithm], rft_data: Optional[str], env: Optional[str]) -> list[str]:
    if not data.get("path"):
        return []
    online = algo is not None and algo.command in ("grpo", "rloo", "remax", "ppo", "odpo", "bon")
    episodes = f"episodes of the `{env}` environment"  # data=env: the environment's own prompts
    out = ["## Data", "", f"- training {'prompts' if online else 'data'}: "
           + (episodes if data["path"] == "env" else f"`{data['path']}`")
           + (f" (split `{data['split']}`)" if data.get("split") not in (None, "train") else "")]
    if rft_data:
        out.append(f"- fine-tuned on the best of n samples per prompt: `{rft_data}`")
    if data.get("eval_data"):
        out.append("- held-out: " + (episodes if data["eval_data"] == "env" else f"`{data['eval_data']}`"))
    elif data.get("eval_fraction"):
        out.append(f"- held-out: {data['eval_fraction']:g} of the training rows, split off by seed")
    return out + [""]


def _value(v) -> str:
    return "null" if v is None else json.dumps(v)


def _evaluation(ev: Evaluation, step: int) -> list[str]:
    out = ["## Evaluation", ""]
    if ev.metrics:
        where = (f"The run's final held-out evaluation (summary.json), at step {ev.step}:" if ev.final else
                 f"Held-out metrics of this checkpoint, at step {step}:" if ev.step == step else
                 f"Held-out metrics at step {ev.step}, the last eval point at or before step {step}:")
        out += [where, "", "| metric | value |", "|---|---|"]
        out += [f"| {k} | {_value(v)} |" for k, v in ev.metrics.items()]
    else:
        out.append(f"No held-out evaluation at or before step {step} (`data.eval_data` or "
                   f"`data.eval_fraction`, with `run.eval_every`).")
    if ev.run_final and ev.run_final.get("metrics"):
        out += ["", f"The run's final held-out evaluation (summary.json), at step {ev.run_final['step']}: "
                + ", ".join(f"`{k}` {_value(v)}" for k, v in ev.run_final["metrics"].items()) + "."]
    best = ev.best or {}
    ended = ev.final or ev.run_final is not None
    if best.get("step") is not None:
        out += ["", f"Best `{best['metric']}` ({best.get('mode')}) {'of the run' if ended else 'so far'}: "
                f"{_value(best['value'])} at step "
                f"{best['step']} (`run.keep_best`; that model is `checkpoints/best`)."]
    if ev.train:
        out += ["", f"Last logged training numbers, step {ev.train_step}: "
                + ", ".join(f"`{k}` {_value(v)}" for k, v in ev.train.items()) + "."]
    return out + [""]


def _reproduce(config: dict, algo: Optional[Algorithm], trackers: Optional[dict]) -> list[str]:
    command = algo.command if algo else "<command>"
    out = ["## Training", ""]
    if trackers:
        out += ["Curves: " + ", ".join(f"[{name}]({link})" for name, link in trackers.items()) + ".", ""]
    if not config:  # a run directory without config.yaml: nothing to reproduce it from
        return out if trackers else []
    out += ["Reproduce with the resolved config below saved as `config.yaml` (the run directory's own):", "",
            "```bash", f"tether {command} --config config.yaml", "```", "",
            "<details><summary>Resolved config (config.yaml)</summary>", "", "```yaml",
            yaml.safe_dump(config, sort_keys=False, allow_unicode=True).rstrip(), "```", "", "</details>", ""]
    return out


def _versions(versions: dict) -> list[str]:
    if not versions:
        return []
    return ["## Framework versions", ""] + [f"- {k}: {v}" for k, v in versions.items()] + [""]


def _citations(algo: Optional[Algorithm]) -> list[str]:
    if not algo or not algo.papers:
        return []
    out = ["## Citations", ""]
    for key in algo.papers:
        out += ["```bibtex", PAPERS[key].bibtex(), "```", ""]
    return out


# -- PPO's value model --------------------------------------------------------------------------------

VALUE_TAGS = ("value-model", "critic")


def value_origin(config: dict) -> str:
    """Where PPO's critic started (critic.load_value_model): `ppo.value_model` when it names a model,
    the policy's `model.path` for 'policy', else ('') the first `rm:` reward model, else the policy's."""
    chosen = str((config.get("ppo") or {}).get("value_model") or "")
    policy = str((config.get("model") or {}).get("path") or "")
    if chosen == "policy":
        return policy
    if chosen:
        return chosen
    for spec in (config.get("reward") or {}).get("reward_funcs") or ():
        if isinstance(spec, str) and spec.startswith("rm:"):
            return spec[3:].partition("?")[0].split(",")[0].strip()
    return policy


def value_model_card(config: dict, *, step: int, folder: str, trackers: Optional[dict] = None,
                     versions: Optional[dict] = None, base_card: Optional[dict] = None) -> str:
    """The README.md of a PPO checkpoint's `value/` folder: the critic of the policy in the parent
    folder, a scalar head on a causal LM body read at every token (V(s_t)), trained beside that policy
    with PPO's clipped value loss. config: the run's resolved config; folder: the value folder's path;
    base_card: the card metadata of the model it started from."""
    algo = algorithm_of(config)
    origin = value_origin(config)
    base_card = base_card or {}
    hub_base = origin if looks_like_hub_id(origin) else None
    data = config.get("data") or {}
    datasets = _unique(str(d) for d in (data.get("path"), data.get("eval_data")) if d and d != "env")
    meta = {}
    if hub_base:
        meta["base_model"] = hub_base
    meta["library_name"] = "transformers"
    if base_card.get("license"):
        meta["license"] = base_card["license"]
    if datasets:
        meta["datasets"] = list(datasets)
    meta["tags"] = list(_unique(["tether", *(algo.tags[:1] if algo else ()), *VALUE_TAGS, *RL_TAGS]))
    meta["pipeline_tag"] = "text-classification"

    name = (config.get("run") or {}).get("name") or "model"
    parent = str(Path(folder).parent)
    start = (f"[{origin}](https://huggingface.co/{origin})" if hub_base else f"`{origin}`") if origin else None
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", "",
             f"# {name} (value model)", "",
             f"The value model (critic) of the policy in the parent folder (`{parent}`), trained beside it "
             f"with tether{' (' + algo.name + ')' if algo else ''}, step {step}"
             + (f"; it started from {start}." if start else "."), "",
             "A scalar head on a causal LM body (`scalar_head.*`, kind `value`), read at every token: "
             "V(s_t), the return expected from that position, which PPO's advantages (GAE) are taken "
             "against; it is fitted with the clipped value loss. It is not a reward model: it scores "
             "the policy's own continuations, and a resume of the run loads it.", "",
             "## Use", "", "```python", "from tether.models.heads import ScalarHeadModel", "",
             f'value = ScalarHeadModel.from_pretrained("{folder}")', "```", "",
             f"The run's evaluation is on the policy's card (`{parent}/{CARD}`).", ""]
    lines += _method(algo)
    lines += _data(data, algo, None, (config.get("environment") or {}).get("env"))
    lines += _reproduce(config, algo, trackers)
    lines += _versions(versions or {})
    lines += _citations(algo)
    return "\n".join(lines).rstrip() + "\n"


# -- from the run directory --------------------------------------------------------------------------

def package_versions(adapter: bool = False) -> dict:
    """{package: installed version} of the frameworks a card names (peft too for an adapter)."""
    out = {}
    for name in VERSIONS + (("peft",) if adapter else ()):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def card_metadata(text: str) -> dict:
    """The YAML front matter of a card's text ({} when it has none or it does not parse)."""
    if not text.startswith("---"):
        return {}
    parts = text.split("\n---", 1)
    try:
        meta = yaml.safe_load(parts[0][3:]) if len(parts) == 2 else None
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}


def base_model_card(path: str) -> dict:
    """The metadata of the base model's card: a local folder's README.md, or a hub model's README.md
    when the Hugging Face cache holds it (never a download)."""
    if not path:
        return {}
    local = Path(path).expanduser()
    readme = local / CARD if local.is_dir() else None
    if readme is None and looks_like_hub_id(path):
        try:
            from huggingface_hub import try_to_load_from_cache
            cached = try_to_load_from_cache(path, CARD)
        except Exception:  # noqa: BLE001 - no hub client, or a cache it cannot read: no license known
            cached = None
        readme = Path(cached) if isinstance(cached, str) else None
    if readme is None or not readme.is_file():
        return {}
    return card_metadata(readme.read_text(encoding="utf-8", errors="replace"))


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _rows(path: Path, up_to: int) -> list[dict]:
    """metrics.jsonl's rows at or before step `up_to` (a line cut by a kill ends the file)."""
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return rows
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            break
        if isinstance(row, dict) and row.get("step", 0) <= up_to:
            rows.append(row)
    return rows


def _eval_keys(row: dict) -> dict:
    # eval/seconds is how long the evaluation took, not a number about the model
    return {k: v for k, v in row.items() if k.startswith("eval/") and k != "eval/seconds"}


def run_evaluation(run_path: Path, step: int, best: Optional[dict] = None,
                   summary: Optional[dict] = None, ended: Optional[dict] = None) -> Evaluation:
    """A card's numbers from the run directory: with `summary` (the final card) its final eval and
    `best`; else the last eval point at or before `step` in metrics.jsonl, and `best` as given (the
    race's state the checkpoint carries). `ended`: the summary.json of a run that has ended, for
    the card of an earlier checkpoint (keep_best's `best`): its final eval and `best` beside the
    checkpoint's own numbers."""
    rows = _rows(Path(run_path) / "metrics.jsonl", step)
    ev = Evaluation(best=best)
    for row in reversed(rows):
        train = {k: row[k] for k in ("loss", "reward") if k in row}
        if train:
            ev.train, ev.train_step = train, row["step"]
            break
    if summary is not None:
        ev.metrics, ev.step, ev.final = _eval_keys(summary), summary.get("steps", step), True
        ev.best = summary.get("best") or best
        return ev
    if ended is not None:
        ev.run_final = {"step": ended.get("steps"), "metrics": _eval_keys(ended)}
        ev.best = ended.get("best") or best
    points = [r for r in rows if _eval_keys(r)]
    if points:
        ev.step = points[-1]["step"]
        for r in points:  # every row of that eval point (a loop may log its eval in more than one)
            if r["step"] == ev.step:
                ev.metrics.update(_eval_keys(r))
    return ev


def write_model_card(directory, run_path, *, step: int, best: Optional[dict] = None,
                     summary: Optional[dict] = None, ended: Optional[dict] = None,
                     folder: Optional[str] = None) -> Path:
    """Write `<directory>/README.md`: the card of the model in `directory` (a checkpoint being
    written, or the final one), trained by the run at `run_path` up to `step`. `best`: keep_best's
    race as the checkpoint carries it; `summary`: the final card's summary.json; `ended`: the
    summary.json of the ended run, for an earlier checkpoint (`write_best_card`); `folder`: the
    path the usage snippet names (default `directory`). A PPO checkpoint's critic (`value/`) gets
    its card too (`value_model_card`)."""
    directory, run_path = Path(directory), Path(run_path)
    config = _read_yaml(run_path / "config.yaml")
    rft_data = None
    parent = _read_yaml(run_path.parent / "config.yaml") if run_path.name == "rft" else {}
    if "bon" in parent:  # `tether bon rft=true`: this run is the SFT on best-of-n's kept samples
        rft_data, config = (config.get("data") or {}).get("path"), parent
    adapter = (directory / "adapter_config.json").exists()
    text = model_card(config, step=step, folder=folder or str(directory),
                      evaluation=run_evaluation(run_path, step, best, summary, ended), adapter=adapter,
                      trackers=_read_json(run_path / TRACKERS), versions=package_versions(adapter),
                      base_card=base_model_card(str((config.get("model") or {}).get("path") or "")),
                      rft_data=rft_data)
    algo = algorithm_of(config)
    value = directory / VALUE
    if algo is not None and algo.command == "ppo" and (value / "scalar_head.json").is_file():
        origin = value_origin(config)
        folder_value = str(Path(folder) / VALUE) if folder else str(value)
        _write(value, value_model_card(config, step=step, folder=folder_value,
                                       trackers=_read_json(run_path / TRACKERS), versions=package_versions(),
                                       base_card=base_model_card(origin)))
    return _write(directory, text)


def write_best_card(run_path, summary: dict) -> Optional[Path]:
    """Rewrite `checkpoints/best/README.md` once the run has ended: the weights' own step (best.json)
    and its eval point as this checkpoint's numbers, the run's final eval and `best` (summary.json)
    beside them, and what the run directory holds now (tracker links). None without that folder."""
    best = Path(run_path) / "checkpoints" / "best"
    written = _read_json(best / "best.json")  # it describes the weights, whatever the race says
    if written.get("step") is None:
        return None
    return write_model_card(best, run_path, step=int(written["step"]), ended=summary)


def _write(directory: Path, text: str) -> Path:
    out = directory / CARD
    tmp = out.with_name(CARD + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out
