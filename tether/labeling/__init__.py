"""Labelers: commands that write training data by running models (`tether label <name>`).

steps.py: Math-Shepherd step labels by Monte-Carlo rollouts (`tether label steps`).
"""
