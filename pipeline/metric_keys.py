"""Metric names, in one place like the fragment keys: what learners return, the driver records, and the JSONL,
TensorBoard, progress line and report read. A renamed metric is renamed here, everywhere at once.

Learners return their per-iteration figures under these same names (no renaming on the way); the driver adds
the run-level ones.
"""

# Run progress
ITERATION = "iteration"
TIME_S = "time_s"  # since the command started
TRAIN_TIME_S = "train_time_s"  # in the training loop, resumed runs included
ENV_STEPS = "env_steps"
ENV_STEPS_PER_S = "env_steps_per_s"
LEARNER_SAMPLES = "learner_samples"
LEARNER_SAMPLES_PER_S = "learner_samples_per_s"
POLICY_VERSION = "policy_version"
EPISODES = "episodes"
EPISODES_IN_WINDOW = "episodes_in_window"
EPISODE_RETURN_MEAN = "episode_return_mean"
EPISODE_SUCCESS_RATE = "episode_success_rate"
# Self-play (multiagent.self_play): the learning seat's results in the episode window, against the pool of past
# selves it trained against (a return > 0 is a win, 0 a draw, < 0 a loss), and the Elo-style rating difference to
# the pool that score implies (cluster.evaluation.elo_against). Only in self-play runs' records.
POOL_WIN_RATE = "pool_win_rate"
POOL_DRAW_RATE = "pool_draw_rate"
POOL_LOSS_RATE = "pool_loss_rate"
POOL_ELO = "pool_elo"
# Periodic evaluation (eval.interval_iterations): the newest finished one, null before the first.
EVAL_RETURN_MEAN = "eval_return_mean"
EVAL_RETURN_STD = "eval_return_std"
EVAL_SUCCESS_RATE = "eval_success_rate"
EVAL_POLICY_VERSION = "eval_policy_version"

# One learner iteration (means over learners in the record)
HOST_BOUND_FRACTION = "host_bound_fraction"
DEVICE_IDLE_FRACTION = "device_idle_fraction"
LEARNER_WAIT_S = "learner_wait_s"
LEARNER_UPDATE_S = "learner_update_s"
LEARNER_ITER_S = "learner_iter_s"
FEED_PULL_S = "feed_pull_s"
FEED_COLLATE_S = "feed_collate_s"
H2D_MS = "h2d_ms"
H2D_BYTES = "h2d_bytes"
HOST_SYNCS = "host_syncs"
ALLREDUCE_CALLS = "allreduce_calls"
# The collectives' time in one update (learner/distributed.py's LearnerCollectives: the gradient all-reduce of every
# minibatch step, the normaliser statistics' gather, the ranks' means of target_kl's KL and of the non-finite flag),
# each call timed whole, the wait for the slowest rank included: on CPU by the host's clock around the call (gloo
# returns when done), on CUDA/NPU by device events around it, read once after the update's own host sync. The
# record carries the lead learner's (rank 0, as the PPO statistics): COLLECTIVE_S its seconds in this iteration's
# update, COLLECTIVE_SHARE those seconds / its LEARNER_UPDATE_S (its own update time, not the record's mean over
# learners), a fraction since the collectives run inside the update. One learner makes no collective: both are 0.0,
# present in every record all the same.
COLLECTIVE_S = "collective_s"
COLLECTIVE_SHARE = "collective_share"
POLICY_LAG_MEAN = "policy_lag_mean"
POLICY_LAG_MAX = "policy_lag_max"
LEARNER_TAKE_FAILURES = "learner_take_failures"
COMPILE = "compile"
UPDATE_PATH = "update_path"  # "fused", "fused (graphs...)" (learner.graphs), or "autograd (<why>)"
PROFILE_TRACE = "profile_trace"

# PPO statistics (rank 0's update: means over its minibatches)
POLICY_LOSS = "policy_loss"
VALUE_LOSS = "value_loss"
ENTROPY = "entropy"
APPROX_KL = "approx_kl"
CLIP_FRACTION = "clip_fraction"
EXPLAINED_VARIANCE = "explained_variance"
GRAD_NORM = "grad_norm"
LR = "lr"
UPDATE_EPOCHS_RUN = "update_epochs_run"  # epochs the update ran: ppo.update_epochs, or fewer under ppo.target_kl
ENT_COEF = "ent_coef"  # the update's entropy coefficient (ppo.ent_coef_end anneals it)
CLIP_COEF = "clip_coef"  # the update's clip range (ppo.clip_coef_end anneals it)
#: Averaged over the minibatches of an update, in this order (the learner stacks them into one tensor).
MINIBATCH_STATS = (POLICY_LOSS, VALUE_LOSS, ENTROPY, APPROX_KL, CLIP_FRACTION)
PPO_STATS = MINIBATCH_STATS + (EXPLAINED_VARIANCE, GRAD_NORM, LR, UPDATE_EPOCHS_RUN, ENT_COEF, CLIP_COEF)

# Data plane (the supply board's ledger; cumulative)
FRAGMENTS_PRODUCED = "fragments_produced"
FRAGMENTS_DROPPED_STALE = "fragments_dropped_stale"
STALE_FRACTION = "stale_fraction"
FRAGMENTS_REJECTED = "fragments_rejected"
FRAGMENTS_LOST = "fragments_lost"
TICKETS_IN_FLIGHT = "tickets_in_flight"
REPLAY_DEPTH = "replay_depth"
REPLAY_ADDED = "replay_added"

# Actors and faults
ROLLOUT_ACTORS = "rollout_actors"
ROLLOUT_AUTOSCALE = "rollout_autoscale"  # rollout.num_actors: auto: the count it asked for this iteration, else null
ROLLOUT_RESTARTS = "rollout_restarts"  # rollout actors replaced, for any fault below or a death
ENV_FAILURES = "env_failures"  # ... because the actor's loop raised (an env's reset or step, a bad observation);
# also counts the sandboxed env children replaced under env.isolation: process (the actor going on)
ROLLOUT_HANGS = "rollout_hangs"  # ... because it made no env step, or did not answer, for a lease
ROLLOUT_MEMORY_KILLS = "rollout_memory_kills"  # ... because it passed rollout.memory_limit_mb
LAST_ROLLOUT_FAULT = "last_rollout_fault"  # the newest such fault, in words (error text included)
LEASES_EXPIRED = "leases_expired"  # tickets given to another actor after their lease ran out
SHARD_RESTARTS = "shard_restarts"
BOARD_RESTARTS = "board_restarts"  # supply boards replaced (killed, stopped answering, or past their memory limit)
BOARD_MEMORY_REPLACEMENTS = "board_memory_replacements"  # ... because it passed run.board_memory_limit_mb
INFERENCE_CALLS = "inference_calls"  # rollout.inference: remote: steps the inference servers answered (current actors)
INFERENCE_FALLBACKS = "inference_fallbacks"  # ... and those the actors' local copies served instead (a server late or dead)
BOARD_RSS_MB = "board_rss_mb"  # the supply board process's RSS at its newest stats answer (in process: the run's; None: unknown)
BOARD_VOIDED = "board_voided"  # fragments stored or in flight under a board that died: void, made again
CONTROL_RESTARTS = "control_restarts"
PREPROCESS_RESTARTS = "preprocess_restarts"  # remote preprocess workers replaced (dead or not answering)
LEARNER_RESTARTS = "learner_restarts"
CHECKPOINTS_SKIPPED = "checkpoints_skipped"
# Updates whose loss statistics, gradient or resulting weights were NaN or inf: not applied (every learner undid
# it), cumulative over the run, resumes included; run.max_nonfinite_updates of them in a row stop the run (exit 3).
UPDATES_SKIPPED_NONFINITE = "updates_skipped_nonfinite"
ROLLOUT_BACKPRESSURE_S = "rollout_backpressure_s"  # cumulative over the live actors' incarnations
ROLLOUT_RATE_LIMITED_S = "rollout_rate_limited_s"  # cumulative over the live actors' incarnations

# Where the rollout actors' time went since the previous record (cluster/host_time.py). Each actor times the stages
# of its loop (actors/rollout.py, actors/sampler.py); they partition the loop's wall time, and what no stage holds is
# ``other``. Seconds are summed over the actors; a share is a stage's seconds over the actors' wall time
# (``rollout_time/wall_s``): the newest measured, an iteration no actor reported in carries the previous ones.
ROLLOUT_WALL_S = "rollout_time/wall_s"
ROLLOUT_ENV_STEP_S = "rollout_time/env_step_s"  # the vector env's step and the book-keeping of what it returned
ROLLOUT_PREPROCESS_S = "rollout_time/preprocess_s"  # the actor's part of the observation pipeline (Dict envs)
ROLLOUT_FORWARD_S = "rollout_time/forward_s"  # the CPU policy copy: actions, values
ROLLOUT_FRAGMENT_S = "rollout_time/fragment_s"  # fragment buffers, GAE and assembly
ROLLOUT_ADD_S = "rollout_time/add_s"  # handing fragments to the replay shard
ROLLOUT_WEIGHTS_S = "rollout_time/weights_s"  # fetching and loading new weights
ROLLOUT_TICKET_WAIT_S = "rollout_time/rate_limited_s"  # waiting for a ticket: the learners are the bound
ROLLOUT_ADD_WAIT_S = "rollout_time/backpressure_s"  # waiting for the previous add's acknowledgement
ROLLOUT_OTHER_S = "rollout_time/other_s"  # the loop's own book-keeping: wall time no stage holds
ROLLOUT_ENV_STEP_SHARE = "rollout_share/env_step"
ROLLOUT_PREPROCESS_SHARE = "rollout_share/preprocess"
ROLLOUT_FORWARD_SHARE = "rollout_share/forward"
ROLLOUT_FRAGMENT_SHARE = "rollout_share/fragment"
ROLLOUT_ADD_SHARE = "rollout_share/add"
ROLLOUT_WEIGHTS_SHARE = "rollout_share/weights"
ROLLOUT_TICKET_WAIT_SHARE = "rollout_share/rate_limited"
ROLLOUT_ADD_WAIT_SHARE = "rollout_share/backpressure"
ROLLOUT_OTHER_SHARE = "rollout_share/other"
#: The stages: (the name an actor times it under, its seconds key, its share key), in the loop's order; ``other`` is
#: not timed but what is left of ``wall_s``.
ROLLOUT_STAGES = (
    ("env_step", ROLLOUT_ENV_STEP_S, ROLLOUT_ENV_STEP_SHARE),
    ("preprocess", ROLLOUT_PREPROCESS_S, ROLLOUT_PREPROCESS_SHARE),
    ("forward", ROLLOUT_FORWARD_S, ROLLOUT_FORWARD_SHARE),
    ("fragment", ROLLOUT_FRAGMENT_S, ROLLOUT_FRAGMENT_SHARE),
    ("add", ROLLOUT_ADD_S, ROLLOUT_ADD_SHARE),
    ("weights", ROLLOUT_WEIGHTS_S, ROLLOUT_WEIGHTS_SHARE),
    ("rate_limited", ROLLOUT_TICKET_WAIT_S, ROLLOUT_TICKET_WAIT_SHARE),
    ("backpressure", ROLLOUT_ADD_WAIT_S, ROLLOUT_ADD_WAIT_SHARE),
    ("other", ROLLOUT_OTHER_S, ROLLOUT_OTHER_SHARE),
)

# Several policies (multiagent.policies): each policy's figures under policy/<name>/<key>, with <key> one of
# MINIBATCH_STATS, GRAD_NORM, LR, POLICY_SAMPLES (its rows in the update's batch) or EPISODE_RETURN_MEAN (its
# agents' episodes in the window) and EPISODES_IN_WINDOW.
POLICY_PREFIX = "policy/"
POLICY_SAMPLES = "samples"


def policy_key(policy: str, key: str) -> str:
    """``policy/<policy>/<key>``; ``key`` empty: the prefix of that policy's keys."""
    return f"{POLICY_PREFIX}{policy}/{key}"
