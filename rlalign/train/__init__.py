"""The trainer, in rooms: the GRPO/PPO loop (loop.py) over sampling, agreement checks, advantages, the update and
checkpointing, the step's records (samples.py, packing.py), and the run directory (run/); docs/architecture.md."""
