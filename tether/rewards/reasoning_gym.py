"""The built-in reward ``reasoning_gym``: a reasoning-gym task's own ``score_answer``.

Rows from ``data=reasoning_gym:<task>?size=N&seed=S`` (tether.data.reasoning_gym) carry a
``reasoning_gym`` column holding the task, its config and the entry; this reward extracts the
completion's last ``<answer>...</answer>`` and scores it with the dataset's ``score_answer(answer,
entry)``: 1.0 for the entry's answer, a task-defined value in [0, 1) for anything else (0.0
without an answer block). A row without the column (another dataset mixed in) gets None.
"""

from __future__ import annotations

from tether.rewards.verifiers import completion_text

__all__ = ["make_reasoning_gym"]

COLUMN = "reasoning_gym"


def make_reasoning_gym(tag: str | None = "answer"):
    """The reward; `tag`: the XML tag holding the answer (None: the whole completion)."""
    def reasoning_gym(prompts, completions, completion_ids=None, **columns):
        # tether.data (tokenizers, chat templates) loads on the first call, not with the registry
        from tether.data.reasoning_gym import score_completion

        specs = columns.get(COLUMN)
        if specs is None:
            raise KeyError(f"needs a {COLUMN!r} column (data=reasoning_gym:<task>?size=N&seed=S); "
                           f"got {sorted(columns)}")
        return [None if spec is None else score_completion(spec, completion_text(c), tag)
                for c, spec in zip(completions, specs)]
    reasoning_gym.__name__ = reasoning_gym.__qualname__ = "reasoning_gym"
    return reasoning_gym
