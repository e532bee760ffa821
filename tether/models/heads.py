"""Scalar heads on a causal-LM body: the reward model and PPO's value model.

One module serves both, because they are the same network read at different places:
a reward model reads the scalar at the last non-pad token of each sequence, a value model reads
it at every token. Holding the whole `AutoModelForCausalLM` (not only its base) keeps the saved
directory a normal HF checkpoint that `from_pretrained` loads, and lets PPO initialise a value
model from either a reward model or the policy with the same call. The LM head is never run:
the forward goes through the base transformer (`model.base_model`) only.

Saved layout: the HF model files + `scalar_head.safetensors` (weight [1, hidden], bias [1]) +
`scalar_head.json` ({"kind": "reward"|"value", "offset": float}). `offset` is subtracted from
every score (reward centering: the mean reward on the training data becomes 0).

An `AutoModelForSequenceClassification` checkpoint (num_labels=1) is also accepted: its `score`
layer becomes the head and its body the base.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from tether.errors import UserError
from tether.models.logprobs import saved_activations

HEAD_WEIGHTS = "scalar_head.safetensors"
HEAD_CONFIG = "scalar_head.json"


def last_token_index(attention_mask: Tensor) -> Tensor:
    """Index of the last non-pad position of each row; right *or* left padding.

    For left padding the last real token is always at T-1; for right padding it is the last 1.
    Taking the largest index whose mask is 1 covers both (and ragged masks with holes).
    """
    T = attention_mask.shape[-1]
    pos = torch.arange(T, device=attention_mask.device).expand_as(attention_mask)
    idx = torch.where(attention_mask.bool(), pos, torch.full_like(pos, -1)).amax(-1)
    if (idx < 0).any():
        raise ValueError("a row of the attention mask is all padding; it has no last token")
    return idx


class Fp32Linear(nn.Linear):
    """A scalar head's Linear, computed in fp32 whatever its weight's dtype (a bf16 checkpoint, a
    bf16 gather) and outside autocast: scores are compared across sequences, and bf16 rounding of a
    scalar (8 bits of mantissa) would flip close pairs. A module call, so that under FSDP2 the
    unit of its own (distributed.shard, `fp32_unit`: gathered without the bf16 policy) is gathered."""
    fp32_unit = True

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            b = self.bias
            return F.linear(x.float(), self.weight.float(), None if b is None else b.float())


class ScalarHeadModel(nn.Module):
    """Causal-LM body + Linear(hidden, 1). `forward` gives per-token scalars [B, T]."""

    def __init__(self, body: nn.Module, kind: str = "reward", offset: float = 0.0,
                 head: nn.Linear | None = None):
        super().__init__()
        self.body = body
        self.kind = kind
        self.offset = float(offset)
        hidden = body.config.hidden_size
        if head is None:
            head = nn.Linear(hidden, 1)
            # Small init: a fresh head starts near 0 for every input, so the first BT loss is log 2
            # and the first value estimates do not swamp the returns.
            nn.init.normal_(head.weight, std=1.0 / (hidden + 1) ** 0.5 * 0.1)
            nn.init.zeros_(head.bias)
        p = next(body.parameters())
        self.head = head.to(device=p.device, dtype=torch.float32)
        self.head.__class__ = Fp32Linear  # (a loaded head is a plain nn.Linear: same layout)

    @property
    def config(self):
        return self.body.config

    def _base(self):
        base = getattr(self.body, "base_model", None)
        return base if base is not None and base is not self.body else self.body

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        """Recompute the body's activations in backward (the head is one matmul: nothing to save)."""
        self.body.gradient_checkpointing_enable(**kwargs)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        if attention_mask is None and position_ids is None:
            attention_mask = torch.ones_like(input_ids)
        # (position ids and no mask: a packed batch, tether.data.pack_batch; transformers takes
        # the sequences' boundaries from the positions, which a mask of ones would hide)
        if position_ids is None:
            # Left padding must not shift positions: count from the first real token.
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        with saved_activations(input_ids.device):
            out = self._base()(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        score = self.head(h)  # in fp32 (Fp32Linear)
        return score.squeeze(-1) - self.offset

    def score(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Sequence score r(x, y) [B]: the scalar at each row's last non-pad token."""
        values = self(input_ids, attention_mask, position_ids)
        idx = last_token_index(attention_mask)
        return values.gather(-1, idx[:, None]).squeeze(-1)

    # -- persistence -----------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path, tokenizer=None, state_dict: dict | None = None,
                        **_) -> None:
        """`state_dict`: this module's weights to write instead of its own (a sharded model's,
        gathered onto rank 0 by distributed.full_state_dict: its shards are not whole tensors)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        body = None if state_dict is None else \
            {k[len("body."):]: v for k, v in state_dict.items() if k.startswith("body.")}
        self.body.save_pretrained(out_dir, safe_serialization=True, state_dict=body)  # (RunDir passes kwargs too)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
        head = {"weight": self.head.weight, "bias": self.head.bias} if state_dict is None else \
            {"weight": state_dict["head.weight"], "bias": state_dict["head.bias"]}
        save_file({k: v.detach().float().cpu().contiguous() for k, v in head.items()}, str(out_dir / HEAD_WEIGHTS))
        (out_dir / HEAD_CONFIG).write_text(json.dumps({"kind": self.kind, "offset": self.offset}) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | Path, kind: str | None = None, dtype: str = "auto",
                        device: str = "auto", attn_implementation: str | None = None) -> "ScalarHeadModel":
        """Load a saved scalar-head model, a sequence-classification checkpoint, or a plain causal
        LM (then the head is fresh: how a reward/value model starts from the SFT policy)."""
        from transformers import AutoConfig, AutoModelForSequenceClassification

        from tether.models.load import load_model, model_source, resolve_device, resolve_dtype

        path = Path(model_source(str(path)))  # a .gguf file: its converted folder
        if (path / HEAD_WEIGHTS).exists():
            meta = json.loads((path / HEAD_CONFIG).read_text()) if (path / HEAD_CONFIG).exists() else {}
            body = load_model(str(path), dtype=dtype, device=device, attn_implementation=attn_implementation)
            model = cls(body, kind=kind or meta.get("kind", "reward"), offset=meta.get("offset", 0.0))
            w = load_file(str(path / HEAD_WEIGHTS))
            with torch.no_grad():
                model.head.weight.copy_(w["weight"])
                model.head.bias.copy_(w["bias"])
            return model
        try:
            archs = AutoConfig.from_pretrained(str(path)).architectures or []
        except Exception as e:  # noqa: BLE001
            raise UserError(f"cannot load a reward/value model from '{path}': {str(e).splitlines()[0]}") from None
        if any(a.endswith("ForSequenceClassification") for a in archs):
            dev = resolve_device(device)
            kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
            seq = AutoModelForSequenceClassification.from_pretrained(
                str(path), dtype=resolve_dtype(dtype, dev), **kw).to(dev)
            if seq.config.num_labels != 1:
                raise UserError(f"'{path}': a reward model needs num_labels=1, found {seq.config.num_labels}")
            score = seq.score
            head = nn.Linear(score.in_features, 1, bias=score.bias is not None)
            with torch.no_grad():
                head.weight.copy_(score.weight)
                if score.bias is None:
                    head.bias = nn.Parameter(torch.zeros(1))
                else:
                    head.bias.copy_(score.bias)
            return cls(seq, kind=kind or "reward", head=head)
        return cls(load_model(str(path), dtype=dtype, device=device, attn_implementation=attn_implementation),
                   kind=kind or "reward")
