"""`tether memory`: seed-table reproduction, exact parameter counts, and the per-component formulas."""

import json

import pytest

from tether.cli import main
from tether.config import load_config
from tether.errors import UserError
from tether.memory import MemoryConfig, Shape, estimate, guess_shape, parse_count, resolve_model


def _est(**kw):
    return estimate(load_config(MemoryConfig, overrides={k: v for k, v in kw.items()}))


def _gb(est, component):
    return sum(r["gb"] for r in est["components"] if r["component"] == component)


@pytest.mark.parametrize("algo,seed_gb", [("ppo", 170), ("dpo", 84), ("grpo", 98)])
def test_seed_table_7b_totals(algo, seed_gb):
    est = _est(model="7e9", algo=algo)
    assert abs(est["totals_gb"]["weights_and_optimizer"] - seed_gb) / seed_gb < 0.10
    # gradients are counted, but on their own line above the seed's number
    assert est["totals_gb"]["with_gradients"] > est["totals_gb"]["weights_and_optimizer"]
    assert est["totals_gb"]["peak"] >= est["totals_gb"]["with_gradients"]


def test_parameter_count_parsing_and_llama2_shape():
    assert parse_count("7e9") == parse_count("7B") == parse_count("7000000000.0") == 7e9
    assert parse_count("0.5b") == 5e8 and parse_count("125M") == 1.25e8
    assert parse_count("meta-llama/Llama-2-7b-hf") is None
    s = guess_shape(7e9)
    assert (s.hidden, s.layers, s.heads, s.intermediate, s.vocab) == (4096, 32, 32, 11008, 32000)
    assert s.params() == 6_738_415_616  # Llama-2-7B's published count
    s = guess_shape(13e9)
    assert (s.hidden, s.layers, s.intermediate) == (5120, 40, 13824)  # Llama-2-13B


def _tiny(kind, tmp_path):
    import transformers
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, attention_bias=True)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    cfg.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_exact_param_count_from_local_config(kind, tmp_path):
    expected = _tiny(kind, tmp_path)
    assert resolve_model(str(tmp_path))["params"] == expected  # a directory with config.json
    info = resolve_model(str(tmp_path / "config.json"))  # or the file itself
    assert info["params"] == expected
    s = info["shape"]
    assert (s.kv_heads, s.head_dim, s.tied) == (2, 8, kind == "qwen2")


def test_kv_cache_follows_gqa_shape(tmp_path):
    _tiny("qwen2", tmp_path)
    est = _est(model=str(tmp_path), algo="grpo", rollout_batch=3, num_generations=5, seq_len=7)
    per_token = 2 * 2 * 2 * 8 * 2  # K and V x layers x kv_heads x head_dim x bf16 bytes
    kv = [r for r in est["components"] if r["component"] == "KV cache (rollouts)"]
    assert kv[0]["bytes"] == 3 * 5 * 7 * per_token
    mha = Shape(32, 2, 4, 4, 8, 48, 97)
    assert mha.kv_bytes_per_token(2) == 2 * per_token  # 4 kv heads instead of 2: twice the cache


def test_lora_shrinks_optimizer_state_by_trainable_fraction():
    full, lora = _est(model="7e9", algo="sft"), _est(model="7e9", algo="sft", lora=True, lora_rank=8)
    n_lora = guess_shape(7e9).lora_params(8, list(MemoryConfig().lora_targets))
    assert n_lora == 32 * 8 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    ratio = _gb(lora, "policy optimizer state") / _gb(full, "policy optimizer state")
    assert ratio == pytest.approx(n_lora / 7e9)
    # with LoRA the reference is the base with adapters disabled: no second copy
    assert _gb(_est(model="7e9", algo="dpo", lora=True), "reference weights") == 0
    assert _gb(_est(model="7e9", algo="dpo"), "reference weights") == pytest.approx(14.0)


def test_gradient_checkpointing_reduces_activations():
    plain = _gb(_est(model="7e9", algo="grpo"), "policy activations")
    ckpt = _gb(_est(model="7e9", algo="grpo", gradient_checkpointing=True), "policy activations")
    assert ckpt < plain / 5


def test_activations_on_the_host_keep_two_layer_inputs_on_the_gpu():
    """offload_activations: of the checkpointed layers' inputs (L · d · h bytes a token) two stay on
    the GPU, in flight (models/offload.py); the recomputed layer's activations stay as they were.
    7e9 is guessed as Llama-7B's shape: 32 layers, hidden 4096, bf16; GRPO trains 4 × 1024 tokens."""
    kw = dict(model="7e9", algo="grpo", gradient_checkpointing=True, weight_dtype="bf16", batch_size=4,
              seq_len=1024)
    kept = _gb(_est(**kw), "policy activations")
    moved = _gb(_est(**kw, offload_activations=True), "policy activations")
    assert kept - moved == pytest.approx(4 * 1024 * (32 - 2) * 2 * 4096 / 1e9)  # 1.007 GB
    with pytest.raises(ValueError, match="offload_activations"):  # one process, as the trainers take it
        _est(**kw, offload_activations=True, gpus=2)


def test_model_sets_per_algorithm():
    def names(**kw):
        return {r["component"] for r in _est(model="1e9", **kw)["components"] if r["component"].endswith("weights")}
    assert names(algo="sft") == {"policy weights"}
    assert names(algo="simpo") == names(algo="orpo") == {"policy weights"}
    assert names(algo="rm") == {"reward model weights"}
    assert names(algo="dpo", precompute_ref=True) == {"policy weights"}
    assert names(algo="grpo", reward="verifier", beta=0) == {"policy weights"}
    assert names(algo="ppo") == {"policy weights", "reference weights", "reward model weights", "value model weights"}


def test_offload_moves_optimizer_off_gpu():
    est = _est(model="7e9", algo="dpo", offload=True)
    assert est["totals_gb"]["weights_and_optimizer"] == pytest.approx(28.0)
    assert est["totals_gb"]["cpu_offloaded"] == pytest.approx(56.0)


def test_unknown_model_is_one_line_error():
    with pytest.raises(UserError):
        resolve_model("./no/such/model dir")


def test_cli_table_and_json(capsys):
    assert main(["memory", "--model", "7e9", "--algo", "ppo"]) == 0
    out = capsys.readouterr().out
    assert "weights + optimizer state" in out and "total (peak estimate)" in out and "GB = 1e9 bytes" in out
    assert main(["memory", "--model", "7e9", "--algo", "dpo", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["totals_gb"]["weights_and_optimizer"] == pytest.approx(84.0)


def test_rl_trainers_hold_one_chunk_of_logits():
    """Logits larger than one chunk: every trainer's chunked LM head (SFT's too, sft._micro_loss)
    holds one chunk; smaller ones are held whole."""
    from tether.memory import HEAD_CHUNK_BYTES_PER_LOGIT, HEAD_CHUNK_LOGITS
    chunk = HEAD_CHUNK_LOGITS * HEAD_CHUNK_BYTES_PER_LOGIT / 1e9
    for algo in ("sft", "grpo"):
        assert _gb(_est(model="7e9", algo=algo, batch_size=16), "policy logits") == pytest.approx(chunk, rel=1e-6)
    small = _gb(_est(model="7e9", algo="sft", batch_size=1, seq_len=16), "policy logits")
    assert 0 < small < chunk / 10


def test_chunking_starts_where_the_code_starts_it():
    """models/logprobs.uses_chunked_head chunks by *count*: above 2^25 logits (CUDA). One sequence
    of T tokens holds T·V logits: whole up to 2^25, one chunk of transients just past it (where
    that chunk costs more than the whole logits would: 14 B against 10 B a logit)."""
    from tether.memory import HEAD_CHUNK_BYTES_PER_LOGIT, HEAD_CHUNK_LOGITS
    vocab = _est(model="7e9", algo="sft", batch_size=1)["shape"]["vocab"]
    at = HEAD_CHUNK_LOGITS // vocab  # the longest sequence whose logits are held whole
    whole = _est(model="7e9", algo="sft", batch_size=1, seq_len=at)
    past = _est(model="7e9", algo="sft", batch_size=1, seq_len=at + 1)
    assert _gb(whole, "policy logits") == pytest.approx(at * vocab * (2 + 8) / 1e9, rel=1e-9)
    assert _gb(past, "policy logits") == pytest.approx(HEAD_CHUNK_LOGITS * HEAD_CHUNK_BYTES_PER_LOGIT / 1e9, rel=1e-9)


def test_kv_cache_lives_in_the_gradient_buffer_when_it_fits():
    """The RL trainers keep one flat gradient buffer with the sampler's KV cache inside when it fits
    (common.flat_grad_buffer); otherwise gradients are freed while sampling and the cache, which the
    sampler keeps between calls, is held through the training step as well."""
    def parts(est):
        t = est["totals_bytes"]
        return t, sum(r["bytes"] for r in est["components"] if r["group"] == "rollout")
    for algo in ("grpo", "ppo"):
        est = _est(model="1e9", algo=algo, rollout_batch=4, num_generations=8, seq_len=128)
        t, kv = parts(est)
        assert est["kv_in_gradient_buffer"] and 0 < kv < t["with_gradients"] - t["weights_and_optimizer"]
        assert t["rollout"] == t["with_gradients"] and t["peak"] == t["training_step"]
    est = _est(model="1e9", algo="grpo", rollout_batch=4, num_generations=8, seq_len=128, lora=True, lora_rank=8)
    t, kv = parts(est)
    assert not est["kv_in_gradient_buffer"] and t["rollout"] == t["weights_and_optimizer"] + kv
    training = sum(r["bytes"] for r in est["components"] if r["group"] == "training")
    assert t["training_step"] == t["with_gradients"] + training + kv == t["peak"]
