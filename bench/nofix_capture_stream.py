"""pytest plugin for one GPU check (bench/gpu_session16.sh tests): graphs captured on torch's shared
default capture stream again, as before session 15, so that
tests/test_rollout_gpu.py::test_one_samplers_released_graphs_leave_anothers_intact can be seen to
fail without the fix (`python -m pytest -p nofix_capture_stream ...` with bench/ on PYTHONPATH)."""
import torch

_graph = torch.cuda.graph


class _SharedStreamGraph(_graph):
    def __init__(self, cuda_graph, pool=None, stream=None, **kw):
        super().__init__(cuda_graph, pool=pool, **kw)  # the caller's stream dropped


torch.cuda.graph = _SharedStreamGraph
