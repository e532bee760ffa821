"""The sampler's decode state and its CUDA graphs: what lets one decode step be captured once and
replayed.

A captured graph replays the same kernels on the same memory, so every tensor a step touches is
allocated once (:class:`State`) and the shapes come in buckets: batch sizes (:func:`bucket`) and
cache lengths (:func:`round_up`; the slots a step attends over: ``engine.KV_BUCKET``), so nearby
sizes reuse one graph. :func:`capture` records a step without disturbing the rows being decoded.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor


# Held by every CUDA graph capture, and by a trainer thread around its GPU work while a sampler
# thread of the same process may capture (trajectories.asynchronous.Interleaved): a capture that overlapped the
# other thread's GPU work fails ("operation failed due to a previous error during capture", H200,
# with both threads capturing on torch's one default capture stream; capture says why each Sampler
# has its own).
CAPTURE_LOCK = threading.RLock()


_capture_streams: dict = {}  # (device, raw stream) -> live Samplers holding it
_streams_lock = threading.Lock()


def take_stream(device) -> "torch.cuda.Stream":
    """A CUDA stream for one Sampler's warm-ups and graph captures that no other live Sampler holds
    (capture says why): torch hands out its 32 pooled streams a priority in turn, whatever their
    owners, so a stream comes back after 32 requests — a process that makes Samplers often (SFT's
    sample points) would otherwise get a live one's again. Shared only if all 32 are held."""
    with _streams_lock:
        for _ in range(32):
            s = torch.cuda.Stream(device=device)
            if (s.device, s.cuda_stream) not in _capture_streams:
                break
        key = (s.device, s.cuda_stream)
        _capture_streams[key] = _capture_streams.get(key, 0) + 1
        return s


def give_stream(key) -> None:
    """`take_stream`'s stream back (its holder's graphs are gone); key = (device, raw stream)."""
    with _streams_lock:
        n = _capture_streams.pop(key, 0) - 1
        if n > 0:
            _capture_streams[key] = n


def bucket(n: int) -> int:
    """Batch sizes that get a CUDA graph: powers of two up to 8, then multiples of 16, then of 64."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    step = 16 if n <= 256 else 64
    return -(-n // step) * step


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class State:
    """Every tensor a decode step touches, allocated once so a captured graph can keep pointing at it.
    Row ``rows`` and column ``steps`` of the output buffers are scratch space that graph warm-up
    writes into (its cache writes go to a slot no real token occupies yet), so capturing mid-run
    never disturbs real rows."""

    def __init__(self, rows: int, slots: int, steps: int, device, dtype):
        z = dict(device=device)
        self.rows, self.slots, self.steps = rows, slots, steps
        self.tokens = torch.zeros(rows, dtype=torch.long, **z)
        self.pos = torch.zeros(rows, dtype=torch.long, **z)
        # additive attention mask over cache slots: 0 where a row may attend, -inf elsewhere
        self.bias = torch.full((rows, slots + 1), float("-inf"), dtype=dtype, **z)
        self.finished = torch.ones(rows, dtype=torch.bool, **z)
        self.row_id = torch.full((rows,), rows, dtype=torch.long, **z)  # output row of each batch row
        self.slot = torch.zeros(1, dtype=torch.long, **z)
        self.step = torch.zeros(1, dtype=torch.long, **z)
        self.u = torch.zeros(rows + 1, steps + 1, **z)
        self.out_tok = torch.zeros(rows + 1, steps + 1, dtype=torch.long, **z)
        self.out_logp = torch.zeros(rows + 1, steps + 1, **z)
        # multi-turn episodes (engine.Episodes): tokens the environment forces at a step instead of
        # a sampled one, and what each step's output is: 0 nothing (the row was finished or
        # waiting), 1 a model token, 2 an environment (observation) token
        self.force_tok = torch.zeros(rows + 1, steps + 1, dtype=torch.long, **z)
        self.force_on = torch.zeros(rows + 1, steps + 1, dtype=torch.bool, **z)
        self.out_kind = torch.zeros(rows + 1, steps + 1, dtype=torch.int8, **z)

    def small(self) -> list[Tensor]:
        return [self.tokens, self.pos, self.finished, self.slot, self.step]


class EagerGraph:
    """Stand-in for a CUDA graph on CPU (tests of the graph path): replay runs the step."""

    def __init__(self, fn):
        self.replay = fn


def capture(step, st: State, kv: int, side=None, pool=None):
    """``step`` (a decode step over ``st`` attending over ``kv`` slots) captured in a CUDA graph that
    warms up on stream ``side`` and allocates from ``pool`` (None: a new one, ``g.pool()``); with
    ``side`` None (CPU: the tests' emulation) the same bookkeeping, and an :class:`EagerGraph`.

    Warm-up runs execute the step for real, so they are pointed at the scratch slot and output
    column and the small state is restored afterwards: capturing mid-run (after compaction)
    leaves every real row as it was."""
    saved = [t.clone() for t in st.small()]

    def scratch_state():
        for t, s in zip(st.small(), saved):
            t.copy_(s)
        # the last attended slot: never one a real token already sits in (it is >= the slot the
        # next real step writes), and unmasked by the warm-up step, so no row attends to nothing
        st.slot.fill_(kv - 1)
        st.step.fill_(st.steps)

    if side is None:
        scratch_state()
        step()
        g = EagerGraph(step)
    else:
        # one capture at a time in the process, and none while a trainer thread holding the lock
        # works on the GPU (the queue's interleaved placement, trajectories.asynchronous.Interleaved)
        with CAPTURE_LOCK:
            torch.cuda.synchronize()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # first calls create cuBLAS handles / pick kernels off-capture
                    scratch_state()
                    step()
            torch.cuda.current_stream().wait_stream(side)
            scratch_state()
            g = torch.cuda.CUDAGraph()
            # thread_local: the interleaved placement's sampler thread captures while the trainer
            # thread may sync and allocate (outside its GPU work); the default (global) mode fails
            # those calls with "operation not permitted when stream is capturing" (seen on an H200).
            # stream=side, the caller's own (one per live Sampler: take_stream), not torch's one
            # default capture stream: graphs captured on one stream share its cuBLAS workspace, and
            # destroying any of them drops that workspace under the others alive (pytorch#193402),
            # whose GEMMs would then use freed memory with two Samplers in one process (the
            # interleaved placement's thread and the trainer's evaluation). Defensive: the GPU
            # regression test (tests/test_rollout_gpu.py) passes without it on torch 2.11 / H100,
            # and it is not what made the interleaved placement's eval points score low (those
            # sampled the fp32 weights, trajectories.asynchronous.Interleaved). A Sampler destroys its graphs
            # all together (release, a larger cache): its own share is safe.
            with torch.cuda.graph(g, pool=pool, stream=side, capture_error_mode="thread_local"):
                step()
    for t, s in zip(st.small(), saved):
        t.copy_(s)
    st.bias[:, kv - 1] = float("-inf")  # the real step unmasks it when it writes there
    return g
