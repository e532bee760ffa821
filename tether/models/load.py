"""Load and save any Hugging Face causal LM and its tokenizer.

Thin on purpose: `from_pretrained` does the work; we pick dtype/device/attention, give the
tokenizer a pad token when it has none (most base models), and turn a missing path into one line.
"""

from __future__ import annotations

import contextlib
import functools

from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.errors import UserError

DTYPES = {"auto": "auto", "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device):
    """'auto' = bf16 weights on a GPU that supports it, fp32 on CPU (CPU bf16 matmuls are slow
    and lose precision for no memory we need there)."""
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return DTYPES[dtype]


def model_source(path: str) -> str:
    """What `from_pretrained` is given for a model path: the path itself, or for a `.gguf` file its
    converted bf16 folder (tether.models.gguf, converted once into a cache). Every loader of a
    model path (tokenizer, causal LM, reward/value heads, the stored dtype) goes through here, so
    `model=<file.gguf>` works wherever a model path does, and is converted in this one place."""
    path = str(path)
    if path.lower().endswith(".gguf"):
        from tether.models.gguf import ensure_converted
        return str(ensure_converted(path))
    # A string that looks like a local path but is not there is a typo, not a hub id: say so
    # instead of letting the hub client fail with a long network traceback.
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1
    if looks_local and not Path(path).expanduser().exists():
        raise UserError(f"model path '{path}' does not exist")
    return path


def load_tokenizer(path: str, padding_side: str = "right"):
    path = model_source(path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one line for the user
        raise UserError(f"cannot load tokenizer from '{path}': {str(e).splitlines()[0]}") from None
    if tok.pad_token is None:
        # Base models often ship without a pad token; EOS is the usual stand-in. Masks, not the
        # pad id, decide what is trained on, so this is safe.
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def load_model(path: str, dtype: str = "auto", device: str = "auto",
               attn_implementation: str | None = None, gguf_file: str | None = None,
               trust_remote_code: bool = False):
    """`AutoModelForCausalLM.from_pretrained` with our dtype/device conventions.

    A `path` ending in .gguf is converted once to a bf16 HF folder and loaded from there
    (model_source). `gguf_file` instead hands the file to transformers' GGUF loader as it is.
    """
    if not gguf_file:
        path = model_source(path)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    kwargs = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if gguf_file:  # unpacked into dense tensors, as tether.models.gguf does: trainable and savable
        from transformers import GgufConfig
        kwargs.update(gguf_file=gguf_file, quantization_config=GgufConfig(dequantize=True))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot load model from '{path}': {str(e).splitlines()[0]}") from None
    quantizer = getattr(model, "hf_quantizer", None)
    if gguf_file and quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model.to(dev)


def model_out_dir(out: str, overwrite: bool) -> Path:
    """`out` as the directory a command writes a whole model into (`tether init-model`, `tether
    convert`): refused in one line when it is a file, or already holds a model and `overwrite` is off."""
    if not out:
        raise UserError("`out` is required (the directory to write the model to)")
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"out '{out}' is a file, not a directory")
    if (path / "config.json").exists() and not overwrite:
        raise UserError(f"'{out}' already holds a model; choose another out= or "
                        f"replace it with overwrite=true")
    return path


def quiet_hf_progress() -> Callable[[], None]:
    """Silence the progress bars transformers and huggingface_hub draw themselves ("Loading
    weights", "Writing model shards", downloads) and return a function that puts back the state
    found here, so `run.progress=false` means no bars without changing a caller's own setting
    for good. The state is transformers' flag plus the hub's table (which its
    `disable_progress_bars` clears): both are restored as they were."""
    import importlib
    import warnings

    from transformers.utils import logging as hf_logging

    # the module, not the `tqdm` class huggingface_hub.utils exports under the same name
    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")

    was_on = hf_logging.is_progress_bar_enabled()
    hub_states = dict(hub_tqdm.progress_bar_states)
    with warnings.catch_warnings():  # HF_HUB_DISABLE_PROGRESS_BARS=0 wins and says so: nothing to do
        warnings.simplefilter("ignore")
        hf_logging.disable_progress_bar()

    def restore() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if was_on:
                hf_logging.enable_progress_bar()
        hub_tqdm.progress_bar_states.clear()
        hub_tqdm.progress_bar_states.update(hub_states)
    return restore


@contextlib.contextmanager
def hf_progress(enabled: bool):
    """Hugging Face's own bars on (as the caller has them) or off (:func:`quiet_hf_progress`) for
    the `with` block, put back when it ends, by an exception too: trainers wrap the calls that
    draw them (loading weights, writing shards), so a run that fails leaves nothing changed."""
    restore = (lambda: None) if enabled else quiet_hf_progress()
    try:
        yield
    finally:
        restore()


def stored_dtype(path: str) -> torch.dtype | None:
    """The dtype a checkpoint's weights are stored in, per its config.json (`dtype`, or
    `torch_dtype` in older files); None when it does not say."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model_source(path))
    except Exception:  # noqa: BLE001 - unknown means "do not convert", never an error here
        return None
    value = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(value, str):
        value = DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


def save_model(model, tokenizer, out_dir: str | Path) -> None:
    """HF format (config.json, model.safetensors, tokenizer files): loadable by anyone."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def compile_layers(model, **options) -> int:
    """torch.compile every decoder layer of a HF causal LM in place; returns how many. `options` go
    to torch.compile (tests: backend="eager").

    Why layers and not the model: the training forward is launch-bound at these sizes (H100,
    Qwen2.5-0.5B, 16 × 384 tokens: 0.22 s of kernels in 0.53 s of forward+backward), and most
    launches are a layer's small elementwise ops (RMSNorm, RoPE, SiLU·up, residual adds), which
    Inductor fuses. The layers share one compiled graph (same code, parameters as inputs), so the
    compile cost does not grow with depth; the LM head stays ours (`_HeadLogps`), the sampler keeps
    its own forward over the same parameters.

    dynamic=True: the sequence length changes from batch to batch (a GRPO step's longest
    completion, a DPO batch's longest pair), and a graph compiled for the first length is compiled
    again at the second (dynamic after that). On 2 H200s that recompilation stalled SmolLM2-135M's
    GRPO steps for 9-10 s twice in 100 steps (synchronous; 3-4 s in the disaggregated trainer), at
    the step where the longest completion first fell below max_new_tokens.

    dynamic="sequence" (an A/B, not the default): only the sequence length is
    symbolic, from the first call (marked on every layer input before the compiled forward runs);
    batch and the other sizes stay static, as torch.compile's own second compilation would make
    them. dynamic=True makes every size symbolic, which may cost each layer call host time: a
    24-layer tiny model's forward + backward on the 2-core dev CPU (3 runs each) took
    18.8–19.3 ms static, 18.1–20.2 length-only, 20.4–21.5 dynamic at the first length; at a
    second length 22.7–23.4 (static, compiled again), 23.3–25.6, 24.2–25.9. A GPU step's host time
    is what bench/dpo_step.py --compile on,static,sequence compares: on an H200 (DPO,
    Qwen2.5-0.5B shape, 8 pairs × 383, cuDNN attention off) 0.096 s dynamic=True, 0.090
    length-only, 0.080 static."""
    layers = decoder_layers(model)
    sequence = options.get("dynamic") == "sequence"
    if sum(checkpoint_inside(layer) for layer in layers) and hasattr(
            torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        # transformers 5.25's hub-kernel layers set a context variable in their forward (the kernels
        # package's CompileableContextVar), which Dynamo refuses inside a traced checkpoint unless told
        # that the recompute need not repeat it: the layer would run uncompiled. The variable is set
        # and reset within the forward, and the traced graph has already chosen its kernels.
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in layers:
        if sequence:  # the hook runs outside the compiled forward, so its marks reach the first trace
            layer.forward = torch.compile(layer.forward, **{**options, "dynamic": None})
            layer.register_forward_pre_hook(_mark_sequence_dynamic, with_kwargs=True)
        else:
            layer.compile(**{"dynamic": True, **options})
    return len(layers)


def checkpoint_inside(layer) -> bool:
    """Move a checkpointed decoder layer's activation checkpoint into its `forward`, so the region
    compile_layers compiles holds it; returns whether the layer was checkpointed.

    transformers 5.17 checkpoints a layer around `__call__`: the compiled forward runs once in
    forward and again, as a second compiled call, when backward recomputes it (one H200 GRPO step
    of Qwen2.5-0.5B, 16 × 384 tokens a micro-batch: 24 recompute calls, 37 of the backward's 130
    host ms under the profiler). Inside the compiled region the checkpoint is traced as one
    higher-order op: the forward graph keeps the layer's inputs, as the eager checkpoint does, and
    the backward graph recomputes the layer and takes its gradients in one call, the recompute's
    elementwise ops fused with the gradient's. Later transformers checkpoint `forward` themselves;
    the layer's own checkpoint is switched off either way, so it runs once. Non-reentrant (the
    variant torch.compile traces), with the RNG state kept as the eager checkpoint keeps it."""
    if not getattr(layer, "gradient_checkpointing", False):
        return False
    from torch.utils.checkpoint import checkpoint

    forward = layer.forward
    layer.gradient_checkpointing = False  # its own wrapper now calls the plain forward

    def forward_checkpointed(*args, **kwargs):
        module = forward.__self__
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        if kwargs.get("use_cache"):  # a recompute must not write a cache a second time
            kwargs["use_cache"] = False
        for name in ("past_key_values", "cache", "layer_past"):
            if kwargs.get(name) is not None:
                kwargs[name] = None
        return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=False)

    layer.forward = forward_checkpointed
    return True


def _mark_sequence_dynamic(module, args, kwargs):
    """A decoder layer's inputs with the sequence length marked dynamic: hidden states [B, T, H],
    RoPE's (cos, sin) [B, T, D], a 4D mask [B, 1, T, T], position ids [B, T], cache positions [T]."""
    mark = torch._dynamo.maybe_mark_dynamic
    hidden = args[0] if args else kwargs.get("hidden_states")
    if torch.is_tensor(hidden):
        mark(hidden, 1)
    for t in kwargs.get("position_embeddings") or ():
        if torch.is_tensor(t) and t.dim() == 3:
            mark(t, 1)
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 4:
        mark(mask, [2, 3])
    for name, dim in (("position_ids", 1), ("cache_position", 0)):
        t = kwargs.get(name)
        if torch.is_tensor(t) and t.dim() > dim:
            mark(t, dim)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a HF causal LM (under LoRA, a reward head or a critic too): the first
    ModuleList of `*DecoderLayer` modules; [] when there is none."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for mod in base.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and type(mod[0]).__name__.endswith("DecoderLayer"):
            return list(mod)
    return []
