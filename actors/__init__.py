"""Rollout actors: gymnasium vector envs + a CPU policy copy -> fragments."""
