"""The sampler: batched prompts of any lengths, n samples each, exact per-token log-probs.

One wave of sequences is decoded like this:

1. prompts are left-padded to a common width P and prefilled into a preallocated KV cache
   (slot s of every row is the s-th column; completion token t lives in slot P + t);
2. every decode step is one shape-static function of a fixed set of state tensors (last tokens,
   positions, slot, additive attention mask, finished flags, output buffers) — on CUDA it is captured once
   per batch size and per KV_BUCKET cache slots attended (early steps don't read the empty end of
   the cache) in a CUDA graph and replayed, so a step costs one launch instead of hundreds;
3. every ``sync_every`` steps the host looks at the finished flags and the new tokens (stop strings
   are matched on decoded text there); when at most half the rows are still running (three quarters
   without graphs), the batch is compacted to the survivors (a smaller graph bucket / fewer rows), so
   finished rows stop costing work.

Sequence i's randomness is its own stream (see sampling.py), so neither compaction, nor sync
timing, nor batch composition changes what a sequence samples. The state tensors and graph capture
are in graphs.py, the forward passes in native.py, stop strings and the final Rollout in finish.py.
"""
from __future__ import annotations

import time
import weakref

import torch
from torch import Tensor

from tether.data.tokenize import bos_ids

import tether.rollout.kernels as kernels
from .finish import StopChecker, assemble, assemble_episodes
from .graphs import State, bucket, capture, give_stream, round_up, take_stream
from .native import HFBackend, NativeBackend, native_support, unwrap
from .sampling import SamplingConfig, draw_seed, sample_tokens, sequence_keys, uniforms
from .types import Rollout

# A captured step attends over a fixed number of cache slots; graphs are captured per multiple of
# this many slots, so a step reads the slots in use rounded up, not the whole cache (attention is
# ~half a decode step at batch 256: on an H100, 74 us per layer over 400 slots).
KV_BUCKET = 64

# Multi-turn calls: at each host check, queue one more decode step behind the check's device read
# before waiting for it, so the GPU works through the host's part of the check (reading the state,
# the environment's replies, scheduling them) instead of draining the queue and idling; the ended
# rows wait one step more, masked, and a turn that ends in that step is answered at the next check.
# None: on where the device runs behind the host (CUDA); on CPU a step runs as it is called, so the
# extra step would only make the ended rows wait longer. On an H200 (bench/rollout.py --turns 64,
# batch 64, pairs of calls, with FUSE_RECORD) the boundaries cost 6.4 % / 7.9 % with it against
# 8.5 % / 8.7 % without (two runs of three pairs, one process). Sampling depends on it (a row's
# random stream is indexed by step); greedy episodes do not.
OVERLAP_TURNS: bool | None = None

# A decode step's bookkeeping after the draw (forced environment tokens, the finished rows' padding,
# the outputs, the end check as one load from the end-token table) in one Triton kernel on CUDA
# (kernels.record_step) instead of 8 torch ops, 19 in a multi-turn call. On an H200 (Qwen2.5-0.5B
# shape, batch 64) the single-turn decode step ran 230 kernels and 1.151 ms against 237 and
# 1.16-1.19 ms; multi-turn pairs (bench/rollout.py --turns 64) cost 8.5 % / 8.7 % against
# 10.2 % / 9.8 % with torch's ops (two runs of three pairs, one process).
FUSE_RECORD = True

# A prompt sampled several times (a GRPO group's n completions, the same environment reset) is
# prefilled once: its KV cache rows are copied to the other rows (backend.select) and each row draws
# its first token from the shared logits with its own random stream. When the distinct prompts fit
# one prefill chunk (so the logits held are no more than an unshared chunk's). A GRPO step of 8
# prompts x 8 (Qwen2.5-0.5B shape, 128-token prompts) prefills 8 rows in one chunk instead of 64 in
# four; on an H200 its rollout took 0.352 s against 0.355-0.371 s unshared (two runs, different
# machines): the prefill is a small part of it at these lengths, a larger one at long prompts.
SHARE_PREFILL = True

_DEFAULT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class Sampler:
    """Sampling engine bound to one model (and its tokenizer, for string prompts, texts and stops).

    Keep one per model: the KV cache, state buffers and CUDA graphs are reused across calls (the
    graphs read the model's parameters in place, so optimizer steps between calls are seen).
    :meth:`release` frees them, e.g. before a memory-hungry training step.
    """

    def __init__(self, model, tokenizer=None, config: SamplingConfig | None = None, **overrides):
        self.model, self.tokenizer = model, tokenizer
        self.config = config or SamplingConfig()
        if overrides:
            self.config = _replace(self.config, overrides)
        self.backend = self.state = None
        self.graphs: dict = {}
        self.pool = None
        self._side = None  # the CUDA stream this Sampler's graphs warm up and are captured on
        self._give_side = None  # hands it back (graphs.give_stream) on release or when collected
        self._fingerprint = None
        self._emulate_graphs = False  # tests: run the graph code path on CPU (see _graph)
        self._episodes = None  # the wave's turn bookkeeping while a multi-turn call decodes (_Turns)
        self._stream = None  # the wave's streaming callback while a call with stream= decodes (_Stream)
        self._host = None  # the host's copy of the wave's state at its checks (_Host)
        # A flat tensor the KV cache may live in (native backend; when large enough and of the
        # model's dtype): the RL trainers lend their gradient buffer, idle while sampling. Its
        # contents are overwritten by every call; the lender must not need them meanwhile.
        self.kv_storage: Tensor | None = None
        gen = getattr(unwrap(model), "generation_config", None)
        eos = set()
        for src in (getattr(tokenizer, "eos_token_id", None), getattr(gen, "eos_token_id", None)):
            eos.update([src] if isinstance(src, int) else (src or []))
        self.model_eos = eos
        self.eos: list[int] = sorted(eos)
        self._eos_tensors: dict = {}  # one per end-token set, kept alive for the graphs that read it
        pad = getattr(tokenizer, "pad_token_id", None)
        for src in (getattr(unwrap(model).config, "pad_token_id", None), getattr(gen, "pad_token_id", None)):
            pad = src if pad is None else pad
        self.pad = int(pad if pad is not None else (min(eos) if eos else 0))

    # ---------------------------------------------------------------- public API
    @torch.no_grad()
    def sample(self, prompts, n: int = 1, seed: int | None = None, only=None, episodes=None,
               stream=None, **overrides) -> Rollout:
        """Sample ``n`` completions per prompt. ``prompts``: strings (BOS prepended, see
        ``add_bos``) or token-id lists; ``overrides``: any :class:`SamplingConfig` field.
        ``only``: indices of the prompts to sample (default all). The others still count toward a
        prompt's occurrence number in the random streams' keys, so a process sampling its share of
        a batch (a torchrun rank) draws what sampling the whole batch draws for those prompts,
        repeated prompts included; the rollout holds only the chosen prompts, in ``only``'s order.

        ``episodes``: multi-turn sampling (:class:`Episodes`). A sequence's turn ends at an end
        token; ``episodes.turn_ended(i, ids)`` gets the turn's sampled ids and returns the
        environment's reply as token ids, which are fed to the model (teacher-forced, one per decode
        step, in the same KV cache) before it samples its next turn — or None to end the episode.
        ``max_new_tokens`` then bounds the whole episode (the model's and the environment's tokens).
        The rollout's ``completion_mask`` holds the model's tokens only; ``observation_mask`` the
        environment's.

        ``stream``: ``stream(seq, ids)`` is called at every host check (every ``sync_every`` decode
        steps) with the ids sequence ``seq`` sampled since the previous call, up to and including
        the token that ends it; what it gets over a call is the sequence's completion (single-turn
        calls only; a host-side hook: the decode step and its CUDA graphs are unchanged)."""
        cfg = _replace(self.config, overrides) if overrides else self.config
        if cfg.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if episodes is not None and (cfg.stop or cfg.ignore_eos):
            raise ValueError("multi-turn episodes end a turn at an end token: no stop strings, no ignore_eos")
        if episodes is not None and stream is not None:
            raise ValueError("stream is for single-turn calls, not multi-turn episodes")
        self.eos = sorted(self.model_eos | set(cfg.stop_token_ids))
        seqs, group = [], []
        for i, p in enumerate([prompts] if isinstance(prompts, str) else prompts):
            ids = self._encode(p, cfg)
            seqs += [ids] * n
            group += [i] * n
        seed = draw_seed() if seed is None else int(seed)
        keys = sequence_keys(seed, seqs)
        if only is not None:
            pick = [i * n + k for i in only for k in range(n)]
            seqs, keys, group = [seqs[j] for j in pick], [keys[j] for j in pick], [j // n for j in range(len(pick))]
        if not seqs:
            raise ValueError("no prompts")
        was_training = self.model.training
        self.model.eval()
        try:
            stats = {"prefill_s": 0.0, "decode_s": 0.0, "capture_s": 0.0, "decode_steps": 0}
            t0 = time.perf_counter()
            wave = cfg.max_batch_size or len(seqs)
            parts = []
            for i in range(0, len(seqs), wave):
                self._episodes = None if episodes is None else _Turns(episodes, i, seqs[i:i + wave])
                self._stream = None if stream is None else _Stream(stream, i, len(seqs[i:i + wave]),
                                                                   [] if cfg.ignore_eos else self.eos)
                parts.append(self._wave(seqs[i:i + wave], keys[i:i + wave], cfg, stats))
            if episodes is None:
                out = assemble(seqs, group, parts, cfg, self.eos, self.pad, self.tokenizer, self._device())
            else:
                out = assemble_episodes(seqs, group, parts, cfg, self.pad, self.tokenizer, self._device(),
                                        episodes)
            stats["total_s"] = time.perf_counter() - t0
        finally:
            self._episodes = self._stream = None
            self.model.train(was_training)
        tokens = int(out.completion_mask.sum())
        gen_s = stats["prefill_s"] + stats["decode_s"]
        stats.update(tokens=tokens, sequences=len(seqs), tokens_per_s=tokens / max(gen_s, 1e-9),
                     ms_per_step=1e3 * stats["decode_s"] / max(stats["decode_steps"], 1),
                     backend=self.backend.name if self.backend else None)
        out.stats = stats
        return out

    def kv_cache_elements(self, sequences: int, max_len: int) -> int | None:
        """Elements of the KV cache (keys + values) a call of `sequences` sequences of up to
        `max_len` tokens allocates, after the batch and slot rounding of the CUDA-graph path (an
        upper bound elsewhere); None when the native backend would not run (no static cache)."""
        cfg = self.config
        if cfg.backend == "hf" or native_support(self.model, max_len) is not None:
            return None
        m = unwrap(self.model).config
        heads = m.num_attention_heads
        kv_heads = getattr(m, "num_key_value_heads", None) or heads
        head_dim = getattr(m, "head_dim", None) or m.hidden_size // heads
        rows = bucket(min(sequences, cfg.max_batch_size or sequences))
        return 2 * m.num_hidden_layers * kv_heads * head_dim * rows * round_up(max_len + 1, 16)

    def release(self) -> None:
        """Free the KV cache, state buffers and captured graphs (the next call rebuilds them)."""
        self.graphs.clear()
        self.pool = self.state = None
        if self.backend is not None:
            self.backend.release()
        self.backend = None
        if self._give_side is not None:  # its graphs are gone: another Sampler may capture there
            self._give_side()
            self._side = self._give_side = None

    # ---------------------------------------------------------------- setup
    def _encode(self, p, cfg: SamplingConfig) -> list[int]:
        if isinstance(p, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token ids instead")
            ids = list(self.tokenizer(p, add_special_tokens=False)["input_ids"])
            bos = bos_ids(self.tokenizer)  # only a BOS the tokenizer itself would prepend
            if cfg.add_bos and bos and ids[:1] != bos:
                ids = bos + ids
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError("empty prompt: a causal LM needs at least one token to condition on")
        return ids

    def _device(self):
        return next(self.model.parameters()).device

    def _pick_backend(self, cfg: SamplingConfig, slots: int) -> None:
        want = cfg.backend
        if want == "auto":
            want = "native" if native_support(self.model, slots) is None else "hf"
        elif want == "native" and (why := native_support(self.model, slots)):
            raise ValueError(f"native backend can't run this model: {why}")
        fp = tuple(p.data_ptr() for p in self.model.parameters())
        if self.backend is None or self.backend.name != want or fp != self._fingerprint:
            self.release()  # new backend or moved/replaced parameters: old graphs point at stale memory
            self.backend = NativeBackend(self.model) if want == "native" else HFBackend(self.model)
            self._fingerprint = fp

    def _alloc(self, rows: int, slots: int, steps: int, use_graphs: bool) -> None:
        """(Re)allocate state + cache when the shape outgrows them."""
        st, be, lent = self.state, self.backend, self.kv_storage
        borrowed = getattr(be, "borrowed", False)
        moved = borrowed and (lent is None or be.k.data_ptr() != lent.data_ptr())
        if st is None or rows > st.rows or slots > st.slots or steps > st.steps or moved \
                or (use_graphs and st.slots > slots + 256):  # don't keep a far larger cache
            self.graphs.clear()
            self.pool = self.state = None
            if use_graphs:  # round up so that nearby prompt lengths reuse the captured graphs
                slots, steps = round_up(slots + 1, 16) - 1, round_up(steps, 16)
            be.alloc(rows, slots + 1, lent)
            dtype = getattr(be, "dtype", torch.float32)
            self.state = State(rows, slots, steps, self._device(), dtype)
        if getattr(be, "borrowed", False):  # the lender wrote there: no inf / NaN in masked slots
            be.k.zero_()
            be.v.zero_()

    # ---------------------------------------------------------------- one decode step
    def _emit(self, logits: Tensor, cfg: SamplingConfig, r0: int = 0) -> None:
        """Sample from ``logits`` [n, V] for batch rows r0..r0+n and record the tokens, their
        log-probs and finished flags."""
        st, r1 = self.state, r0 + logits.shape[0]
        flat = st.row_id[r0:r1] * (st.steps + 1) + st.step
        y, lp = sample_tokens(logits, st.u.view(-1)[flat], cfg)
        record = kernels.record_step if FUSE_RECORD and kernels.record_available(y) else record_step
        record(y, lp, flat, st.finished[r0:r1], st.tokens[r0:r1], st.out_tok, st.out_logp,
               self._ends if self.eos and not cfg.ignore_eos else None, self.pad,
               None if self._episodes is None else (st.force_on, st.force_tok, st.out_kind))

    def _step(self, b: int, kv_len: int, cfg: SamplingConfig) -> None:
        st = self.state
        logits = self.backend.decode(st.tokens[:b], st.pos[:b], st.slot, st.bias[:b], kv_len)
        self._emit(logits, cfg)
        st.pos[:b].add_(1)
        st.slot.add_(1)
        st.step.add_(1)

    def _kv(self, used: int) -> int:
        """Slots a captured step attends over when ``used`` slots hold tokens."""
        return min(round_up(used, KV_BUCKET), self.state.slots + 1)

    def _graph(self, b: int, kv: int, cfg: SamplingConfig, stats: dict):
        """The decode step for batch size ``b`` attending over ``kv`` slots, captured in a CUDA
        graph (cached per settings; :func:`graphs.capture` leaves the rows being decoded as they
        were, so capturing mid-run is safe). ``_emulate_graphs`` (CPU tests) runs the same
        bookkeeping and replays the step eagerly with the graph's shapes."""
        key = (b, kv, cfg.graph_key(), tuple(self.eos), self._episodes is not None)
        g = self.graphs.get(key)
        if g is not None:
            return g
        t0 = time.perf_counter()
        side = None
        if self._device().type == "cuda":
            # one side stream for every capture of this Sampler, warm-up and capture both (each
            # new stream gets its own cuBLAS workspace and cached blocks), held by no other live
            # Sampler (graphs.capture says why)
            if self._side is None:
                self._side = take_stream(self._device())
                self._give_side = weakref.finalize(self, give_stream, (self._side.device, self._side.cuda_stream))
            side = self._side
        g = capture(lambda: self._step(b, kv, cfg), self.state, kv, side, self.pool)
        if side is not None:
            self.pool = g.pool()  # every batch size's graph shares one memory pool
        _sync(self._device())
        self.graphs[key] = g
        stats["capture_s"] += time.perf_counter() - t0
        return g

    # ---------------------------------------------------------------- one wave
    def _wave(self, seqs: list[list[int]], keys: list[int], cfg: SamplingConfig, stats: dict):
        """Decode one batch of sequences. Returns (tokens [N, T'], logps [N, T'], stop ends) on CPU."""
        N, T = len(seqs), cfg.max_new_tokens
        P = max(map(len, seqs))
        dev = self._device()
        self._pick_backend(cfg, P + T)
        use_graphs = cfg.cuda_graphs and (dev.type == "cuda" or self._emulate_graphs) \
            and self.backend.name == "native"
        b = bucket(N) if use_graphs else N
        self._alloc(b, P + T, T, use_graphs)
        st = self.state
        key = tuple(self.eos)
        if key not in self._eos_tensors:  # the end tokens as a table over every id the step can see
            head = unwrap(self.model).get_output_embeddings()
            width = head.weight.shape[0] if head is not None else unwrap(self.model).config.vocab_size
            ends = torch.zeros(max([width, self.pad + 1, *(e + 1 for e in self.eos)]), dtype=torch.bool)
            ends[self.eos] = True
            self._eos_tensors[key] = ends.to(dev)
        self._ends = self._eos_tensors[key]

        # Left-pad; spare bucket rows repeat row 0 (finite work) and write to the scratch output row.
        ids = torch.full((b, P), self.pad, dtype=torch.long)
        attn = torch.zeros((b, P), dtype=torch.bool)
        for i in range(b):
            s = seqs[i] if i < N else seqs[0]
            ids[i, P - len(s):] = torch.tensor(s)
            attn[i, P - len(s):] = True
        ids, attn = ids.to(dev), attn.to(dev)
        rows = torch.arange(b, device=dev)
        st.row_id[:b] = torch.where(rows < N, rows, st.rows)
        st.finished[:b] = rows >= N
        if not cfg.greedy:
            st.u[:N, :T] = uniforms(keys, T).to(dev)
        if self._episodes is not None:
            st.force_on.zero_()
            st.out_kind.zero_()
            self._episodes.width = P
        if use_graphs:  # capture the first step's graph before timing (and before prefill writes)
            self._graph(b, self._kv(P + 1), cfg, stats)

        with torch.inference_mode():  # less per-op overhead than no_grad
            t, stop_end = self._decode_wave(seqs, ids, attn, b, cfg, stats, use_graphs)
        # copied out of inference mode, so the trainer gets ordinary tensors
        out = (st.out_tok[:N, :t].to("cpu", copy=True), st.out_logp[:N, :t].to("cpu", copy=True), stop_end)
        if self._episodes is not None:
            out += (st.out_kind[:N, :t].to("cpu", copy=True),)
        return out

    def _decode_wave(self, seqs, ids, attn, b, cfg, stats, use_graphs):
        st, be, dev = self.state, self.backend, self._device()
        N, T, P = len(seqs), cfg.max_new_tokens, ids.shape[1]
        sync_every = cfg.sync_every or (8 if dev.type == "cuda" else 1)
        _sync(dev)
        t0 = time.perf_counter()
        st.bias[:b] = float("-inf")
        st.bias[:b, :P].masked_fill_(attn, 0.0)
        # The prefill's transient activations grow with the chunk, the KV cache with the batch: a
        # quarter of the prompt tokens per chunk keeps the transient well under the cache (H100,
        # Qwen2.5-0.5B shape: batch 64 peak 1.73 -> 1.57 GB at 4096 -> 2048 tokens, +0.02 s; batch
        # 256 prefill 0.094 -> 0.073 s at 4096 -> 8192; SamplingConfig.prefill_tokens sets it).
        tokens = cfg.prefill_tokens or min(8192, max(2048, b * P // 4))
        chunk = max(1, tokens // P) if be.name == "native" else b
        st.step.fill_(0)
        shared = distinct_rows(seqs, b) if SHARE_PREFILL else None
        if shared is not None and len(shared[0]) > chunk:
            shared = None  # more distinct prompts than one chunk: every row prefilled, chunk by chunk
        if shared is None:
            for r in range(0, b, chunk):  # each chunk's first token is drawn before the next chunk runs:
                self._emit(be.prefill(ids[r:r + chunk], attn[r:r + chunk], r), cfg, r)  # [chunk, V] transients only
        else:  # each distinct prompt once into rows 0..U-1, then every row's cache from its prompt's
            first, src = (torch.tensor(x, device=dev) for x in shared)
            logits = be.prefill(ids.index_select(0, first), attn.index_select(0, first), 0)
            be.select(src)
            for r in range(0, b, chunk):
                self._emit(logits.index_select(0, src[r:r + chunk]), cfg, r)
        st.pos[:b] = attn.sum(-1)
        st.slot.fill_(P)
        st.step.fill_(1)
        _sync(dev)
        t1 = time.perf_counter()

        # Decode. done: sequences known finished at the last check; stop_end: completion lengths.
        checker = StopChecker(self.tokenizer, cfg.stop, N) if cfg.stop and self.tokenizer else None
        self._host = _Host(N, T, tokens=checker is not None or self._stream is not None or self._episodes is not None,
                           kinds=self._episodes is not None)
        done: set[int] = set()
        stop_end: dict[int, int] = {}
        t, checked = 1, 0
        overlap = dev.type == "cuda" if OVERLAP_TURNS is None else OVERLAP_TURNS
        capture0 = stats["capture_s"]  # graphs for new KV lengths / batch sizes captured mid-loop
        graph, gkey = None, None
        while t < T:
            if use_graphs:  # slots 0..P+t-1 hold tokens once this step wrote slot P+t-1
                key = (b, self._kv(P + t))
                if key != gkey:  # a new KV bucket, or a smaller batch after compaction
                    graph, gkey = self._graph(b, key[1], cfg, stats), key
                graph.replay()
            else:
                self._step(b, P + t, cfg)
            t += 1
            if t % sync_every == 0 or t == T:
                # multi-turn, OVERLAP_TURNS: one more step runs while the host answers the check
                step = None
                if self._episodes is not None and overlap and t < T:
                    def step(b=b, t=t):
                        self._one_step(b, t, P, cfg, stats, use_graphs)
                b, running, t = self._check(b, t, checked, cfg, checker, done, stop_end, use_graphs, step)
                checked = t
                if not running:
                    break
        if checked < t:  # T == 1: nothing was checked yet
            self._check(b, t, checked, cfg, checker, done, stop_end, False)
        _sync(dev)
        t2 = time.perf_counter()
        stats["prefill_s"] += t1 - t0
        stats["decode_s"] += t2 - t1 - (stats["capture_s"] - capture0)
        stats["decode_steps"] += t - 1
        return t, stop_end

    def _one_step(self, b: int, t: int, P: int, cfg: SamplingConfig, stats: dict, use_graphs: bool) -> None:
        """The decode step that writes slot P + t - 1, outside the decode loop (the loop's own steps
        keep their graph at hand)."""
        if use_graphs:
            self._graph(b, self._kv(P + t), cfg, stats).replay()
        else:
            self._step(b, P + t, cfg)

    def _check(self, b, t, checked, cfg, checker, done, stop_end, use_graphs, step=None):
        """Host sync: match stop strings in the tokens since the last check, schedule the environment's
        replies (multi-turn), then compact the batch when at most half of it (three quarters without
        graphs) is still running. The device state is read once a check (:class:`_Host`), not once a
        tensor. ``step`` (multi-turn, see OVERLAP_TURNS): one more decode step, queued behind the
        read before the host waits for it; the check then answers the state the read saw, and its
        writes land after that step. Returns (b, any_running, t): t is one more when ``step`` ran."""
        st, host = self.state, self._host
        t_read = t
        fin, rid = host.read(st, b, t, then=step)
        if step is not None:
            t += 1
        if checker is not None:
            live = [i for i in range(len(checker.ids)) if i not in done]
            if live:
                new = host.tok[live, checked:t_read].tolist()
                hits = []
                for i, toks in zip(live, new):
                    end = next((k + 1 for k, y in enumerate(toks) if y in self.eos), None)
                    if end is not None and not cfg.ignore_eos:
                        toks = toks[:end]  # nothing after EOS counts
                    e = checker.update(i, toks)
                    if e is not None:
                        stop_end[i] = e
                        hits.append(i)
                if hits:
                    hit = torch.tensor(hits, device=st.row_id.device)
                    st.finished[:b] |= torch.isin(st.row_id[:b], hit)
                    hit_rows = set(hits)
                    fin = [f or r in hit_rows for f, r in zip(fin, rid)]
        if self._stream is not None:
            self._stream.send(host.tok, checked, t_read, stop_end)
        if self._episodes is not None:  # every ended turn is answered (its row runs) or ends its episode
            fin = self._turn_boundaries(b, t_read, t, fin, rid)
        # a row the read saw running runs on (with ``step``, its turn may have ended since: the next
        # check answers it)
        running = [i for i, f in enumerate(fin) if not f]
        n = len(running)
        done.update(r for r, f in zip(rid, fin) if f and r < st.rows)
        if n == 0:
            return b, False, t
        new_b = bucket(n) if use_graphs else n
        if new_b <= b // 2 or (not use_graphs and n <= 3 * b // 4):
            # spare rows repeat a live one
            idx = torch.tensor(running + running[:1] * (new_b - n), device=st.tokens.device)
            for x in (st.tokens, st.pos, st.bias, st.finished, st.row_id):
                x[:new_b] = x.index_select(0, idx)
            st.finished[n:new_b] = True
            st.row_id[n:new_b] = st.rows
            self.backend.select(idx)
            b = new_b
        return b, True, t

    def _turn_boundaries(self, b: int, t_read: int, t: int, fin: list[bool], rid: list[int]) -> list[bool]:
        """Host side of a multi-turn call, at a check that read the state after step t_read-1
        (``fin``, ``rid``: the batch rows' finished flags and output rows) and whose writes land
        after step t-1 (t = t_read, or t_read + 1 when one more step ran meanwhile: the ended rows
        waited it, masked): every row whose turn ended (finished, episode not over) gets the
        environment's reply scheduled as forced tokens and runs again. The cache continues: the
        reply's tokens go into the next slots, the slots the row spent waiting for this check are
        masked out, and its position counts its real tokens only — so the transcript's keys, values
        and positions are those of one contiguous sequence. Returns the finished flags with the
        resumed rows running."""
        st, ep, host = self.state, self._episodes, self._host
        ended = [(i, r) for i, (f, r) in enumerate(zip(fin, rid)) if f and r < st.rows and r not in ep.over]
        if not ended:
            return fin
        rows = [r for _, r in ended]
        toks, kinds = host.tok[rows, :t_read].tolist(), host.kind[rows, :t_read].tolist()
        P, T = ep.width, st.steps
        # The writes of every row that runs again are gathered here and made below as a few batched
        # ops (one host-to-device copy): per-row indexing of device tensors costs ~10 launches a
        # row, and the GPU idles for the host's work at a check.
        waited = []  # (batch row, output row, the reply's first token, first slot waited, end slot)
        forced_at = []  # (output row, step, token): the reply's other tokens, forced at later steps
        resumed = []  # (batch row, its RoPE position)
        for (i, r), tk, kd in zip(ended, toks, kinds):
            start = ep.turn_start.get(r, 0)
            e = max(s for s in range(start, len(kd)) if kd[s] == 1)  # the step of the turn's end token
            reply = ep.episodes.turn_ended(ep.offset + r, [y for y, k in zip(tk[start:e + 1], kd[start:e + 1]) if k == 1])
            if not reply:
                ep.over.add(r)
                continue
            # The end token was fed to the cache at step e+1 unless e is the last step (then it is
            # fed next). Waiting steps e+1..t-1 wrote slots P+e+1..P+t-2; their last output (step
            # t-1) is replaced by the reply's first token, which step t feeds.
            was_waiting = e < t - 1
            if (t - 1 if was_waiting else t) + len(reply) >= T:  # no step left for the model to answer
                ep.episodes.truncated(ep.offset + r)
                ep.over.add(r)
                continue
            forced = reply
            if was_waiting:
                waited.append((i, r, reply[0], P + e + 1, P + t - 1))
                forced = reply[1:]
            forced_at += [(r, t + k, y) for k, y in enumerate(forced)]
            resumed.append((i, ep.prompt_len[r] + sum(1 for k in kd[:t - 1] if k)))
            ep.turn_start[r] = t + len(forced)
        if resumed:
            self._resume(waited, forced_at, resumed, t)
            fin = list(fin)
            for i, _ in resumed:
                fin[i] = False
        return fin

    def _resume(self, waited, forced_at, resumed, t: int) -> None:
        """The device side of :meth:`_turn_boundaries`, batched: rows that waited get the reply's
        first token as step t-1's output and next input, and their waiting slots masked out; the
        reply's other tokens are forced at their steps; every resumed row gets its position and runs.
        Every write is one indexed op over a flattened buffer, its indices from one host-to-device
        copy (and the host's copy of the outputs gets the replaced token too)."""
        st, host = self.state, self._host
        W, S = st.steps + 1, st.bias.shape[1]  # row strides of the output buffers and of the mask
        parts = [[r * W + t - 1 for _, r, _, _, _ in waited], [y for _, _, y, _, _ in waited],
                 [i for i, _, _, _, _ in waited], [i * S + s for i, _, _, lo, hi in waited for s in range(lo, hi)],
                 [r * W + s for r, s, _ in forced_at], [y for _, _, y in forced_at],
                 [i for i, _ in resumed], [p for _, p in resumed]]
        vals = torch.tensor([v for p in parts for v in p], dtype=torch.long).to(st.out_tok.device)
        at, y, rows, masked, fat, fy, res, pos = vals.split([len(p) for p in parts])
        if waited:
            st.out_tok.view(-1).index_copy_(0, at, y)
            st.out_kind.view(-1).index_fill_(0, at, 2)
            st.tokens.index_copy_(0, rows, y)
            if masked.numel():
                st.bias.view(-1).index_fill_(0, masked, float("-inf"))
            for _, r, tok, _, _ in waited:
                host.tok[r, t - 1], host.kind[r, t - 1] = tok, 2
        if forced_at:
            st.force_tok.view(-1).index_copy_(0, fat, fy)
            st.force_on.view(-1).index_fill_(0, fat, True)
        st.pos.index_copy_(0, res, pos)
        st.finished.index_fill_(0, res, False)


class _Host:
    """What the host knows of a wave's device state, read at each check in one device-to-host copy:
    the batch rows' finished flags and output rows and, when the checks need tokens (stop strings, a
    stream, multi-turn), every output row's tokens — and their kinds, multi-turn — of the steps since
    the last read, appended to a host copy of the output buffers (``tok``, ``kind``: [N, steps + 1])."""

    def __init__(self, n: int, steps: int, tokens: bool, kinds: bool):
        self.n, self.upto = n, 0
        self.tok = torch.zeros(n, steps + 1, dtype=torch.long) if tokens else None
        self.kind = torch.zeros(n, steps + 1, dtype=torch.int8) if kinds else None

    def read(self, st, b: int, t: int, then=None) -> tuple[list[bool], list[int]]:
        """(finished flags, output rows) of batch rows 0..b-1, and the outputs of steps up to t-1
        into ``tok`` / ``kind``. ``then``: device work to queue behind the copy before the host
        waits for it (on CUDA the copy goes to pinned memory and the host waits for it alone)."""
        parts = [st.finished[:b].long(), st.row_id[:b]]
        lo = self.upto
        window = self.tok is not None and t > lo
        if window:
            parts.append(st.out_tok[:self.n, lo:t].reshape(-1))
            if self.kind is not None:
                parts.append(st.out_kind[:self.n, lo:t].reshape(-1).long())
        flat = torch.cat(parts)  # a new tensor: what follows cannot change it
        if then is not None and flat.is_cuda:
            pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            pinned.copy_(flat, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            then()
            copied.synchronize()  # the copy, not the work queued behind it
            flat = pinned
        else:
            flat = flat.cpu()  # the one sync
            if then is not None:
                then()
        if window:
            w = self.n * (t - lo)
            self.tok[:, lo:t] = flat[2 * b:2 * b + w].view(self.n, t - lo)
            if self.kind is not None:
                self.kind[:, lo:t] = flat[2 * b + w:].view(self.n, t - lo)
            self.upto = t
        return flat[:b].bool().tolist(), flat[b:2 * b].tolist()


def record_step(y: Tensor, lp: Tensor, flat: Tensor, finished: Tensor, tokens: Tensor, out_tok: Tensor,
                out_logp: Tensor, ends: Tensor | None, pad: int, episodes: tuple[Tensor, Tensor, Tensor] | None) -> None:
    """A decode step's bookkeeping after the draw, in torch ops (:func:`kernels.record_step` is the same
    in one kernel, and says what it does)."""
    fin = finished
    forced = episodes[0].view(-1)[flat] if episodes is not None else None
    if forced is not None:  # the environment's tokens: fed as they are, no log-prob, no end
        force_tok, out_kind = episodes[1], episodes[2]
        y = torch.where(forced, force_tok.view(-1)[flat], y)
        lp = lp.masked_fill(forced, 0.0)
        kind = torch.where(fin, 0, torch.where(forced, 2, 1)).to(torch.int8)
        out_kind.view(-1).index_copy_(0, flat, kind)
    y = torch.where(fin, pad, y)
    out_tok.view(-1).index_copy_(0, flat, y)
    out_logp.view(-1).index_copy_(0, flat, lp.masked_fill(fin, 0.0))
    if ends is not None:
        end = ends[y]
        fin |= end if forced is None else end & ~forced
    tokens.copy_(y)


class Episodes:
    """What a multi-turn :meth:`Sampler.sample` asks of its caller (the episode loop,
    ``tether.envs.rollouts``), indexed by sequence (prompt-major, after ``only``)."""

    def turn_ended(self, seq: int, ids: list[int]) -> list[int] | None:
        """Sequence ``seq``'s model turn ended with these sampled ids (its end token included):
        the environment's reply as token ids (with the chat template's markup up to the next
        assistant turn's generation prompt), or None when the episode is over."""
        raise NotImplementedError

    def truncated(self, seq: int) -> None:
        """The reply to ``seq``'s last turn did not fit in ``max_new_tokens``: the episode ends there."""


class _Turns:
    """One wave's turn bookkeeping (host side): rows whose episode is over, the step each row's
    current turn started at, the prompts' lengths and the wave's prompt width."""

    def __init__(self, episodes: Episodes, offset: int, seqs: list[list[int]]):
        self.episodes, self.offset = episodes, offset
        self.prompt_len = [len(s) for s in seqs]
        self.over: set[int] = set()
        self.turn_start: dict[int, int] = {}
        self.width = max(self.prompt_len)


class _Stream:
    """One wave's streaming (``Sampler.sample(stream=...)``), host side: at each check, every
    sequence still going gets its ids of the steps since the last check, cut after its end token
    (``ends``) or the token that completed a stop string (``stop_end``); then it is over."""

    def __init__(self, fn, offset: int, n: int, ends: list[int]):
        self.fn, self.offset, self.n, self.ends = fn, offset, n, set(ends)
        self.over: set[int] = set()

    def send(self, out_tok: Tensor, start: int, t: int, stop_end: dict[int, int]) -> None:
        live = [i for i in range(self.n) if i not in self.over]
        if not live or t <= start:
            return
        new = out_tok[torch.tensor(live, device=out_tok.device), start:t].tolist()
        for i, ids in zip(live, new):
            end = next((k + 1 for k, y in enumerate(ids) if y in self.ends), None)
            if i in stop_end:
                end = min(end or len(ids), stop_end[i] - start)
            if end is not None:
                ids = ids[:end]
                self.over.add(i)
            if ids:
                self.fn(self.offset + i, ids)


def _replace(cfg: SamplingConfig, overrides: dict) -> SamplingConfig:
    import dataclasses
    return dataclasses.replace(cfg, **overrides)


def distinct_rows(seqs: list[list[int]], b: int) -> tuple[list[int], list[int]] | None:
    """The prefill's shared prompts (SHARE_PREFILL): (the first row of each distinct prompt, and for
    each of the `b` batch rows the index of its prompt among those), or None when no two rows
    repeat one prompt. Rows past len(seqs) (a graph bucket's spare rows) repeat row 0."""
    index: dict[tuple, int] = {}
    first, src = [], []
    for i in range(b):
        key = tuple(seqs[i] if i < len(seqs) else seqs[0])
        if key not in index:
            index[key] = len(first)
            first.append(i)
        src.append(index[key])
    return None if len(first) == b else (first, src)


def _sync(dev) -> None:
    """Wait for this Sampler's own GPU work (its timings' clock): the current stream, not the
    device. A device-wide sync would also wait for whatever else runs on the GPU — the trainer's
    update beside the interleaved placement's sampler thread (three times a wave), NCCL work —
    and so serialise what the placement overlaps."""
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def sample(model, tokenizer, prompts, n: int = 1, seed: int | None = None, **config) -> Rollout:
    """One-call sampling: ``sample(model, tok, ["2+2="], n=4, temperature=0.7, stop=["\\n"])``.
    Reuses one :class:`Sampler` per model (and so its CUDA graphs) across calls."""
    s = _DEFAULT.get(model)
    if s is None or s.tokenizer is not tokenizer:
        s = _DEFAULT[model] = Sampler(model, tokenizer)
    return s.sample(prompts, n=n, seed=seed, **config)
