"""Scalar heads: last-token selection under left/right padding, save/load round trip."""
import torch

from tether.models import make_tiny_model
from tether.models.heads import ScalarHeadModel, last_token_index


def _tiny(tmp_path=None):
    return make_tiny_model(tmp_path, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                           intermediate_size=64)


def test_last_token_index_left_and_right_padding():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert last_token_index(right).tolist() == [2, 4]
    assert last_token_index(left).tolist() == [4, 4]


def test_score_is_independent_of_padding_side():
    model, tok = _tiny()
    model.eval()
    rm = ScalarHeadModel(model)
    with torch.no_grad():
        rm.head.weight.normal_()
    a, b = tok("abc").input_ids, tok("hello world").input_ids
    T = max(len(a), len(b))
    pad = tok.pad_token_id

    def batch(side):
        ids, mask = [], []
        for s in (a, b):
            p = [pad] * (T - len(s))
            ids.append(s + p if side == "right" else p + s)
            mask.append([1] * len(s) + [0] * len(p) if side == "right" else [0] * len(p) + [1] * len(s))
        return torch.tensor(ids), torch.tensor(mask)

    with torch.no_grad():
        r = rm.score(*batch("right"))
        l = rm.score(*batch("left"))
        alone = torch.stack([rm.score(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0] for s in (a, b)])
    torch.testing.assert_close(r, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l, alone, atol=1e-5, rtol=1e-5)
    assert abs(r[0] - r[1]) > 1e-4  # different texts, different scores: the head is really read


def test_save_load_round_trip_keeps_scores_and_offset(tmp_path):
    model, tok = _tiny()
    rm = ScalarHeadModel(model, offset=0.25)
    with torch.no_grad():
        rm.head.weight.normal_()
        rm.head.bias.fill_(0.5)
    rm.save_pretrained(tmp_path / "rm", tok)
    back = ScalarHeadModel.from_pretrained(tmp_path / "rm", device="cpu")
    ids = torch.tensor([tok("xyz").input_ids])
    m = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(rm.score(ids, m), back.score(ids, m))
    assert back.offset == 0.25 and back.kind == "reward"


def test_the_head_computes_in_fp32_under_autocast_and_with_a_bf16_gathered_weight():
    """FSDP2's bf16 mixed precision hands the head a bf16 weight (it crashed PPO's `rm:` reward on
    CUDA: fp32 input, bf16 weight); autocast would run it in bf16. Both: an fp32 matmul."""
    model, tok = _tiny()
    rm = ScalarHeadModel(model.eval(), offset=0.25)
    with torch.no_grad():
        rm.head.weight.normal_()
        rm.head.bias.fill_(0.5)
    ids = torch.tensor([tok("hello world").input_ids])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        h = rm._base()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, -1].float()
        fp32 = h @ rm.head.weight.float().T + 0.5 - 0.25
        plain = rm.score(ids, mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = rm(ids, mask)[:, -1]
        rm.head.to(torch.bfloat16)  # what the gathered weight looks like under FSDP2 mixed precision
        gathered = rm.score(ids, mask)
    torch.testing.assert_close(plain, fp32.squeeze(-1), atol=1e-5, rtol=1e-5)
    assert auto.dtype == torch.float32 and gathered.dtype == torch.float32
    bf16_weight = h @ rm.head.weight.float().T + 0.5 - 0.25  # the bf16-rounded weight, fp32 matmul
    torch.testing.assert_close(gathered, bf16_weight.squeeze(-1), atol=1e-5, rtol=1e-5)
