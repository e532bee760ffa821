"""Where does a CUDA run wait on the host? (issue 16: ~500 blocking copies a step on 2 GPUs.)

    PYTHONPATH=bench/sync_debug:$PYTHONPATH SYNC_DEBUG_OUT=/tmp/syncs.txt torchrun ... -m tether dpo ...

Python imports this file at start-up (it is named sitecustomize). On local rank 0 it turns on
torch.cuda.set_sync_debug_mode("warn") and, at exit, writes every distinct call stack (tether's and
transformers' frames) that made a synchronizing CUDA call, with its count, most frequent first."""
import atexit
import collections
import os
import traceback
import warnings

_OUT = os.environ.get("SYNC_DEBUG_OUT")
if _OUT and os.environ.get("LOCAL_RANK", "0") == "0":
    _counts: collections.Counter = collections.Counter()
    _shown = warnings.showwarning

    def _show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return _shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-2]
                  if "/tether/" in f.filename or "transformers/" in f.filename or "torch/distributed" in f.filename
                  or "torch/optim" in f.filename or "torch/nn/utils" in f.filename]
        _counts["\n".join(f"  {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-6:])] += 1

    warnings.showwarning = _show
    warnings.simplefilter("always")

    _armed = False

    def _arm():  # after torch is imported by the program (importing it here would slow every start)
        global _armed
        import sys
        # torch fully imported once a tether trainer module is (a half-imported torch can't be used)
        if not _armed and "tether.trainers.setup" in sys.modules:
            import torch
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
                _armed = True

    def _write():
        with open(_OUT, "w") as f:
            total = sum(_counts.values())
            f.write(f"{total} synchronizing calls on local rank 0\n\n")
            for stack, n in _counts.most_common(40):
                f.write(f"{n}\n{stack}\n\n")

    atexit.register(_write)
    import threading
    # arm as soon as torch is in: a polling thread (cheap; stops once armed)
    def _poll():
        import time
        while not _armed:
            _arm()
            time.sleep(0.2)
    threading.Thread(target=_poll, daemon=True).start()
