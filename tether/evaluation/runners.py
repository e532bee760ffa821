"""`tether eval`'s four modes from a config: load what the mode needs (tokenizer and encoded data,
reward functions: every check before a model loads), then the model(s), then the evaluation
functions of generation.py / likelihood.py. Each returns the pieces of eval.json."""

from __future__ import annotations

from tether.data.tokenize import encode_preference, encode_prompts, encode_sft
from tether.errors import UserError
from tether.evaluation.estimators import perplexity, preference_stats
from tether.evaluation.generation import check_settings, evaluate_generation
from tether.evaluation.likelihood import dpo_pair_rewards, reward_model_pairs, token_nll
from tether.models.load import load_model, load_tokenizer
from tether.rewards.registry import load_reward
from tether.rewards.scoring import fn_name, resolve_reward_funcs
from tether.rollout import Sampler, SamplingConfig


def _load(cfg, path: str):
    m = cfg.model
    return load_model(path, dtype=m.dtype, device=m.device, attn_implementation=m.attn_implementation)


def _report(rep) -> dict:
    return {"kept": rep.kept, "truncated": rep.truncated, "dropped": rep.dropped, "report": rep.summary()}


def _nothing_left(cfg, what: str):
    return UserError(f"{cfg.data.path}: no {what} left to evaluate (every row was dropped; raise "
                     f"max_length / max_prompt_length or use truncation=truncate)")


def run_generation(cfg, rows) -> dict:
    """pass@k and mean rewards of greedy and/or sampled completions of the prompts."""
    specs = cfg.reward.reward_funcs
    if not specs:
        raise UserError(f"{cfg.data.path}: generation mode needs at least one reward function "
                        f"(reward_funcs=[arithmetic] or module:function) to tell a pass from a fail")
    funcs = resolve_reward_funcs(specs)
    names = [fn_name(f) for f in funcs]
    weights = list(cfg.reward.reward_weights) or [1.0] * len(funcs)
    settings = cfg.settings()
    try:
        check_settings(settings, names)
    except ValueError as e:
        raise UserError(str(e)) from None
    tokenizer = load_tokenizer(cfg.model.path)
    prompts, rep = encode_prompts(rows, tokenizer, cfg.data.max_prompt_length, cfg.data.truncation,
                                  source=cfg.data.path)
    if not prompts:
        raise _nothing_left(cfg, "prompts")
    model = _load(cfg, cfg.model.path)
    sampler = Sampler(model, tokenizer, SamplingConfig(max_new_tokens=settings.max_new_tokens))
    try:
        metrics, records = evaluate_generation(sampler, prompts, funcs, weights, settings, names)
    finally:
        sampler.release()
    return {"kind": "causal-lm", "metrics": metrics, "records": records, "data": _report(rep),
            "settings": {**settings.record(), "reward_funcs": list(specs), "reward_names": names,
                         "reward_weights": weights, "max_prompt_length": cfg.data.max_prompt_length}}


def run_perplexity(cfg, rows) -> dict:
    """Token-mean NLL and perplexity over the completion (or, for plain text, every) token."""
    tokenizer = load_tokenizer(cfg.model.path)
    examples, rep = encode_sft(rows, tokenizer, cfg.data.max_length, cfg.data.truncation,
                               source=cfg.data.path, completion_only_loss=True)
    if not examples:
        raise _nothing_left(cfg, "examples")
    model = _load(cfg, cfg.model.path)
    nll_sum, tokens = token_nll(model, examples, cfg.data.batch_size, tokenizer.pad_token_id)
    nll, ppl = perplexity(nll_sum, tokens)
    return {"kind": "causal-lm", "data": _report(rep),
            "metrics": {"nll": nll, "perplexity": ppl, "tokens": tokens, "examples": len(examples)},
            "settings": {"max_length": cfg.data.max_length, "truncation": cfg.data.truncation,
                         "completion_only": True}}


def run_reward_model(cfg, rows) -> dict:
    """A reward model's (or ensemble's) pairwise accuracy and margins on text pairs."""
    m = cfg.model
    reward = load_reward(cfg.rm_spec(), device=m.device, dtype=m.dtype, batch_size=cfg.data.batch_size,
                         max_length=cfg.data.max_length)
    chosen, rejected = reward_model_pairs(reward, list(rows))
    return {"kind": "reward-model", "metrics": preference_stats(chosen, rejected),
            "data": {"kept": len(chosen)},
            "settings": {"max_length": cfg.data.max_length, "ties": "count as failures",
                         "members": [str(p) for p in getattr(reward, "paths", [])],
                         "aggregate": getattr(reward, "aggregate", None)}}


def run_dpo(cfg, rows) -> dict:
    """Accuracy and margins of DPO's implicit reward β·(log π − log π_ref) on pairs."""
    tokenizer = load_tokenizer(cfg.policy_path())
    ref_tok = load_tokenizer(cfg.model.ref)
    if ref_tok.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"policy '{cfg.policy_path()}' and ref '{cfg.model.ref}' have different tokenizers: "
                        f"their log-probs are not of the same tokens")
    pairs, rep = encode_preference(rows, tokenizer, cfg.data.max_length, cfg.data.truncation,
                                   source=cfg.data.path)
    if not pairs:
        raise _nothing_left(cfg, "pairs")
    policy, reference = _load(cfg, cfg.policy_path()), _load(cfg, cfg.model.ref)
    beta = cfg.preference.beta
    chosen, rejected = dpo_pair_rewards(policy, reference, pairs, beta, cfg.data.batch_size,
                                        tokenizer.pad_token_id)
    return {"kind": "dpo-implicit-reward", "data": _report(rep),
            "metrics": preference_stats(chosen.tolist(), rejected.tolist()),
            "settings": {"beta": beta, "max_length": cfg.data.max_length, "truncation": cfg.data.truncation,
                         "ties": "count as failures"}}


def run_episodes(cfg, rows) -> dict:
    """pass@k of an environment's episodes (greedy and / or n sampled per row): an episode passes
    when its reward — the environment's, plus the weighted reward_funcs on its transcript — is
    >= generation.threshold; also the mean reward and the episodes' turns, tool calls and errors."""
    from tether.envs import load_env
    from tether.envs.rollouts import env_reward, episode_columns, episode_metrics, sample_episodes
    from tether.evaluation.estimators import mean_pass_at_k
    from tether.rewards.scoring import score

    funcs = [env_reward, *resolve_reward_funcs(cfg.reward.reward_funcs)]
    weights = [1.0, *(list(cfg.reward.reward_weights) or [1.0] * (len(funcs) - 1))]
    names = [fn_name(f) for f in funcs]
    settings = cfg.settings()
    factory = load_env(cfg.environment.env)
    tokenizer = load_tokenizer(cfg.model.path)
    prompts, rep = encode_prompts(rows, tokenizer, cfg.data.max_prompt_length, cfg.data.truncation,
                                  source=cfg.data.path)
    if not prompts:
        raise _nothing_left(cfg, "prompts")
    model = _load(cfg, cfg.model.path)
    sampler = Sampler(model, tokenizer, SamplingConfig(max_new_tokens=settings.max_new_tokens))
    metrics, records = {}, []
    try:
        for decoding in settings.decoding:
            greedy = decoding == "greedy"
            n = 1 if greedy else settings.n
            opts = {"temperature": 0.0} if greedy else {"temperature": settings.temperature,
                                                       "top_p": settings.top_p, "top_k": settings.top_k}
            ro, kept = sample_episodes(sampler, tokenizer, factory, prompts, n, cfg.environment,
                                       seed=settings.seed, **opts)
            seq_rows = [{**prompts[kept[i // n]], **episode_columns(ro.episodes[i])} for i in range(len(ro))]
            per_fn, total = score(funcs, weights, seq_rows, ro.texts, ro.completion_lists())
            passed = (total >= settings.threshold) & ~total.isnan()
            counts = [(n, int(passed[j * n:(j + 1) * n].sum())) for j in range(len(kept))]
            counts += [(n, 0)] * (len(prompts) - len(kept))  # a row whose reset raised: no pass
            scored = ~total.isnan()
            out = {f"pass@{k}": mean_pass_at_k(counts, k) for k in ([1] if greedy else settings.ks())}
            out.update({"reward": float(total[scored].mean()) if scored.any() else float("nan"),
                        **{f"rewards/{name}/mean": float(per_fn[:, j].nanmean()) for j, name in enumerate(names)},
                        **episode_metrics(ro), "prompts": len(prompts), "episodes": len(ro)})
            metrics.update({f"{decoding}/{k}": v for k, v in out.items()})
            for i in range(len(ro)):
                ep = ro.episodes[i]
                records.append({"decoding": decoding, "prompt_index": kept[i // n], "sample": i % n,
                                "prompt": prompts[kept[i // n]]["prompt"], "messages": ep["messages"],
                                "reward": None if not scored[i] else float(total[i]), "passed": bool(passed[i]),
                                "turns": ep["turns"], "tool_calls": ep["tool_calls"],
                                "tool_errors": ep["tool_errors"], "finish_reason": ro.finish_reasons[i]})
    finally:
        sampler.release()
    return {"kind": "causal-lm", "metrics": metrics, "records": records, "data": _report(rep),
            "settings": {**settings.record(), "env": cfg.environment.env, "max_turns": cfg.environment.max_turns,
                         "reward_funcs": list(cfg.reward.reward_funcs), "reward_names": names,
                         "reward_weights": weights}}
