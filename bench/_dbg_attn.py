import sys, torch
from tether.rollout import attention
import triton; print("triton", triton.__version__)
dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
G, D = int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator(device="cuda").manual_seed(0)
B, Hkv, S, slots = 5, 2, 150, 201
q = torch.randn(B, Hkv, G, D, device="cuda", generator=g).to(dtype)
kc = torch.randn(B, Hkv, slots, D, device="cuda", generator=g).to(dtype)
vc = torch.randn(B, Hkv, slots, D, device="cuda", generator=g).to(dtype)
bias = torch.zeros(B, slots, device="cuda", dtype=dtype)
bias[0, :20] = float("-inf")
k, v, b = kc[:, :, :S], vc[:, :, :S], bias[:, :S]
want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=b.float()[:, None, None], scale=D ** -0.5)
got = attention.decode_attention(q, k, v, b, D ** -0.5)
torch.cuda.synchronize()
print(sys.argv[1:], "max diff", (got.float() - want).abs().max().item(), "nan", got.isnan().any().item())
