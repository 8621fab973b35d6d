"""Config schema, Ray start-up and placement, the driver loop, CLI, checkpoints, metrics."""
