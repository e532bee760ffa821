"""Reward-model training (`tether rm`), LearnedReward and ensemble aggregation."""
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from tether.errors import UserError
from tether.models import load_tokenizer
from tether.models.heads import ScalarHeadModel
from tether.rewards import load_reward
from tether.rewards.learned import LearnedReward, aggregate_scores, encode_scored
from tether.run import seed_everything
from tether.tasks.preference_world import PreferenceWorld, label_pairs
from tether.trainers.core.common import EpochSampler
from tether.trainers.rm import RMConfig, load_pairs, pair_batch, train_rm


def _tiny_world_model(path, world=None, seed=0):
    from transformers import AutoModelForCausalLM

    from tether.models.tiny import tiny_config
    tok = (world or PreferenceWorld()).tokenizer()
    cfg = tiny_config(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, max_position_embeddings=64, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _writer_pairs(path, n, seed=0, margin=None):
    """Pairs of two writer responses per prompt, BT-labelled from gold (no policy needed)."""
    import random
    w, rng = PreferenceWorld(), random.Random(seed)
    prompts = w.prompts(n, "train", seed=seed)
    rows = label_pairs(w, prompts, [w.write(p, rng) for p in prompts], [w.write(p, rng) for p in prompts], seed=seed)
    if margin is not None:
        for r in rows:
            r["margin"] = margin
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_aggregation_hand_checked():
    s = torch.tensor([[1.0, 2.0, 0.0], [3.0, 6.0, 0.0]])
    assert aggregate_scores(s, "mean").tolist() == [2.0, 4.0, 0.0]
    assert aggregate_scores(s, "min").tolist() == [1.0, 2.0, 0.0]
    # population std over the 2 members: [1, 2, 0]
    assert aggregate_scores(s, "mean_minus_std", k=1.0).tolist() == [1.0, 2.0, 0.0]
    assert aggregate_scores(s, "mean_minus_std", k=0.5).tolist() == [1.5, 3.0, 0.0]
    assert aggregate_scores(s[:1], "mean_minus_std", k=3.0).tolist() == [1.0, 2.0, 0.0]  # k=1 member: std 0
    with pytest.raises(UserError):
        aggregate_scores(s, "max")


@pytest.mark.parametrize("margin,center", [(None, 0.0), (2.0, 0.0), (1.5, 0.7)])
def test_first_step_loss_is_bt_with_margin_and_centering(tmp_path, margin, center):
    model = _tiny_world_model(tmp_path / "m")
    data = _writer_pairs(tmp_path / "pairs.jsonl", 64, margin=margin)
    cfg = RMConfig(model=model, data=data, eval_fraction=0.0, runs_dir=str(tmp_path), batch_size=16,
                   max_steps=1, log_every=1, lr=1e-3, seed=5, center_rewards_coefficient=center,
                   device="cpu", progress=False, center=False)
    train_rm(cfg)
    logged = json.loads((tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()[0])
    # Independent recomputation: the same seeded head init, the same first batch.
    seed_everything(5)
    rm = ScalarHeadModel.from_pretrained(model, device="cpu")
    tok = load_tokenizer(model)
    ex, _ = load_pairs(data, tok, 1024)
    batch = [ex[i] for i in EpochSampler(len(ex), 16, 5).next()]
    ids, mask, m = pair_batch(batch, tok.pad_token_id)
    with torch.no_grad():
        r = rm.score(ids, mask)
    rc, rr = r[:16], r[16:]
    want = -F.logsigmoid(rc - rr - m).mean() + center * ((rc + rr) ** 2).mean()
    assert logged["loss"] == pytest.approx(float(want), abs=1e-5)
    if margin:
        assert logged["loss"] > 1.0  # ≈ softplus(margin) with a near-zero fresh head, not log 2


def test_centering_makes_the_mean_training_reward_zero_and_scoring_matches_training(tmp_path):
    model = _tiny_world_model(tmp_path / "m")
    data = _writer_pairs(tmp_path / "pairs.jsonl", 200)
    s = train_rm(RMConfig(model=model, data=data, eval_fraction=0.0, runs_dir=str(tmp_path), batch_size=32,
                          epochs=1, lr=3e-3, device="cpu", progress=False))
    assert s["offset"] != 0.0
    rows = [json.loads(l) for l in open(data)]
    rm = LearnedReward(str(tmp_path / "rm"), device="cpu")  # a run dir resolves to its checkpoint
    prompts = [r["prompt"] for r in rows] * 2
    texts = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    scores = torch.tensor(rm(prompts, texts))
    assert abs(float(scores.mean())) < 1e-4
    # score_ids on the training tokenisation gives the same numbers as the text call
    seqs = [encode_scored(rm.tokenizer, p, t) for p, t in zip(prompts[:5], texts[:5])]
    assert seqs[0][0] == rm.tokenizer.bos_token_id and seqs[0][-1] == rm.tokenizer.eos_token_id
    T = max(map(len, seqs))
    ids = torch.tensor([[0] * (T - len(q)) + q for q in seqs])  # left padding this time
    mask = torch.tensor([[0] * (T - len(q)) + [1] * len(q) for q in seqs])
    torch.testing.assert_close(rm.score_ids(ids, mask), scores[:5], atol=1e-5, rtol=1e-5)


def test_ensemble_via_rm_spec(tmp_path):
    model = _tiny_world_model(tmp_path / "m")
    data = _writer_pairs(tmp_path / "pairs.jsonl", 64)
    for seed in (0, 1):
        train_rm(RMConfig(model=model, data=data, name=f"rm-s{seed}", runs_dir=str(tmp_path), seed=seed,
                          max_steps=3, lr=1e-2, device="cpu", progress=False))
    a, b = str(tmp_path / "rm-s0"), str(tmp_path / "rm-s1")
    prompts, texts = ["write about food and music"] * 3, ["bread song", "the the", "apple"]
    members = torch.tensor([LearnedReward(a, device="cpu")(prompts, texts), LearnedReward(b, device="cpu")(prompts, texts)])
    assert (members[0] - members[1]).abs().max() > 1e-4  # different seeds, different models
    ens = load_reward(f"rm:{a},{b}?aggregate=mean_minus_std&k=2")
    want = members.mean(0) - 2 * members.std(0, correction=0)
    torch.testing.assert_close(torch.tensor(ens(prompts, texts)), want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(torch.tensor(load_reward(f"rm:{a},{b}?aggregate=min")(prompts, texts)), members.min(0).values, atol=1e-5)
    with pytest.raises(UserError):
        load_reward(f"rm:{a}?aggregate=median")
    with pytest.raises(UserError):
        load_reward(f"rm:{tmp_path / 'nothing'}")


def test_resume_is_exact(tmp_path):
    model = _tiny_world_model(tmp_path / "m")
    data = _writer_pairs(tmp_path / "pairs.jsonl", 128)
    cfg = RMConfig(model=model, data=data, runs_dir=str(tmp_path), batch_size=16, max_steps=6, save_every=3,
                   keep_last=5, log_every=1, lr=3e-3, device="cpu", progress=False)
    full = train_rm(cfg)
    run = tmp_path / "rm"
    before = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run / "checkpoints" / "step-6")  # as if killed after the step-3 checkpoint
    resumed = train_rm(RMConfig(**{**cfg.__dict__, "resume": True}))
    after = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("time", "step_time")} for r in rows]
    assert strip(after) == strip(before)
    assert resumed["eval/accuracy"] == full["eval/accuracy"]


def test_bad_input_is_one_line(tmp_path):
    model = _tiny_world_model(tmp_path / "m")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "write about food and music", "chosen": "x", "rejected": "y",
                               "margin": "big"}) + "\n")
    with pytest.raises(UserError, match="margin"):
        train_rm(RMConfig(model=model, data=str(bad), eval_fraction=0.0, runs_dir=str(tmp_path),
                          device="cpu", progress=False))
    with pytest.raises(UserError):
        train_rm(RMConfig(model=model, data="", runs_dir=str(tmp_path)))


def test_rm_learns_the_world_from_scratch(tmp_path):
    """Fast variant: a random-init tiny RM on 1500 writer pairs beats chance clearly."""
    model = _tiny_world_model(tmp_path / "m")
    data = _writer_pairs(tmp_path / "pairs.jsonl", 1500)
    s = train_rm(RMConfig(model=model, data=data, runs_dir=str(tmp_path), batch_size=32, epochs=2,
                          lr=3e-3, device="cpu", progress=False))
    assert s["eval/bayes_accuracy"] > 0.7
    assert s["eval/accuracy"] > 0.6 and s["eval/gold_agreement"] > 0.65


@pytest.mark.slow
def test_proxy_rm_is_near_bayes_optimal_at_the_default_size(tmp_path):
    from tether.studies.world import build_proxy_rm, build_sft_policy
    policy = build_sft_policy(tmp_path / "world")
    s = build_proxy_rm(tmp_path / "world", policy)
    assert s["eval/accuracy"] >= s["eval/bayes_accuracy"] - 0.05, s


def test_ensemble_members_differ_only_by_seed_and_name(tmp_path):
    """train_rm_ensemble builds each member with dataclasses.replace(cfg, name=..., seed=...): the
    flat keys land in the run section, every other section (here lr, batch size, eval_seed) is kept."""
    import yaml

    from tether.trainers.rm import train_rm_ensemble
    model = _tiny_world_model(tmp_path / "m")
    data = _writer_pairs(tmp_path / "pairs.jsonl", 64)
    cfg = RMConfig(model=model, data=data, name="ens", runs_dir=str(tmp_path), batch_size=8, max_steps=2,
                   lr=1e-2, eval_seed=3, device="cpu", progress=False)
    paths = train_rm_ensemble(cfg, [0, 1])
    assert paths == [str(tmp_path / f"ens-s{s}" / "checkpoints" / "step-2") for s in (0, 1)]
    assert cfg.run.name == "ens" and cfg.run.seed == 0  # the caller's config is not touched
    for s in (0, 1):
        saved = yaml.safe_load((tmp_path / f"ens-s{s}" / "config.yaml").read_text())
        assert saved["run"]["name"] == f"ens-s{s}" and saved["run"]["seed"] == s
        assert saved["optim"]["lr"] == 1e-2 and saved["data"]["batch_size"] == 8 and saved["rm"]["eval_seed"] == 3
    summaries = [json.loads((tmp_path / f"ens-s{s}" / "summary.json").read_text()) for s in (0, 1)]
    assert summaries[0]["eval_pairs"] == summaries[1]["eval_pairs"] > 0  # one held-out split (eval_seed)
    heads = [ScalarHeadModel.from_pretrained(p, device="cpu").head.weight for p in paths]
    assert not torch.allclose(heads[0], heads[1])  # seeds differ: head init and data order


def test_samples_are_held_out_pairs_with_their_rewards(tmp_path):
    """At eval points and at the end, run.num_samples held-out pairs with the (centered) rewards
    the saved model gives them."""
    model = _tiny_world_model(tmp_path / "m")
    data = _writer_pairs(tmp_path / "pairs.jsonl", 64)
    s = train_rm(RMConfig(model=model, data=data, runs_dir=str(tmp_path), batch_size=8, max_steps=4,
                          eval_every=2, num_samples=3, lr=1e-2, device="cpu", progress=False))
    rows = [json.loads(l) for l in (tmp_path / "rm" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 2, 2, 4, 4, 4]
    # the first held-out pairs (eval_fraction 0.1 of 64, split by eval_seed 0), the same each time
    import random
    order = list(range(64))
    random.Random(0).shuffle(order)
    pairs = [json.loads(l) for l in open(data)]
    held_out = [pairs[i] for i in sorted(order[:6])][:3]
    for r in rows:
        assert (r["prompt"], r["chosen"], r["rejected"]) in [(h["prompt"], h["chosen"], h["rejected"]) for h in held_out]
    assert [r["chosen"] for r in rows[:3]] == [r["chosen"] for r in rows[3:]] == [h["chosen"] for h in held_out]
    rm = LearnedReward(s["checkpoint"], device="cpu")
    final = rows[3:]
    got = rm([r["prompt"] for r in final] * 2, [r["chosen"] for r in final] + [r["rejected"] for r in final])
    want = [r["reward_chosen"] for r in final] + [r["reward_rejected"] for r in final]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_and_attention_kernel_give_the_same_run(tmp_path):
    """Gradient checkpointing recomputes the body's activations in backward: the same losses,
    accuracies and weights as the plain run (up to float rounding), with checkpointing really on;
    attn_implementation reaches the body's loader. LoRA is refused in one line."""
    model = _tiny_world_model(tmp_path / "m")
    data = _writer_pairs(tmp_path / "pairs.jsonl", 64)
    base = dict(model=model, data=data, eval_fraction=0.0, runs_dir=str(tmp_path), batch_size=16,
                max_steps=4, log_every=1, lr=3e-3, device="cpu", progress=False, center=False)
    train_rm(RMConfig(**base, name="plain"))
    seen = []
    real = ScalarHeadModel.gradient_checkpointing_enable

    def spy(self, **kw):
        real(self, **kw)
        seen.append(self.body.is_gradient_checkpointing)
    ScalarHeadModel.gradient_checkpointing_enable = spy
    try:
        out = train_rm(RMConfig(**base, name="ckpt", gradient_checkpointing=True, attn_implementation="eager"))
    finally:
        ScalarHeadModel.gradient_checkpointing_enable = real
    assert seen == [True]
    loaded = ScalarHeadModel.from_pretrained(out["checkpoint"], device="cpu", attn_implementation="eager")
    assert loaded.body.config._attn_implementation == "eager"
    rows = {n: [json.loads(l) for l in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in ("plain", "ckpt")}
    for a, b in zip(rows["plain"], rows["ckpt"]):
        if "loss" in a:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6) and a["accuracy"] == b["accuracy"]
    assert rows["plain"][0]["loss"] != pytest.approx(rows["plain"][-2]["loss"], abs=1e-3)  # it trained
    with pytest.raises(ValueError, match="lora_r is not supported"):
        RMConfig(**base, lora_r=4)
