"""tether: post-train language models with RL and preference optimization."""
__version__ = "0.1.0"
