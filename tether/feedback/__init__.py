"""AI feedback (docs/ai-feedback.md): constitutions, pairwise judges with swap debiasing
(`tether label pairs`), and Constitutional AI's critique -> revision data (`tether cai`).

Modules: constitution.py (principles from a markdown file), lm.py (chat prompts, generation through
tether.rollout, answer-token log-probs in one forward), judge.py (judge prompt, swap debiasing,
labels, the LM judge), label.py (`tether label pairs`), cai.py (`tether cai`).
"""
