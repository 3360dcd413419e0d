"""RL-Align: RL post-training whose rollout and training log-probs are bit-for-bit identical."""

__version__ = "0.1.0"
