"""Tests that need an optional extra (pyproject.toml's optional-dependencies) skip where it is not
installed, naming what to install, and run everywhere else (`.ci/run` installs `.[test]`: all of
them).

    from extras import needs

    @needs("peft")
    def test_lora_...(...):
"""

from __future__ import annotations

import importlib.util

import pytest

# the package -> the extra that carries it
EXTRA = {"peft": "lora", "gguf": "gguf", "accelerate": "gguf", "tensorboard": "tensorboard",
         "fastapi": "studio", "uvicorn": "studio", "httpx": "test", "playwright": "test",
         "reasoning_gym": "reasoning-gym", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow",
         "sqlalchemy": "mlflow", "alembic": "mlflow"}


def reason(*missing: str) -> str:
    extras = ",".join(dict.fromkeys(EXTRA.get(m, "test") for m in missing))
    return f"{' and '.join(missing)} not installed (pip install -e '.[{extras}]')"


def needs(*modules: str):
    """A mark that skips the test unless every one of `modules` is importable (found, not imported:
    collection stays cheap)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=reason(*missing))
