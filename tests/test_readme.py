"""The README a newcomer reads: short, its set-up commands the ones CI runs, and its Layout section
naming exactly the packages and modules of tether/'s layer table (tests/test_layers.py, LAYERS)."""

from __future__ import annotations

import re
from pathlib import Path

from test_layers import LAYERS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
MAX_LINES = 200
# Names in LAYERS that the Layout section does not list: `python -m tether`'s entry point is
# described on cli.py's line.
NOT_LISTED = {"__main__"}


def _section(text: str, title: str) -> str:
    """The body of the `## <title>` section: up to the next `## ` heading or the end."""
    match = re.search(rf"^## {re.escape(title)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def layout_names(text: str) -> list[str]:
    """The names of the Layout section's list items: `- \\`trainers/\\` — ...` -> 'trainers',
    `- \\`cli.py\\` — ...` -> 'cli'."""
    names = []
    for line in _section(text, "Layout").splitlines():
        item = re.match(r"^[-*] `([^`]+)`", line)
        if item:
            name = item.group(1)
            names.append(name.removesuffix("/").removesuffix(".py"))
    return names


def setup_commands(text: str) -> list[str]:
    """The ```bash blocks of the `## Set up` section, one command each."""
    blocks = re.findall(r"^```bash\n(.*?)^```", _section(text, "Set up"), re.M | re.S)
    return [block.strip() for block in blocks]


def ci_command(script: str) -> str:
    """The one command .ci/run runs: its lines less the shebang, comments, `set` and the `cd` to the
    checkout."""
    lines = [line.strip() for line in script.splitlines()]
    commands = [line for line in lines
                if line and not line.startswith("#") and not line.startswith("set ")
                and not line.startswith("cd ")]
    assert len(commands) == 1, f".ci/run should run one command, found {len(commands)}: {commands}"
    return commands[0]


def test_readme_is_at_most_200_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines, more than {MAX_LINES}"


def test_layout_names_exactly_the_layer_tables_packages():
    listed = layout_names(README.read_text(encoding="utf-8"))
    layered = {name for layer in LAYERS for name in layer} - NOT_LISTED
    duplicates = sorted({name for name in listed if listed.count(name) > 1})
    missing = sorted(layered - set(listed))
    extra = sorted(set(listed) - layered)
    assert not duplicates, f"README.md's Layout lists these more than once: {duplicates}"
    assert not missing, (f"README.md's Layout omits these packages/modules of tests/test_layers.py's "
                         f"LAYERS: {missing}")
    assert not extra, (f"README.md's Layout lists these, which tests/test_layers.py's LAYERS does not "
                       f"have: {extra}")


def test_setup_commands_are_the_ones_ci_runs():
    commands = setup_commands(README.read_text(encoding="utf-8"))
    assert len(commands) == 2, (f"README.md's 'Set up' should hold two ```bash commands (install + "
                                f"quickstart; install + tests), found {len(commands)}: {commands}")
    install, tests = commands
    assert "\n" not in install and "\n" not in tests, "each set-up command should be one line"
    assert install.endswith("tether quickstart"), f"the first set-up command should run the quickstart: {install}"
    ci = ci_command(CI_RUN.read_text(encoding="utf-8"))
    assert tests == ci, f"README.md's second set-up command differs from .ci/run's:\nREADME: {tests}\nCI:     {ci}"


def test_layout_parser_reads_packages_and_modules():
    text = "## Layout\n\nThe package:\n\n- `studio/` — a\n- `cli.py` — b\n  more of b\n\n## Next\n- `x/` — no\n"
    assert layout_names(text) == ["studio", "cli"]
