"""Fixtures shared across test modules: a session-scoped fixture imported into two modules would be
two fixtures, each converting the real-model GGUF (~20 s) on its own."""

from real_model import smollm2, smollm2_cache, smollm2_gguf  # noqa: F401 - pytest fixtures
