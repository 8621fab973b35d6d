"""Data plane shared by rollout actors and learners.

This package holds the contracts (fragment keys, the weight board) and the
components data flows through (replay shards, the learner-side device feed).
``actors`` and ``learner`` never import each other; they meet here.
"""
