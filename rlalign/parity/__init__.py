"""Parity tooling: capture, compare, replay and localize differences between a rollout engine and a trainer."""
