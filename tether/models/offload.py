"""Activations kept for backward in pinned host memory (`model.offload_activations`).

A training forward saves tensors for its backward; under gradient checkpointing these are mostly
each decoder layer's input, [B, T, hidden] a layer (Qwen2.5-0.5B at 32 × 384 tokens in bf16: 22 MB a
layer, 0.53 GB for 24), the step's largest hold after the weights, gradients and optimizer state.
`host_activations()` is a `torch.autograd.graph.saved_tensors_hooks` context that, on CUDA:

- pack: copies each saved activation of at least `min_bytes` into a pinned host buffer on a side
  stream, which waits for the compute stream only up to the tensor's producer; the device tensor is
  marked as used by that stream (`record_stream`) and released, so its memory returns to the
  allocator as soon as the copy is done. Parameters are never copied (the optimizer owns them), and
  one tensor saved by several ops (a mask every layer reads) is copied once.
- unpack: backward reads the saved tensors in reverse order; reading one starts, on the side
  stream, the copy back of the one saved before it, so the next layer's input is on the device
  by the time its backward starts. The compute stream waits for exactly that copy.

Values are bit-identical (copies, no casts). The cost is two copies of the saved bytes over PCIe a
micro-batch, overlapped with the layers' compute; what stays on the device is the tensors in flight
(about two layers' inputs) instead of every layer's. Pinned buffers are pooled by capacity and
reused from micro-batch to micro-batch, so the host allocates them once. On CPU the context does
nothing: the activations already live in host memory.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict

import torch

MIN_BYTES = 1 << 20
"tensors smaller than this stay on the device: their copies would cost more launches than bytes"


class _Pool:
    """Pinned host buffers by capacity (the next power of two of a tensor's elements) and dtype,
    reused once their tensor's backward has read them. Sequence lengths change from step to step;
    rounding keeps the buckets few, so the pool holds about what one micro-batch needs at most,
    within a factor of two, instead of a set of buffers for every length seen."""

    def __init__(self):
        self.free: dict[tuple, list[torch.Tensor]] = defaultdict(list)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A pinned buffer of at least like's elements (1-D, its full capacity)."""
        key = (1 << (like.numel() - 1).bit_length(), like.dtype)
        bucket = self.free[key]
        return bucket.pop() if bucket else torch.empty(key[0], dtype=like.dtype, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        self.free[(buf.numel(), buf.dtype)].append(buf)


class _Saved:
    """One offloaded tensor: its pinned buffer, the host copy (a view of it in the tensor's shape),
    and its device copy once fetched back."""

    __slots__ = ("buf", "host", "where", "device", "ready", "pool", "__weakref__")

    def __init__(self, buf, like, pool):
        self.buf, self.host, self.where = buf, buf[:like.numel()].view(like.shape), like.device
        self.device, self.ready, self.pool = None, None, pool

    def __del__(self):  # the autograd graph let go of it: the buffer serves a later micro-batch (its
        self.pool.give(self.buf)  # copies run on the side stream, after this one's copy back)


class HostActivations:
    """The hooks' state for one process: a side stream, the buffer pool, and the tensors packed in
    the current forward, in order (unpack fetches the one before)."""

    def __init__(self, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        self.stream = torch.cuda.Stream()
        self.pool = _Pool()
        self.order: list[_Saved] = []
        self.seen: dict[int, tuple] = {}

    def pack(self, t: torch.Tensor):
        if (not t.is_cuda or isinstance(t, torch.nn.Parameter) or not t.is_contiguous()
                or t.numel() * t.element_size() < self.min_bytes):
            return t
        ref, known = self.seen.get(id(t), (None, None))
        if ref is not None and ref() is t:  # saved again by another op: one copy
            return known
        saved = _Saved(self.pool.take(t), t, self.pool)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            saved.host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # its memory is not reused before the copy has read it
        self.seen[id(t)] = (weakref.ref(t), saved)  # weak: a freed tensor's id may come back
        self.order.append(saved)
        return saved

    def _fetch(self, saved: _Saved) -> None:
        if saved.device is None:
            with torch.cuda.stream(self.stream):
                saved.device = saved.host.to(saved.where, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(self.stream)

    def unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        self._fetch(saved)
        here = torch.cuda.current_stream()
        here.wait_event(saved.ready)
        t, saved.device, saved.ready = saved.device, None, None  # backward holds it now, not us
        t.record_stream(here)  # allocated on the side stream, read and freed on this one
        i = next((k for k in range(len(self.order) - 1, -1, -1) if self.order[k] is saved), None)
        if i is not None:  # the tensors saved before this one are read next: start the one before
            del self.order[i:]
            if i > 0:
                self._fetch(self.order[i - 1])
        return t

    @contextlib.contextmanager
    def hooks(self):
        self.seen, self.order = {}, []  # a forward whose backward never ran leaves nothing behind
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield
        self.seen = {}


_STATE: HostActivations | None = None


def host_activations(device: torch.device | str | None = None):
    """The context to run a training forward in, with its saved activations on the host; a no-op
    off CUDA. One state a process (its stream and buffers), made at the first use."""
    global _STATE
    if torch.device(device or "cuda").type != "cuda" or not torch.cuda.is_available():
        return contextlib.nullcontext()
    if _STATE is None:
        _STATE = HostActivations()
    return _STATE.hooks()
