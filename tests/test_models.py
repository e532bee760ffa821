"""Model layer: the tiny factory produces a real HF model that round-trips through save/load."""

import pytest
import torch

from tether.errors import UserError
from tether.models import char_tokenizer, load_model, load_tokenizer, make_tiny_model, save_model


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_tiny_model_round_trips_in_hf_format(tmp_path, family):
    model, tok = make_tiny_model(tmp_path / "m", family=family, hidden_size=32, num_layers=2,
                                 num_heads=2, num_kv_heads=1, intermediate_size=64)
    assert (tmp_path / "m" / "model.safetensors").exists() and (tmp_path / "m" / "tokenizer.json").exists()
    again = load_model(str(tmp_path / "m"), device="cpu")
    assert again.config.model_type == {"gemma3": "gemma3_text"}.get(family, family)
    ids = torch.tensor([tok("What is 23 × 17?").input_ids])
    torch.testing.assert_close(model(ids).logits, again(ids).logits)
    save_model(again, tok, tmp_path / "copy")
    assert load_model(str(tmp_path / "copy"), dtype="bf16").dtype == torch.bfloat16


def test_char_tokenizer_is_lossless_and_has_a_chat_template():
    tok = char_tokenizer()
    text = "Question: What is 23 × 17?\nAnswer: 23 × 17 = 391\n#### 391"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok(text).input_ids == [tok.bos_token_id] + ids  # it adds BOS itself, as Llama's does
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|user|>hi<|end|><|assistant|>"
    assert tok.pad_token_id != tok.eos_token_id


def test_missing_local_path_is_one_line(tmp_path):
    with pytest.raises(UserError, match="does not exist") as e:
        load_model(str(tmp_path / "nope"))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError):
        load_tokenizer("./no/such/dir")


def test_seeded_init_is_reproducible():
    a, _ = make_tiny_model(None, seed=5, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=64)
    b, _ = make_tiny_model(None, seed=5, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=64)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
