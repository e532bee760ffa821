"""Diagnostic: where a GRPO step's time and memory go on GPU (rollout vs train micro-batches).

    python bench/profile_grpo.py   # prints a phase table; not a benchmark (no comparison)
"""
import sys, tempfile, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import build, make_prompts, load_tok  # noqa: E402
from tether.models import load_model
from tether.objectives import policy_loss
from tether.rollout import Sampler, SamplingConfig
from tether.trainers.common import make_optimizer, autocast_context
from tether.trainers.common import completion_token_logps


def mem():
    torch.cuda.synchronize()
    return f"alloc {torch.cuda.memory_allocated()/1e9:.2f} peak {torch.cuda.max_memory_allocated()/1e9:.2f} reserved {torch.cuda.memory_reserved()/1e9:.2f} peak_res {torch.cuda.max_memory_reserved()/1e9:.2f}"


work = Path(tempfile.mkdtemp())
V = build("qwen0.5b", work / "m")
tok = load_tok(work / "m")
model = load_model(str(work / "m"), dtype="bf16", device="cuda")
print("loaded", mem())
opt = make_optimizer(model, 1e-6, 0.0, betas=(0.9, 0.99))
prompts = [tok(p).input_ids for p in make_prompts(8, 128, V)]
s = Sampler(model, tok, SamplingConfig(max_new_tokens=256, temperature=1.0))
amp = autocast_context(torch.device("cuda"), "auto")
for rep in range(3):
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter(); ro = s.sample(prompts, n=8, seed=rep); torch.cuda.synchronize()
    print(f"rep {rep} sample {time.perf_counter()-t:.3f}s", ro.stats.get("ms_per_step"), mem())
    tb = {k: v.cuda() for k, v in ro.training_batch().items()}
    adv = torch.randn(64, device="cuda")
    for mb_size in (8, 16):
        for ent in (True, False):
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            for i in range(0, 64, mb_size):
                mb = {k: v[i:i+mb_size] for k, v in tb.items()}
                logps, e = completion_token_logps(model, mb, 1.0, amp, want_entropy=ent)
                loss, m = policy_loss(logps, mb["logprobs"], adv[i:i+mb_size], mb["completion_mask"])
                (loss * mb_size / 64).backward()
                float(loss)
            torch.cuda.synchronize(); tt = time.perf_counter() - t
            t = time.perf_counter(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad(set_to_none=True); torch.cuda.synchronize()
            print(f"  mb {mb_size} entropy {ent}: fwd+bwd {tt:.3f}s opt {time.perf_counter()-t:.3f}s", mem())
    if rep == 1:
        s.release(); torch.cuda.empty_cache(); print("released", mem())

# torch.compile of the training forward (default mode): launch-bound small models fuse norms/acts
cm = torch.compile(model, dynamic=True)
for rep in range(3):
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for i in range(0, 64, 8):
        mb = {k: v[i:i+8] for k, v in tb.items()}
        logps, e = completion_token_logps(cm, mb, 1.0, amp, want_entropy=True)
        loss, m = policy_loss(logps, mb["logprobs"], adv[i:i+8], mb["completion_mask"])
        (loss * 8 / 64).backward()
        float(loss.detach())
    torch.cuda.synchronize()
    print(f"compiled rep {rep}: fwd+bwd {time.perf_counter()-t:.3f}s", mem())
