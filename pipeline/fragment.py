"""The fragment contract: the one place that names batch keys.

A fragment is T steps x N envs of experience from one rollout actor, produced
by exactly one policy version. Arrays are time-major ``(T, N, ...)``. Keys are
constants here so a typo is an AttributeError, not a silent KeyError later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: ``obs/<modality>``: one per modality (a Box env's one is ``obs/vector`` or ``obs/image``).
OBS_PREFIX = "obs/"
#: Per slow modality, the env step its value in ``obs/<modality>`` was emitted at (what the actor saw).
OBS_SOURCE_PREFIX = "obs_src/"
ACTIONS = "actions"
LOGP = "logp"  # behaviour log-prob of ``actions`` under the policy that acted
VALUES = "values"  # behaviour value estimates V(s_t)
REWARDS = "rewards"
TERMINATED = "terminated"
TRUNCATED = "truncated"
ADVANTAGES = "advantages"  # GAE(lambda), computed on the rollout host
RETURNS = "returns"  # advantages + values: the value-function target

#: Recurrent policies only: the behaviour policy's recurrent state going into step t (zeros at an episode's
#: first step), and whether step t begins an episode. The learner starts each training sequence from the stored
#: state at its first step and resets the state inside a sequence where an episode begins.
RNN_STATE = "rnn_state"
EPISODE_START = "episode_start"
RECURRENT_KEYS = (RNN_STATE, EPISODE_START)

#: Keys the learner trains on (observations are added by prefix; RECURRENT_KEYS where the fragment has them).
TRAIN_KEYS = (ACTIONS, LOGP, VALUES, ADVANTAGES, RETURNS)

ALL_KEYS = (ACTIONS, LOGP, VALUES, REWARDS, TERMINATED, TRUNCATED, ADVANTAGES, RETURNS)


def obs_key(modality: str) -> str:
    return OBS_PREFIX + modality


def obs_source_key(modality: str) -> str:
    return OBS_SOURCE_PREFIX + modality


def obs_keys(arrays: dict) -> list[str]:
    return sorted(k for k in arrays if k.startswith(OBS_PREFIX))


def train_keys(arrays: dict) -> list[str]:
    """Every key of a fragment the learner's batch holds."""
    return obs_keys(arrays) + list(TRAIN_KEYS) + [k for k in RECURRENT_KEYS if k in arrays]


@dataclass
class Fragment:
    """One fixed-length piece of experience plus its metadata.

    Ray serialises the numpy arrays out of band, so a reader on the same node
    gets zero-copy views into the object store.
    """

    arrays: dict[str, np.ndarray]
    policy_version: int
    actor_id: int
    #: Returns and lengths of the episodes that finished inside this fragment.
    episode_returns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    episode_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: Several policies (multiagent.policies): the index of the policy that played each finished episode; else empty.
    episode_policies: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def num_steps(self) -> int:
        return int(self.arrays[ACTIONS].shape[0])

    @property
    def num_envs(self) -> int:
        return int(self.arrays[ACTIONS].shape[1])

    @property
    def num_samples(self) -> int:
        return self.num_steps * self.num_envs

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def flat(self, key: str) -> np.ndarray:
        """``(T, N, ...)`` -> ``(T*N, ...)`` without a copy."""
        a = self.arrays[key]
        return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


@dataclass(frozen=True)
class FragmentMeta:
    """What a replay shard needs to know about a fragment without reading it."""

    policy_version: int
    actor_id: int
    num_samples: int
    nbytes: int

    @staticmethod
    def of(fragment: Fragment) -> "FragmentMeta":
        return FragmentMeta(fragment.policy_version, fragment.actor_id, fragment.num_samples, fragment.nbytes)
