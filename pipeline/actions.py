"""Action spaces as the model sees them, and back: the one place that knows gymnasium's action space types.

The model's policy head emits one flat vector per env; an action space is a list of **parts** read off it in
order, each with its own distribution:

* ``categorical`` (``size`` choices): a ``Discrete``, or one element of a ``MultiDiscrete``;
* ``gaussian`` (``size`` dims, diagonal, state-independent log std): a floating ``Box`` of any shape, flattened;
* ``bernoulli`` (``size`` dims, one logit each): a ``MultiBinary`` of any shape, flattened.

``Tuple`` and ``Dict`` spaces (nested too) are the concatenation of their leaves' parts; the log-prob and the
entropy of an action are the sums over its parts. Stored actions keep what was sampled (before clipping):

* ``discrete`` (one ``Discrete``): an int64 per env, as before this module existed (the fused update reads it);
* ``continuous`` (one floating ``Box``): float32 ``(N, prod(shape))``; the env gets it clipped and reshaped;
* ``composite`` (everything else): float32 ``(N, width)``, one column per categorical part (the choice index,
  exact in float32 below 2**24) and one per gaussian or bernoulli dim.

``ActionCodec.to_env`` turns a batch of stored actions into what each env's ``step`` takes, in the env's own
types (``Discrete.start`` and ``MultiDiscrete.start`` added back, Box bounds applied, shapes restored).

Action masks (a Dict observation key, ``env.action_mask_key``) cover the categorical parts: one flag per choice
of every categorical part, in part order (PettingZoo's classic convention for one ``Discrete``, and sb3-contrib's
for ``MultiDiscrete``). Numpy and gymnasium only: rollout actors, the driver and the model all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np

PART_KINDS = ("categorical", "gaussian", "bernoulli")
ACTION_KINDS = ("discrete", "continuous", "composite")

#: What ``describe`` accepts, for the error that names an unsupported space.
ALLOWED = "Discrete, MultiDiscrete, MultiBinary, a floating Box of any shape, and Tuple or Dict of those"


@dataclass(frozen=True)
class ActionPart:
    kind: str
    size: int

    def __post_init__(self):
        if self.kind not in PART_KINDS:
            raise ValueError(f"action part kind {self.kind!r} is not one of {PART_KINDS}")
        if self.size < 1:
            raise ValueError(f"action part {self.kind} has size {self.size}; must be >= 1")

    @property
    def stored_width(self) -> int:
        """Columns of a stored composite action: the choice index, or one value per dim."""
        return 1 if self.kind == "categorical" else self.size


def stored_width(parts) -> int:
    return sum(p.stored_width for p in parts)


def head_width(parts) -> int:
    """Outputs of the policy head: logits per choice, means per gaussian dim, logits per bernoulli dim."""
    return sum(p.size for p in parts)


def mask_width(parts) -> int:
    """Flags in an action mask: one per choice of every categorical part (0: nothing to mask)."""
    return sum(p.size for p in parts if p.kind == "categorical")


class _Leaf:
    """One Discrete / MultiDiscrete / MultiBinary / Box inside the space, with its columns in a stored action."""

    def __init__(self, space, column: int):
        self.space, self.column = space, column
        if isinstance(space, gym.spaces.Discrete):
            self.parts = (ActionPart("categorical", int(space.n)),)
            self.start = int(space.start)
        elif isinstance(space, gym.spaces.MultiDiscrete):
            self.parts = tuple(ActionPart("categorical", int(n)) for n in space.nvec.reshape(-1))
            self.start = np.asarray(space.start, dtype=np.int64)
        elif isinstance(space, gym.spaces.MultiBinary):
            self.parts = (ActionPart("bernoulli", int(np.prod(space.shape))),)
        else:  # a floating Box (``_leaves`` checked)
            self.parts = (ActionPart("gaussian", int(np.prod(space.shape))),)
            self.low = space.low.reshape(-1).astype(np.float32)
            self.high = space.high.reshape(-1).astype(np.float32)
        self.width = stored_width(self.parts)

    def to_env(self, columns: np.ndarray):
        """One env's stored columns -> this leaf's value in the env's type."""
        space = self.space
        if isinstance(space, gym.spaces.Discrete):
            return np.int64(round(float(columns[0]))) + self.start
        if isinstance(space, gym.spaces.MultiDiscrete):
            return (np.rint(columns).astype(np.int64).reshape(space.shape) + self.start).astype(space.dtype)
        if isinstance(space, gym.spaces.MultiBinary):
            return columns.reshape(space.shape).astype(space.dtype)
        return np.clip(columns, self.low, self.high).reshape(space.shape).astype(space.dtype)


def _leaves(space, where: str, column: int = 0) -> list[tuple[tuple, _Leaf]]:
    """(path, leaf) for every leaf of ``space``, depth first, in the space's own order."""
    if isinstance(space, (gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
        return [((), _Leaf(space, column))]
    if isinstance(space, gym.spaces.Box):
        if not np.issubdtype(space.dtype, np.floating):
            raise ValueError(f"{where} has action space {space} (a Box of {space.dtype}); allowed: {ALLOWED}")
        if not space.shape or int(np.prod(space.shape)) == 0:
            raise ValueError(f"{where} has action space {space} (no dimensions); allowed: {ALLOWED}")
        return [((), _Leaf(space, column))]
    if isinstance(space, (gym.spaces.Tuple, gym.spaces.Dict)):
        items = enumerate(space.spaces) if isinstance(space, gym.spaces.Tuple) else space.spaces.items()
        out = []
        for key, sub in items:
            for path, leaf in _leaves(sub, where, column):
                out.append(((key,) + path, leaf))
                column += leaf.width
        if not out:
            raise ValueError(f"{where} has action space {space} (empty); allowed: {ALLOWED}")
        return out
    raise ValueError(f"{where} has action space {space}; allowed: {ALLOWED}")


class ActionCodec:
    """An env's action space as parts, and stored actions back into the env's types.

    ``where`` names the space in errors (e.g. ``"env.id 'CartPole-v1'"``).
    """

    def __init__(self, space, where: str = "the env"):
        self.space = space
        self._leaves = _leaves(space, where)
        self.parts: tuple[ActionPart, ...] = tuple(p for _, leaf in self._leaves for p in leaf.parts)
        # One Discrete or one Box keeps its own storage (an int64 index; a flat float vector): the layouts the
        # fused update and every earlier run were built on. Anything else is composite.
        self.kind = ("discrete" if isinstance(space, gym.spaces.Discrete)
                     else "continuous" if isinstance(space, gym.spaces.Box) else "composite")
        self.width = stored_width(self.parts)
        self.mask_width = mask_width(self.parts)

    @property
    def action_dim(self) -> int:
        """``PolicySpec.action_dim``: a Discrete's number of choices, else the stored width."""
        return self.parts[0].size if self.kind == "discrete" else self.width

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """One env's stored action: () for a Discrete, (width,) otherwise."""
        return () if self.kind == "discrete" else (self.width,)

    @property
    def stored_dtype(self) -> np.dtype:
        return np.dtype(np.int64) if self.kind == "discrete" else np.dtype(np.float32)

    def to_env(self, actions: np.ndarray):
        """Stored actions ``(N, *stored_shape)`` -> what each env's ``step`` takes: an (N,) or (N, *shape) array
        for one Discrete or Box, a list of N tuples or dicts for a composite space."""
        if self.kind == "discrete":
            (_, leaf), = self._leaves
            return actions + leaf.start if leaf.start else actions
        if self.kind == "continuous":
            (_, leaf), = self._leaves
            clipped = np.clip(actions, leaf.low, leaf.high)
            return clipped.reshape((len(actions),) + self.space.shape).astype(self.space.dtype, copy=False)
        return [self._one(row) for row in actions]

    def _one(self, row: np.ndarray):
        values = [(path, leaf.to_env(row[leaf.column:leaf.column + leaf.width])) for path, leaf in self._leaves]
        return _rebuild(self.space, values)

    def describe(self) -> str:
        return ", ".join(f"{p.kind} {p.size}" for p in self.parts)


def _rebuild(space, values: list[tuple[tuple, object]]):
    """The nested Tuple/Dict value from (path, leaf value) pairs in ``_leaves`` order."""
    if not isinstance(space, (gym.spaces.Tuple, gym.spaces.Dict)):
        ((_, value),) = values
        return value
    keys = range(len(space.spaces)) if isinstance(space, gym.spaces.Tuple) else list(space.spaces)
    out = {}
    for key in keys:
        out[key] = _rebuild(space[key], [(path[1:], v) for path, v in values if path[0] == key])
    return tuple(out[k] for k in keys) if isinstance(space, gym.spaces.Tuple) else out


def read_masks(values, parts, source: str, what) -> np.ndarray:
    """(N, mask width) bool from N environments' raw mask values (``source`` names them in a shape error), checked
    by ``check_mask`` (``what(env_index)``: where an all-zero mask came from)."""
    try:
        mask = np.stack([np.asarray(v) for v in values]).astype(bool, copy=False)
    except ValueError as e:
        raise ValueError(f"{source}: action masks of different shapes ({e})") from None
    width = mask_width(parts)
    if mask.shape[1:] != (width,):
        raise ValueError(f"{source}: action mask has shape {mask.shape[1:]}; expected ({width},)")
    check_mask(mask, parts, what)
    return mask


def check_mask(mask: np.ndarray, parts, what) -> None:
    """Raise if any env's mask leaves a categorical part with no legal choice. ``what(env_index)``: where it came
    from, for the message (the env id, the env and the step)."""
    offset = 0
    for index, part in enumerate(parts):
        if part.kind != "categorical":
            continue
        legal = mask[:, offset:offset + part.size].any(axis=1)
        if not legal.all():
            env = int(np.flatnonzero(~legal)[0])
            where = f" (action part {index})" if len(parts) > 1 else ""
            raise ValueError(f"action mask is all zero{where}: {what(env)}; at least one action must be legal")
        offset += part.size
