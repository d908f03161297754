"""reflow: RL post-training that keeps every device busy."""

__version__ = "0.1.0"
