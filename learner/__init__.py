"""Policy models, PPO math, learner actors and the device layer."""
