"""Where does a GPU run's rank 0 spend its host time? (issue 16: a 2-GPU DPO step spends ~0.7 s in
Python outside any op, twice one GPU's.)

    PYTHONPATH=bench/sync_debug:$PYTHONPATH SYNC_DEBUG_OUT=/tmp/syncs.txt torchrun ... -m tether dpo ...
    PYTHONPATH=bench/sync_debug:$PYTHONPATH CPROFILE_OUT=/tmp/prof.txt torchrun ... -m tether dpo ...

Python imports this file at start-up (it is named sitecustomize), in every process; only a torchrun
worker of local rank 0 (LOCAL_RANK set: not the launcher or a parent that started it) acts:
- SYNC_DEBUG_OUT: torch.cuda.set_sync_debug_mode("warn"), and at exit every distinct call stack
  (tether's, transformers' and torch.distributed/optim frames) that made a synchronizing CUDA call,
  with its count, most frequent first;
- CPROFILE_OUT: cProfile over the main thread, and at exit the top functions by own time and by
  cumulative time (cProfile slows Python-heavy code; read the ranking, not the seconds).
Blind spots: on CUDA the backward runs on autograd's device thread, so FSDP2's backward hooks show
up only as time inside `run_backward` in the profile, and a sync raised from C++ backward code is
printed by torch (stderr), not counted here. A timeline profiler (nsys, torch.profiler with stacks)
sees both.
"""
import atexit
import collections
import os
import sys
import threading
import traceback
import warnings

_RANK0 = os.environ.get("LOCAL_RANK") == "0"
_SYNC_OUT = os.environ.get("SYNC_DEBUG_OUT") if _RANK0 else None
_PROF_OUT = os.environ.get("CPROFILE_OUT") if _RANK0 else None

if _SYNC_OUT:
    _counts: collections.Counter = collections.Counter()
    _shown = warnings.showwarning
    _KEEP = ("/tether/", "transformers/", "torch/distributed", "torch/optim", "torch/nn/utils")

    def _show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return _shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-2] if any(k in f.filename for k in _KEEP)]
        _counts["\n".join(f"  {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                          for f in frames[-6:])] += 1

    warnings.showwarning = _show
    warnings.simplefilter("always")
    _armed = threading.Event()

    def _poll():  # arm once torch is fully imported (a tether trainer module is), then stop
        import time
        while not _armed.is_set():
            if "tether.trainers.setup" in sys.modules:
                import torch
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode("warn")
                _armed.set()
            time.sleep(0.2)

    threading.Thread(target=_poll, daemon=True).start()

    def _write_syncs():
        with open(_SYNC_OUT, "w") as f:
            f.write(f"{sum(_counts.values())} synchronizing calls on local rank 0 "
                    f"(armed: {_armed.is_set()})\n\n")
            for stack, n in _counts.most_common(40):
                f.write(f"{n}\n{stack}\n\n")

    atexit.register(_write_syncs)

if _PROF_OUT:
    import cProfile
    _prof = cProfile.Profile()
    _prof.enable()

    def _write_profile():
        import io
        import pstats
        _prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(_prof, stream=out)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(60)
        with open(_PROF_OUT, "w") as f:
            f.write(out.getvalue())

    atexit.register(_write_profile)
