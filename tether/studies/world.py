"""The preference world's builders that train and sample: the SFT policy, its labelled pairs and
the proxy reward model (docs/rlhf.md).

They run trainers and the sampler, so they sit here in studies, above both; the world itself
(prompts, the human writer, gold reward, Bradley–Terry labels) is tether.tasks.preference_world,
which imports nothing above the task layer.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from tether.tasks.preference_world import PreferenceWorld, label_pairs


# -- the SFT policy and its preference data ----------------------------------------------------------

def build_sft_policy(out_dir, seed: int = 0, world: PreferenceWorld | None = None,
                     n_rows: int = 20000, steps: int = 600, batch_size: int = 64, lr: float = 3e-3,
                     hidden_size: int = 64, num_layers: int = 2, overwrite: bool = False) -> Path:
    """Train the tiny SFT policy from scratch on the writer's responses; returns `out_dir/policy`
    (HF model + tokenizer). Reused as is when it exists and `overwrite` is False."""
    import torch
    from transformers import AutoModelForCausalLM

    from tether.models.tiny import tiny_config
    from tether.trainers.sft import SFTConfig, train_sft

    world = world or PreferenceWorld()
    out_dir = Path(out_dir)
    final = out_dir / "policy"
    if (final / "config.json").exists() and not overwrite:
        return final
    t0 = time.time()
    tok = world.tokenizer()
    cfg = tiny_config(len(tok), hidden_size=hidden_size, num_layers=num_layers, num_heads=4,
                      num_kv_heads=2, intermediate_size=3 * hidden_size, max_position_embeddings=64,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    for k in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, k, getattr(tok, k))
    init = out_dir / "init"
    model.save_pretrained(init)
    tok.save_pretrained(init)
    data = out_dir / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in world.sft_rows(n_rows, seed=seed)))
    summary = train_sft(SFTConfig(
        model=str(init), data=str(data), name="sft", runs_dir=str(out_dir), max_length=48,
        batch_size=batch_size, max_steps=steps, lr=lr, warmup_steps=30, weight_decay=0.0,
        log_every=50, num_samples=4, sample_max_new_tokens=world.max_new_tokens, seed=seed,
        progress=False, overwrite=True))  # only reached when the world is (re)built
    tmp = final.with_name("policy.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(summary["checkpoint"], tmp, ignore=shutil.ignore_patterns("trainer_state.pt"))
    (tmp / "world.json").write_text(json.dumps({
        "world": {k: getattr(world, k) for k in world.__dataclass_fields__},
        "sft_loss": summary.get("final_loss"), "build_seconds": round(time.time() - t0, 2)}) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def sample_completions(world: PreferenceWorld, policy, tokenizer, prompts, n: int = 1, seed: int = 0,
                       temperature: float = 1.0, batch: int = 2048) -> list[str]:
    """n sampled completions per prompt (prompt-major), decoded to words."""
    from tether.rollout import sample

    ro = sample(policy, tokenizer, list(prompts), n=n, seed=seed, temperature=temperature,
                max_new_tokens=world.max_new_tokens, max_batch_size=batch)
    return ro.texts


def make_preference_data(world: PreferenceWorld, policy_path, n_pairs: int = 4000, seed: int = 0,
                         out_path=None, split: str = "train") -> list[dict]:
    """Sample two completions per prompt from the SFT policy and label them by BT on gold.
    Written as preference jsonl to `out_path` when given; returns the rows."""
    from tether.models import load_model, load_tokenizer

    tok = load_tokenizer(str(policy_path))
    model = load_model(str(policy_path), dtype="fp32", device="cpu")
    # The policy sometimes stops at once; preference data cannot hold an empty response, so such
    # pairs are dropped and a few more prompts sampled (seeded: the same call gives the same rows).
    prompts, a, b, round_ = [], [], [], 0
    while len(prompts) < n_pairs:
        need = n_pairs - len(prompts)
        ps = world.prompts(need + need // 8 + 8, split=split, seed=seed * 1000 + round_)
        texts = sample_completions(world, model, tok, ps, n=2, seed=seed * 1000 + round_)
        for p, x, y in zip(ps, texts[0::2], texts[1::2]):
            if x.strip() and y.strip() and len(prompts) < n_pairs:
                prompts.append(p), a.append(x), b.append(y)
        round_ += 1
    rows = label_pairs(world, prompts, a, b, seed=seed + 1)
    if out_path is not None:
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def build_proxy_rm(out_dir, policy_path, world: PreferenceWorld | None = None, n_pairs: int = 4000,
                   seed: int = 0, epochs: float = 2.0, lr: float = 1e-3, batch_size: int = 32,
                   name: str = "rm", **rm_overrides) -> dict:
    """`tether rm` on n_pairs of the world's pairs (out_dir/pairs-<seed>.jsonl, 10% held out).
    Returns the rm summary: `checkpoint` (the proxy), eval/accuracy next to eval/bayes_accuracy."""
    from tether.trainers.rm import RMConfig, train_rm

    world = world or PreferenceWorld()
    out_dir = Path(out_dir)
    data = out_dir / f"pairs-{seed}.jsonl"
    make_preference_data(world, policy_path, n_pairs, seed=seed, out_path=data)
    return train_rm(RMConfig(**{"model": str(policy_path), "data": str(data), "runs_dir": str(out_dir),
                                "name": name, "epochs": epochs, "lr": lr, "batch_size": batch_size,
                                "eval_fraction": 0.1, "seed": seed, "device": "cpu", "progress": False,
                                "overwrite": True, **rm_overrides}))
