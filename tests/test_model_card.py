"""Model cards (tether/model_card.py): every checkpoint and the final model carry a README.md with
the Hub's metadata block, the algorithm's paper, the data, the reproducing command, the resolved
config and the eval numbers of that step (the final one: summary.json's)."""

import json
import re
from pathlib import Path

import pytest
import yaml

from extras import needs
from tether.cli import COMMANDS, load_command
from tether.config import to_dict
from tether.model_card import (PAPERS, Evaluation, algorithm_of, card_metadata, model_card, write_best_card,
                               write_model_card)
from tether.models import make_tiny_model
from tether.trainers.sft import SFTConfig, train_sft

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
TETHER = Path(__file__).resolve().parent.parent / "tether"


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("\n---\n", 1)[0][4:])


def table_value(text: str, metric: str) -> float:
    """The value in the card's `| metric | value |` row of `metric`."""
    rows = re.findall(rf"^\| {re.escape(metric)} \| (.+) \|$", text, flags=re.M)
    assert len(rows) == 1, f"{metric}: {rows}"
    return float(rows[0])


def yaml_block(text: str) -> dict:
    return yaml.safe_load(re.search(r"```yaml\n(.*?)\n```", text, flags=re.S).group(1))


def hub_card(path: Path):
    """huggingface_hub's own reading of the card (it comes with transformers)."""
    from huggingface_hub import ModelCard
    return ModelCard.load(path)


# -- the pure function --------------------------------------------------------------------------------

GRPO_CONFIG = {
    "model": {"path": "HuggingFaceTB/SmolLM2-135M-Instruct", "lora_r": 0},
    "data": {"path": "openai/gsm8k", "split": "train", "eval_data": "env", "eval_fraction": 0.0},
    "run": {"name": "gsm8k-grpo", "seed": 3},
    "grpo": {"advantage": "grpo", "scale_rewards": "group", "clip_low": 0.2, "clip_high": 0.28,
             "importance_level": "token", "dynamic_sampling": True, "overlong_buffer": 0},
}


def test_card_of_given_numbers_names_model_algorithm_papers_data_command_and_numbers():
    ev = Evaluation(metrics={"eval/greedy/pass@1": 0.4375, "eval/reward": 0.5}, step=40,
                    best={"metric": "eval/greedy/pass@1", "mode": "max", "step": 30, "value": 0.5},
                    train={"reward": 0.61}, train_step=50)
    text = model_card(GRPO_CONFIG, step=50, folder="runs/gsm8k-grpo/checkpoints/step-50", evaluation=ev,
                      trackers={"wandb": "https://wandb.ai/me/p/runs/abc"},
                      versions={"tether": "0.1.0", "torch": "2.13.0"}, base_card={"license": "apache-2.0"})
    meta = front_matter(text)
    assert meta == {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "library_name": "transformers",
                    "license": "apache-2.0", "datasets": ["openai/gsm8k"],  # data=env is no dataset
                    "tags": ["tether", "grpo", "dapo", "reinforcement-learning"],
                    "pipeline_tag": "text-generation"}
    body = text.split("\n---\n", 1)[1]
    assert "GRPO with DAPO clip-higher, DAPO dynamic sampling" in body
    # GRPO's paper first (its BibTeX too), then DAPO's
    assert body.index("arXiv:2402.03300") < body.index("arXiv:2503.14476")
    assert "@article{shao2024deepseekmath," in body and "@article{yu2025dapo," in body
    assert "tether grpo --config config.yaml" in body
    assert yaml_block(text) == GRPO_CONFIG
    assert table_value(text, "eval/greedy/pass@1") == 0.4375 and table_value(text, "eval/reward") == 0.5
    assert "at step 40, the last eval point at or before step 50" in body
    assert "Best `eval/greedy/pass@1` (max) so far: 0.5 at step 30" in body
    assert "`reward` 0.61" in body
    assert "[wandb](https://wandb.ai/me/p/runs/abc)" in body
    assert "- torch: 2.13.0" in body


def test_a_local_base_model_is_named_in_the_body_not_as_base_model():
    config = {"model": {"path": "/data/models/my-sft"}, "data": {"path": "pairs.jsonl"}, "run": {"name": "x"},
              "preference": {"method": "dpo", "loss": "sigmoid", "label_smoothing": 0.1}}
    text = model_card(config, step=3, folder="f", base_card={"base_model": "Qwen/Qwen2.5-0.5B"})
    meta = front_matter(text)
    assert "base_model" not in meta and "license" not in meta
    assert "`/data/models/my-sft` (a local model), itself trained from [Qwen/Qwen2.5-0.5B]" in text
    assert meta["tags"] == ["tether", "cdpo", "dpo", "preference-optimization"]
    assert "No held-out evaluation at or before step 3" in text
    assert "https://ericmitchell.ai/cdpo.pdf" in text and "arXiv:2305.18290" in text


def test_reward_model_and_adapter_cards():
    rm = model_card({"model": {"path": "org/base"}, "data": {"path": "p.jsonl"}, "run": {"name": "rm"},
                     "rm": {}}, step=1, folder="runs/rm/checkpoints/step-1")
    assert front_matter(rm)["pipeline_tag"] == "text-classification"
    assert "reward_funcs=rm:runs/rm/checkpoints/step-1" in rm and "arXiv:2203.02155" in rm
    lora = model_card({"model": {"path": "org/base", "lora_r": 8}, "data": {"path": "d.jsonl"},
                       "run": {"name": "l"}, "sft": {}}, step=1, folder="f", adapter=True)
    meta = front_matter(lora)
    assert (meta["library_name"], meta["base_model"]) == ("peft", "org/base")
    assert {"lora", "peft", "sft"} <= set(meta["tags"]) and "AutoPeftModelForCausalLM" in lora


@pytest.mark.parametrize("section, expected", [
    ({"grpo": {"advantage": "grpo", "scale_rewards": "none"}}, ("Dr. GRPO", "grpo", "2503.20783")),
    ({"grpo": {"advantage": "rloo"}}, ("RLOO", "rloo", "2402.14740")),
    ({"grpo": {"advantage": "remax"}}, ("ReMax", "remax", "2310.10505")),
    ({"grpo": {"advantage": "reinforce_pp"}}, ("REINFORCE++", "grpo", "2501.03262")),
    ({"grpo": {"advantage": "grpo", "importance_level": "sequence"}}, ("GRPO with GSPO sequence ratios", "grpo", "2402.03300")),
    ({"ppo": {}}, ("PPO (RLHF)", "ppo", "1707.06347")),
    ({"preference": {"method": "dpo", "loss": "hinge"}}, ("DPO with SLiC-HF's hinge loss", "dpo", "2305.10425")),
    ({"preference": {"method": "dpo", "loss": "ipo"}}, ("IPO", "dpo", "2310.12036")),
    ({"preference": {"method": "dpo", "loss": "robust", "label_smoothing": 0.1}}, ("rDPO (robust DPO)", "dpo", "2403.00409")),
    ({"preference": {"method": "dpo", "loss": "sigmoid", "rpo_alpha": 1.0}}, ("DPO with RPO's NLL term", "dpo", "2305.18290")),
    ({"preference": {"method": "kto"}}, ("KTO", "kto", "2402.01306")),
    ({"preference": {"method": "simpo"}}, ("SimPO", "simpo", "2405.14734")),
    ({"preference": {"method": "orpo"}}, ("ORPO", "orpo", "2403.07691")),
    ({"preference": {"method": "dpo"}, "odpo": {"reference": "fixed"}}, ("Online DPO", "odpo", "2402.04792")),
    ({"prm": {}}, ("Process reward model", "prm", "2305.20050")),
    ({"bon": {"rft": True}}, ("Best-of-n rejection-sampling fine-tuning", "bon", "2009.01325")),
])
def test_the_algorithm_and_its_paper_come_from_the_config_sections(section, expected):
    algo = algorithm_of({"model": {}, "run": {}, **section})
    assert (algo.name, algo.command, PAPERS[algo.papers[0]].arxiv) == expected


def test_every_training_command_default_config_reads_as_that_command():
    """config.yaml carries no command name: the card reads it off the sections. Every trainer's
    default config must read as its own command (a preset of grpo as its preset)."""
    trainers = {"sft", "grpo", "rloo", "remax", "ppo", "dpo", "odpo", "kto", "simpo", "orpo", "rm", "prm", "bon"}
    assert trainers <= set(COMMANDS)
    for name in sorted(trainers):
        cls, _ = load_command(name)
        cfg = cls(reward_funcs=["self"]) if name == "odpo" else cls()  # odpo needs a reward to exist
        algo = algorithm_of(to_dict(cfg))
        assert algo is not None and algo.command == name, (name, algo)
    assert algorithm_of({"out": "x", "family": "llama"}) is None  # init-model's config: no trainer's


def test_every_paper_is_cited_as_the_source_cites_it():
    """The card's short citations are the objectives' and trainers' own (Rafailov et al. 2023)."""
    source = "\n".join(p.read_text() for d in ("objectives", "trainers") for p in (TETHER / d).rglob("*.py"))
    for paper in PAPERS.values():
        assert paper.short in source, paper.short
        assert paper.arxiv is None or re.fullmatch(r"\d{4}\.\d{5}", paper.arxiv), paper.arxiv


def test_an_rft_run_is_carded_as_best_of_n_with_bon_s_config(tmp_path):
    """`tether bon rft=true` trains <run>/rft with SFT on the kept samples: its card is bon's."""
    bon = {"model": {"path": "org/policy"}, "data": {"path": "prompts.jsonl"}, "run": {"name": "b"},
           "bon": {"n": 8, "rft": True}}
    (tmp_path / "b" / "rft" / "ck").mkdir(parents=True)
    (tmp_path / "b" / "config.yaml").write_text(yaml.safe_dump(bon))
    (tmp_path / "b" / "rft" / "config.yaml").write_text(yaml.safe_dump(
        {"model": {"path": "org/policy"}, "data": {"path": str(tmp_path / "b" / "rft.jsonl")},
         "run": {"name": "rft"}, "sft": {}}))
    text = write_model_card(tmp_path / "b" / "rft" / "ck", tmp_path / "b" / "rft", step=5).read_text()
    assert "tether bon --config config.yaml" in text and yaml_block(text) == bon
    assert f"fine-tuned on the best of n samples per prompt: `{tmp_path / 'b' / 'rft.jsonl'}`" in text
    assert front_matter(text)["datasets"] == ["prompts.jsonl"]


# -- real runs ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model in a folder named like a hub id (org/name), and copy-the-digits SFT data."""
    root = tmp_path_factory.mktemp("cards")
    make_tiny_model(root / "tiny-org" / "tiny-lm", **TINY)
    (root / "train.jsonl").write_text("".join(
        json.dumps({"prompt": f"Copy {i:03d}:", "completion": f" {i:03d}"}) + "\n" for i in range(64)))
    return root


def _sft(root, **kw):
    base = dict(model="tiny-org/tiny-lm", data="train.jsonl", runs_dir="runs", device="cpu", progress=False,
                batch_size=8, lr=3e-3, log_every=1, num_samples=0, max_steps=4, warmup_steps=0)
    return train_sft(SFTConfig(**{**base, **kw}))


def test_checkpoints_and_the_final_model_carry_their_cards(world, monkeypatch):
    monkeypatch.chdir(world)  # model=tiny-org/tiny-lm: a local folder that reads as a hub id
    summary = _sft(world, name="carded", eval_fraction=0.25, eval_every=2, save_every=2, keep_last=0,
                   keep_best="eval/loss")
    run = world / "runs" / "carded"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    config = yaml.safe_load((run / "config.yaml").read_text())
    final = Path(summary["checkpoint"])
    assert final.name == "step-4"
    for folder in ("step-2", "step-4", "best"):
        text = (run / "checkpoints" / folder / "README.md").read_text()
        meta = front_matter(text)
        assert meta["base_model"] == "tiny-org/tiny-lm" and meta["library_name"] == "transformers"
        assert "sft" in meta["tags"] and "tether" in meta["tags"] and meta["datasets"] == ["train.jsonl"]
        assert "arXiv:2203.02155" in text and "tether sft --config config.yaml" in text
        assert yaml_block(text) == config
        assert hub_card(run / "checkpoints" / folder / "README.md").data.base_model == "tiny-org/tiny-lm"

    # step 2's card: step 2's eval point, as metrics.jsonl has it
    step2 = (run / "checkpoints" / "step-2" / "README.md").read_text()
    logged = next(r["eval/loss"] for r in rows if r["step"] == 2 and "eval/loss" in r)
    assert table_value(step2, "eval/loss") == logged
    assert f"Best `eval/loss` (min) so far: {json.dumps(logged)} at step 2" in step2

    # the final card: summary.json's final eval and best
    written = json.loads((run / "summary.json").read_text())
    text = (final / "README.md").read_text()
    assert "The run's final held-out evaluation (summary.json), at step 4" in text
    for key in ("eval/loss", "eval/perplexity"):
        assert table_value(text, key) == written[key]
    best = written["best"]
    assert f"Best `eval/loss` (min) of the run: {json.dumps(best['value'])} at step {best['step']}" in text

    # a tracker's link, when the run has one (trackers.json), is on the card
    (run / "trackers.json").write_text(json.dumps({"tensorboard": "runs/carded/tensorboard"}))
    write_model_card(final, run, step=4, summary=written)
    assert "[tensorboard](runs/carded/tensorboard)" in (final / "README.md").read_text()


@needs("peft")
def test_a_lora_adapter_folder_is_carded_for_peft(world, monkeypatch):
    monkeypatch.chdir(world)
    summary = _sft(world, name="carded-lora", lora_r=4, lora_alpha=8, max_steps=2)
    card = Path(summary["checkpoint"]) / "README.md"
    assert (card.parent / "adapter_config.json").exists()
    meta = front_matter(card.read_text())
    assert (meta["library_name"], meta["base_model"]) == ("peft", "tiny-org/tiny-lm")
    assert {"lora", "peft", "sft"} <= set(meta["tags"])
    assert "- peft: " in card.read_text()
    data = hub_card(card).data
    assert (data.library_name, data.base_model) == ("peft", "tiny-org/tiny-lm")
    assert card_metadata(card.read_text()) == meta


def test_the_best_checkpoint_s_card_is_rewritten_when_the_run_ends(world, monkeypatch):
    """checkpoints/best's card, after the run: its own step's eval point as this checkpoint's numbers
    (metrics.jsonl at best.json's step), the run's final eval and best (summary.json) beside them.
    keep_best_mode=max on eval/loss keeps an early step, so the best is not the final model."""
    monkeypatch.chdir(world)
    written = _sft(world, name="carded-best", eval_fraction=0.25, eval_every=1, max_steps=3, keep_last=0,
                   keep_best="eval/loss", keep_best_mode="max")
    run, best = world / "runs" / "carded-best", written["best"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    card = run / "checkpoints" / "best" / "README.md"
    text = card.read_text()
    assert json.loads((card.parent / "best.json").read_text())["step"] == best["step"]
    logged = next(r["eval/loss"] for r in rows if r["step"] == best["step"] and "eval/loss" in r)
    assert logged == best["value"]
    assert f"with tether (SFT), step {best['step']}." in text
    assert f"Held-out metrics of this checkpoint, at step {best['step']}:" in text
    assert table_value(text, "eval/loss") == logged
    assert f"The run's final held-out evaluation (summary.json), at step 3: `eval/loss` " \
           f"{json.dumps(written['eval/loss'])}" in text
    assert f"Best `eval/loss` (max) of the run: {json.dumps(logged)} at step {best['step']}" in text
    assert "so far" not in text
    assert hub_card(card).data.base_model == "tiny-org/tiny-lm"

    # a tracker's link written after the best checkpoint reaches its card when it is rewritten
    (run / "trackers.json").write_text(json.dumps({"tensorboard": "runs/carded-best/tensorboard"}))
    assert write_best_card(run, json.loads((run / "summary.json").read_text())) == card
    assert "[tensorboard](runs/carded-best/tensorboard)" in card.read_text()
    assert table_value(card.read_text(), "eval/loss") == logged


def test_ppo_s_value_folder_carries_a_value_model_card(world, monkeypatch):
    """A PPO checkpoint's critic (value/) is a scalar-head model with its own card: text-classification,
    PPO's papers, and the policy in the parent folder named."""
    from tether.trainers.ppo.loop import PPOConfig, train_ppo

    monkeypatch.chdir(world)
    (world / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["ab", "cd"] * 4))

    def digits(prompts, completions, **_):
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    summary = train_ppo(PPOConfig(model="tiny-org/tiny-lm", data="prompts.jsonl", name="carded-ppo",
                                  runs_dir="runs", batch_size=4, num_generations=1, max_new_tokens=4,
                                  max_steps=2, ppo_epochs=1, num_minibatches=1, kl_coef=0.0, device="cpu",
                                  progress=False, seed=0, value_model="policy"), reward_funcs=[digits])
    final = Path(summary["checkpoint"])
    card = final / "value" / "README.md"
    text = card.read_text()
    meta = front_matter(text)
    assert meta == card_metadata(text)
    assert meta == {"base_model": "tiny-org/tiny-lm", "library_name": "transformers",
                    "datasets": ["prompts.jsonl"],
                    "tags": ["tether", "ppo", "value-model", "critic", "reinforcement-learning"],
                    "pipeline_tag": "text-classification"}
    assert hub_card(card).data.pipeline_tag == "text-classification"
    assert f"The value model (critic) of the policy in the parent folder (`{final}`)" in text
    assert f"step {summary['steps']}" in text and f'from_pretrained("{final / "value"}")' in text
    assert "arXiv:1707.06347" in text and "arXiv:2203.02155" in text and "@article{schulman2017proximal," in text
    assert "tether ppo --config config.yaml" in text
    assert front_matter((final / "README.md").read_text())["pipeline_tag"] == "text-generation"
