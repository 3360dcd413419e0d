"""The trainer: packing, fused loss, optimizer, checkpoints, the GRPO/PPO loop."""
