"""`tether eval` and tether.evaluation: the pass@k estimator against hand-computed values, each mode
end to end against an independent computation of the same number, and the CLI's one-line errors."""

import json
import math

import pytest
import torch

from tether.cli import main
from tether.data.tokenize import encode_preference, encode_sft
from tether.evaluation import mean_pass_at_k, pass_at_k, preference_stats
from tether.models import load_model, load_tokenizer, make_tiny_model
from tether.rollout.hf import generate

SHAPE = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
             max_position_embeddings=128)
PROMPTS = [f"{a}+{b}=" for a in range(4) for b in range(3)]  # 12 prompts

# The reward reads the data's `answer` column (columns reach reward functions as keyword lists):
# a completion passes when its first character's code has the parity of the answer.
REWARD = '''
def parity(prompts, completions, completion_ids, answer, **kw):
    return [float(len(c) > 0 and (ord(c[0]) + int(a)) % 2 == 0) for c, a in zip(completions, answer)]
'''


def _judge(text: str, answer: str) -> bool:
    return len(text) > 0 and (ord(text[0]) + int(answer)) % 2 == 0


def _model(path, seed):
    """A tiny random model with its weights scaled up: its greedy completions then depend on the
    prompt (at the default init every prompt gets the same '====...'), so pass@1 is neither 0 nor 1."""
    model, tok = make_tiny_model(None, seed=seed, **SHAPE)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    (root / "reward.py").write_text(REWARD)
    rows = [{"prompt": p, "answer": str(eval(p[:-1]))} for p in PROMPTS]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = [{"prompt": p, "completion": str(eval(p[:-1]))} for p in PROMPTS]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    pairs = [{"prompt": p, "chosen": str(eval(p[:-1])), "rejected": str(eval(p[:-1]) + 1)} for p in PROMPTS]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return {"root": root, "m": _model(root / "m", 0), "m2": _model(root / "m2", 1), "rows": rows}


def _eval(argv, out):
    assert main(["eval", *argv, f"out={out}", "table=false"]) == 0
    return json.loads((out / "eval.json").read_text())


# -- the estimator -------------------------------------------------------------------------------

# (n, c, k) -> pass@k by hand: 1 - C(n-c, k) / C(n, k)
PINNED = [((5, 2, 1), 0.4), ((5, 2, 2), 1 - 3 / 10), ((5, 0, 3), 0.0), ((5, 5, 1), 1.0),
          ((5, 5, 5), 1.0), ((4, 1, 4), 1.0), ((4, 0, 4), 0.0), ((10, 3, 5), 1 - 21 / 252),
          ((5, 2, 4), 1.0)]  # n - c = 3 < k = 4: every 4 of the 5 hold a pass


def test_pass_at_k_hand_computed_values():
    for (n, c, k), want in PINNED:
        assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
    # the mean over problems, and the exact binomial form on a grid
    assert mean_pass_at_k([(5, 2), (5, 0)], 2) == pytest.approx(0.35, abs=1e-12)
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    # large n: the product form stays finite where the binomials are astronomically large
    assert 0 < pass_at_k(2000, 3, 100) < 1 and math.isfinite(pass_at_k(2000, 3, 100))
    for bad in ((5, 2, 6), (5, 6, 1), (5, 2, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_wrong_estimators_fail_the_pinned_values():
    wrong = {"c/n at every k": lambda n, c, k: c / n,
             "with replacement": lambda n, c, k: 1 - (1 - c / n) ** k}
    for name, fn in wrong.items():
        assert any(abs(fn(n, c, k) - want) > 1e-6 for (n, c, k), want in PINNED), name


def test_preference_stats_ties_fail():
    s = preference_stats([1.0, 2.0, 0.5, 3.0], [0.0, 2.0, 1.5, 1.0])
    assert s["accuracy"] == 0.5 and s["tie_rate"] == 0.25  # 1 > 0 and 3 > 1; the tie is a failure
    assert s["margin"] == pytest.approx((1 + 0 - 1 + 2) / 4)
    assert s["chosen_mean"] == pytest.approx(6.5 / 4) and s["rejected_mean"] == pytest.approx(4.5 / 4)


# -- generation ----------------------------------------------------------------------------------

def test_greedy_pass_at_1_equals_an_independent_generate_and_score(world, tmp_path):
    root = world["root"]
    got = _eval([f"model={world['m']}", f"data={root / 'prompts.jsonl'}",
                 f"reward_funcs=[{root / 'reward.py'}:parity]", "decoding=greedy", "max_new_tokens=6"],
                tmp_path / "o")
    # independently: the text helper's greedy completions, judged by hand
    model, tok = load_model(world["m"], device="cpu"), load_tokenizer(world["m"])
    texts = generate(model, tok, PROMPTS, max_new_tokens=6)
    passed = [_judge(t, r["answer"]) for t, r in zip(texts, world["rows"])]
    assert 0 < sum(passed) < len(passed)  # a test that can tell right from wrong
    assert got["metrics"]["greedy/pass@1"] == sum(passed) / len(passed)
    assert got["metrics"]["greedy/reward"] == pytest.approx(sum(passed) / len(passed), abs=1e-7)
    assert got["metrics"]["greedy/completions"] == len(PROMPTS)
    records = [json.loads(x) for x in (tmp_path / "o" / "completions.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in records] == texts and [r["passed"] for r in records] == passed
    assert set(got) == {"mode", "kind", "metrics", "settings", "model", "data", "seconds", "config"}
    assert got["mode"] == "generation" and got["data"]["rows"] == len(PROMPTS)
    assert got["data"]["kept"] == len(PROMPTS) and got["data"]["truncated"] == got["data"]["dropped"] == 0
    assert got["config"]["generation"]["max_new_tokens"] == 6 and got["settings"]["threshold"] == 1.0
    assert got["settings"]["decoding"] == ["greedy"] and got["model"]["path"] == world["m"]
    assert "sampled/pass@1" not in got["metrics"]


def test_sampled_pass_at_k_is_the_unbiased_estimate_of_the_written_completions(world, tmp_path):
    root = world["root"]
    args = [f"model={world['m']}", f"data={root / 'prompts.jsonl'}", f"reward_funcs=[{root / 'reward.py'}:parity]",
            "decoding=sampled", "n=5", "k=[1,2,5]", "temperature=1.5", "max_new_tokens=4", "seed=3"]
    got = _eval(args + ["batch_size=16"], tmp_path / "a")
    records = [json.loads(x) for x in (tmp_path / "a" / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 5 * len(PROMPTS)
    # c per prompt from the texts, judged by hand; pass@k by the binomial form, averaged
    c = [sum(_judge(r["completion"], world["rows"][i]["answer"]) for r in records if r["prompt_index"] == i)
         for i in range(len(PROMPTS))]
    assert 0 < sum(c) < 5 * len(PROMPTS)
    for k in (1, 2, 5):
        want = sum(1 - math.comb(5 - ci, k) / math.comb(5, k) for ci in c) / len(c)
        assert got["metrics"][f"sampled/pass@{k}"] == pytest.approx(want, abs=1e-12)
    assert got["metrics"]["sampled/pass@1"] == pytest.approx(sum(c) / (5 * len(c)), abs=1e-12)
    clipped = sum(r["finish_reason"] == "length" for r in records) / len(records)
    assert got["metrics"]["sampled/completions/clipped_ratio"] == clipped
    assert got["metrics"]["sampled/completions/mean_length"] == pytest.approx(
        sum(r["length"] for r in records) / len(records))
    assert got["settings"]["temperature"] == 1.5 and got["settings"]["seed"] == 3 and got["settings"]["k"] == [1, 2, 5]
    # seeded: the same completions again, whatever the number of prompts per sampler call
    again = _eval(args + ["batch_size=5"], tmp_path / "b")
    assert [json.loads(x)["completion"] for x in (tmp_path / "b" / "completions.jsonl").read_text().splitlines()] \
        == [r["completion"] for r in records]
    assert again["metrics"] == got["metrics"]


# -- preference accuracy ---------------------------------------------------------------------------

def test_dpo_policy_equal_to_reference_has_zero_margins_and_accuracy(world, tmp_path):
    got = _eval([f"policy={world['m']}", f"ref={world['m']}", f"data={world['root'] / 'pairs.jsonl'}",
                 "batch_size=5"], tmp_path / "o")
    m = got["metrics"]
    assert got["mode"] == "preference" and got["kind"] == "dpo-implicit-reward"
    assert m["margin"] == 0.0 and m["chosen_mean"] == 0.0 and m["rejected_mean"] == 0.0
    assert m["accuracy"] == 0.0 and m["tie_rate"] == 1.0 and m["pairs"] == len(PROMPTS)


def _logp(model, prompt, completion) -> float:
    """Σ log π(completion | prompt), one unpadded sequence, plain HF forward + log_softmax."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    return float(lp[len(prompt) - 1:].sum())


def test_dpo_implicit_reward_accuracy_against_per_pair_forwards(world, tmp_path):
    beta = 0.5
    got = _eval([f"model={world['m2']}", f"ref={world['m']}", f"data={world['root'] / 'pairs.jsonl'}",
                 f"beta={beta}", "batch_size=4"], tmp_path / "o")
    tok = load_tokenizer(world["m"])
    policy, ref = load_model(world["m2"], device="cpu"), load_model(world["m"], device="cpu")
    rows = [json.loads(x) for x in (world["root"] / "pairs.jsonl").read_text().splitlines()]
    pairs, _ = encode_preference(rows, tok)
    margins = []
    for p in pairs:
        r = [beta * (_logp(policy, p["prompt_ids"], p[k]) - _logp(ref, p["prompt_ids"], p[k]))
             for k in ("chosen_ids", "rejected_ids")]
        margins.append(r[0] - r[1])
    assert 0 < sum(m > 0 for m in margins) < len(margins)
    assert got["metrics"]["accuracy"] == sum(m > 0 for m in margins) / len(margins)
    assert got["metrics"]["margin"] == pytest.approx(sum(margins) / len(margins), rel=1e-5)
    assert got["settings"]["beta"] == beta


def test_reward_model_accuracy_equals_the_rm_trainers_evaluation(world, tmp_path):
    from contextlib import nullcontext

    from tether.models.heads import ScalarHeadModel
    from tether.trainers.rm import evaluate_pairs, load_pairs

    model, tok = load_model(world["m"], device="cpu"), load_tokenizer(world["m"])
    torch.manual_seed(0)
    rm = ScalarHeadModel(model)
    with torch.no_grad():
        rm.head.weight.normal_()  # a head that tells the pairs apart (the fresh one is near 0)
    rm.save_pretrained(tmp_path / "rm", tok)
    got = _eval([f"model=rm:{tmp_path / 'rm'}", f"data={world['root'] / 'pairs.jsonl'}"], tmp_path / "o")
    # independently: `tether rm`'s own held-out evaluation of the same model on the same pairs
    loaded = ScalarHeadModel.from_pretrained(tmp_path / "rm", kind="reward", device="cpu")
    pairs, _ = load_pairs(str(world["root"] / "pairs.jsonl"), tok, 1024)
    want = evaluate_pairs(loaded, pairs, 4, tok.pad_token_id, torch.device("cpu"), nullcontext())
    assert 0 < want["eval/accuracy"] < 1
    # the trainer's accuracy is a float32 mean: compare the number of pairs ranked right
    right = round(want["eval/accuracy"] * len(pairs))
    assert got["kind"] == "reward-model" and got["metrics"]["accuracy"] == right / len(pairs)
    assert got["metrics"]["margin"] == pytest.approx(want["eval/margin"], rel=1e-5, abs=1e-6)
    # the same model given as rm=<dir>
    same = _eval([f"rm={tmp_path / 'rm'}", f"data={world['root'] / 'pairs.jsonl'}"], tmp_path / "o2")
    assert same["metrics"] == got["metrics"]


# -- perplexity ----------------------------------------------------------------------------------

def test_perplexity_is_exp_of_the_sft_eval_loss(world, tmp_path):
    from contextlib import nullcontext

    from tether.trainers.sft import evaluate_loss

    got = _eval([f"model={world['m']}", f"data={world['root'] / 'sft.jsonl'}", "batch_size=5"], tmp_path / "o")
    tok = load_tokenizer(world["m"])
    rows = [json.loads(x) for x in (world["root"] / "sft.jsonl").read_text().splitlines()]
    examples, _ = encode_sft(rows, tok, 1024)
    loss = evaluate_loss(load_model(world["m"], device="cpu"), examples, 3, tok.pad_token_id,
                         torch.device("cpu"), nullcontext())
    assert got["mode"] == "perplexity"
    assert got["metrics"]["nll"] == pytest.approx(loss, rel=1e-5)
    assert got["metrics"]["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert got["metrics"]["tokens"] == sum(sum(e["completion_mask"][1:]) for e in examples)


# -- the CLI -------------------------------------------------------------------------------------

def test_help_is_grouped(capsys):
    assert main(["eval", "--help"]) == 0
    out = capsys.readouterr().out
    for header in ("model:", "data:", "generation:", "reward:", "preference:", "output:"):
        assert any(line.startswith(header) for line in out.splitlines()), header
    assert "generation.threshold" in out and "model.ref" in out


M = "model=/nonexistent/model"  # any error about it would mean a load was attempted first


@pytest.mark.parametrize("args, needle, code", [
    ([M, "data=P"], "generation mode needs at least one reward function", 1),
    ([M, "data=P", "reward_funcs=[parity_nope]"], "reward 'parity_nope'", 1),
    ([M, "data=P", "reward_funcs=[R]", "pass_reward=other"], "pass_reward 'other' is not one of", 1),
    ([M, "data=PAIRS"], "preference pairs are scored by a reward model", 1),
    ([M, "data=SFT", "reward_funcs=[R]"], "set mode=generation", 1),
    ([M, "data=BAD", "reward_funcs=[R]"], "bad.jsonl:2", 1),
    (["rm=/nonexistent/rm", "data=P"], "preference accuracy needs pairs (prompt, chosen, rejected); the data is prompt-only", 1),
    (["policy=/nonexistent/a", "ref=/nonexistent/b", "data=SFT"], "needs pairs", 1),
    ([M, "data=P", "n=2", "k=[3]"], "'generation.k' must be <= generation.n", 2),
    (["policy=/nonexistent/a", "data=P"], "needs model.ref", 2),
    ([M, "rm=/nonexistent/rm", "data=PAIRS"], "give the model once", 2),
    (["rm=/nonexistent/rm", "ref=/nonexistent/b", "data=PAIRS"], "model.ref is for DPO", 2),
])
def test_bad_input_is_one_line_before_any_model_loads(world, tmp_path, capsys, args, needle, code):
    root = world["root"]
    (root / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2="}\n')
    subst = {"P": root / "prompts.jsonl", "PAIRS": root / "pairs.jsonl", "SFT": root / "sft.jsonl",
             "BAD": root / "bad.jsonl", "[R]": f"[{root / 'reward.py'}:parity]"}
    argv = [f"{k}={subst.get(v, v)}" for k, v in (a.split("=", 1) for a in args)]
    rc = main(["eval", *argv, f"out={tmp_path / 'o'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "o").exists()


# -- a trainer's eval points ----------------------------------------------------------------------

def test_grpo_eval_points_equal_tether_eval_on_the_checkpoint(world, tmp_path):
    from tether.run import latest_checkpoint
    from tether.trainers.grpo import GRPOConfig, train_grpo

    root = world["root"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = train_grpo(GRPOConfig(
            model=world["m"], data=str(root / "prompts.jsonl"), eval_data=str(root / "prompts.jsonl"),
            runs_dir=str(tmp_path / "runs"), name="g", batch_size=4, num_generations=4, max_new_tokens=6,
            max_steps=2, eval_every=1, lr=1e-2, device="cpu", progress=False,
            reward_funcs=[f"{root / 'reward.py'}:parity"]))
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(x) for x in (tmp_path / "runs" / "g" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/greedy/pass@1" in r]
    assert [r["step"] for r in evals] == [1, 2]  # every step, the last one once (the final eval)
    # the last eval point is the final policy's: `tether eval` on the saved checkpoint agrees exactly
    got = _eval([f"model={latest_checkpoint(tmp_path / 'runs' / 'g')}", f"data={root / 'prompts.jsonl'}",
                 f"reward_funcs=[{root / 'reward.py'}:parity]", "decoding=greedy", "max_new_tokens=6"],
                tmp_path / "o")
    for key in ("pass@1", "reward", "rewards/parity/mean", "completions/mean_length", "completions/clipped_ratio"):
        assert evals[-1][f"eval/greedy/{key}"] == got["metrics"][f"greedy/{key}"], key
        assert summary[f"eval/greedy/{key}"] == got["metrics"][f"greedy/{key}"], key
