"""Where `module:function` reward specs are found: the working directory (as under `python -m`,
also for the `tether` console script, whose sys.path[0] is its bin directory), and Python files
named by path (`./reward.py:exact`)."""

import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from tether.errors import UserError
from tether.rewards import load_reward

EXACT = textwrap.dedent("""
    TAG = {tag!r}

    def exact(prompts, completions, completion_ids, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]
""")


def _write(path, tag="a"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(EXACT.format(tag=tag))
    return path


def _call(fn):
    return fn(prompts=["p", "p"], completions=[" 7", "8"], completion_ids=None, answer=["7", "7"])


def test_a_module_in_the_working_directory_loads_without_the_cwd_on_sys_path(tmp_path):
    # `python -I` leaves the working directory off sys.path, as the `tether` console script does
    # (its sys.path[0] is the venv's bin/): a loader that relies on the cwd there fails with
    # "cannot import module".
    name = f"reward_{uuid.uuid4().hex[:8]}"
    _write(tmp_path / f"{name}.py")
    code = ("import sys, os; assert os.getcwd() not in sys.path and '' not in sys.path, sys.path; "
            "from tether.rewards import load_reward; "
            f"f = load_reward('{name}:exact'); "
            "print(f(prompts=['p', 'p'], completions=[' 7', '8'], completion_ids=None, answer=['7', '7']))")
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0, 0.0]"


def test_the_cwd_is_added_only_when_a_user_module_is_asked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != str(tmp_path)])
    load_reward("math")  # a built-in: sys.path untouched
    assert str(tmp_path) not in sys.path
    name = f"reward_{uuid.uuid4().hex[:8]}"
    _write(tmp_path / f"{name}.py")
    assert _call(load_reward(f"{name}:exact")) == [1.0, 0.0]
    assert sys.path[0] == str(tmp_path)  # where `python -m` puts it
    load_reward(f"{name}:exact")
    assert sys.path.count(str(tmp_path)) == 1  # not again


@pytest.mark.parametrize("form", ["./{f}", "{f}", "{abs}", "sub/../{f}"])
def test_a_file_path_spec_loads_that_file(tmp_path, monkeypatch, form):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "my_reward.py")
    spec = form.format(f="my_reward.py", abs=tmp_path / "my_reward.py") + ":exact"
    (tmp_path / "sub").mkdir()
    fn = load_reward(spec)
    assert _call(fn) == [1.0, 0.0]
    assert fn.__name__ == "exact"  # the metric name is the function's, not the path's


def test_two_files_of_one_name_stay_apart_and_one_file_loads_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, b = _write(tmp_path / "a" / "reward.py", "a"), _write(tmp_path / "b" / "reward.py", "b")
    fa, fb = load_reward(f"{a}:exact"), load_reward("b/reward.py:exact")
    assert sys.modules[fa.__module__].TAG == "a" and sys.modules[fb.__module__].TAG == "b"
    assert fa.__module__ != fb.__module__
    assert load_reward("./a/reward.py:exact") is fa  # reward_funcs and eval_reward_funcs share it


@pytest.mark.parametrize("body, spec, words", [
    (None, "./missing.py:exact", "file './missing.py' does not exist"),
    ("def exact(:\n", "./bad.py:exact", "cannot import file './bad.py': SyntaxError"),
    ("raise RuntimeError('no GPU here')\n", "./boom.py:exact", "RuntimeError: no GPU here"),
    ("x = 1\n", "./x.py:exact", "has no attribute 'exact'"),
    ("exact = 3\n", "./n.py:exact", "not callable"),
])
def test_file_spec_errors_are_one_line_naming_the_spec(tmp_path, monkeypatch, body, spec, words):
    monkeypatch.chdir(tmp_path)
    if body is not None:
        (tmp_path / spec.split(":")[0]).write_text(body)
    with pytest.raises(UserError) as e:
        load_reward(spec)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"reward {spec!r}: ") and words in msg, msg
    if "import" in msg:  # a file that failed to run leaves no half-imported module behind
        assert not any(getattr(m, "__file__", None) == str(tmp_path / spec[2:].split(":")[0])
                       for m in list(sys.modules.values()))
