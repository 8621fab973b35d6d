"""The model's view of an environment: its modalities (what preprocessing made of each key) and its action space.

Plain data without torch: specs are built on the driver from one throwaway env (``actors.envs.describe_env``),
travel to learner actors and into checkpoints, and size the feed's buffers (``cluster.placement``). A Box env is
described like a Dict env with one modality (``vector``, or ``image`` for H x W x C uint8), so every env has the
same kind of spec and the same model family (``learner.model.ActorCritic``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from pipeline.actions import ACTION_KINDS, ActionPart, head_width, mask_width  # numpy and gymnasium only
from pipeline.contract import (  # standard library only: no cv2
    KIND_DTYPES, KINDS, MODEL_SETTINGS, ModalitySpec, category_problem)

#: Observation rank each kind's encoder needs (vectors are flattened: any rank).
KIND_RANKS = {"image": 3, "text": 1, "pointcloud": 2, "audio": 2}


def _input_fields() -> list[tuple]:
    """ModalityInput's fields: what preprocessing made of the key, then the spec settings the model reads.

    The settings are ``pipeline.contract.MODEL_SETTINGS`` with the spec's own annotations and defaults (``kind``
    keeps none: a model input must say what it is), so they are declared once, in the contract.
    """
    hints = typing.get_type_hints(ModalitySpec)
    defaults = {f.name: f.default for f in dataclasses.fields(ModalitySpec)}
    settings = [(name, hints[name], dataclasses.field(default=defaults[name])) for name in MODEL_SETTINGS
                if name != "kind"]
    return [("name", str), ("kind", str), ("shape", tuple), ("dtype", str),
            ("vocab_size", int, dataclasses.field(default=0)), *settings]


class _InputChecks:
    def __post_init__(self):
        # Normalise list/np.dtype inputs so specs built from config data compare and hash equal.
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", getattr(self.dtype, "name", str(self.dtype)))
        if self.categories is not None:
            object.__setattr__(self, "categories", tuple(int(c) for c in self.categories))
        if not self.name or "." in self.name:
            # Names become module keys (state_dict prefixes); '.' would split them.
            raise ValueError(f"modality name must be non-empty and contain no '.': {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"modality {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        # A Box env's uint8 vector stays uint8 up to the device, like an image (the encoder casts there).
        allowed = {KIND_DTYPES[self.kind]} | ({"uint8"} if self.kind == "vector" else set())
        if self.dtype not in allowed:
            raise ValueError(f"modality {self.name!r} ({self.kind}): dtype {self.dtype} expected "
                             f"{' or '.join(sorted(allowed))}")
        expected_rank = KIND_RANKS.get(self.kind)
        if expected_rank is not None and len(self.shape) != expected_rank:
            raise ValueError(f"modality {self.name!r} ({self.kind}): shape {self.shape} must have {expected_rank} dims")
        if self.kind == "pointcloud" and self.shape[1] != 3:
            raise ValueError(f"modality {self.name!r} (pointcloud): shape {self.shape} must be (N, 3)")
        if self.kind == "text" and self.vocab_size < 2:
            raise ValueError(f"modality {self.name!r} (text): vocab_size must be >= 2 (0 = pad, 1 = unknown)")
        if self.kind == "image" and self.scale <= 0:
            raise ValueError(f"modality {self.name!r} (image): scale must be > 0")
        if self.categories is not None:
            problem = category_problem(self.categories, self.kind, self.shape)
            if problem:
                raise ValueError(f"modality {self.name!r} ({self.kind}): {problem}")
        if any(s <= 0 for s in self.shape):
            raise ValueError(f"modality {self.name!r}: shape {self.shape} has an empty dimension")

    @property
    def nbytes(self) -> int:
        """Bytes of one env's value."""
        n = {"uint8": 1, "int64": 8}.get(self.dtype, 4)
        for d in self.shape:
            n *= d
        return n


#: What the model needs to know about one preprocessed modality: ``name``, ``kind``, ``shape`` (one env's value,
#: without the batch dimension), ``dtype`` (numpy name: KIND_DTYPES[kind]; uint8 also for a Box env's vector),
#: ``vocab_size`` (text: ids lie in [0, vocab_size), 0 is padding), and the rest of MODEL_SETTINGS (``scale``:
#: images are divided by it on the device; ``normalize``: vectors get running mean/std normalisation; ``categories``:
#: a vector of ids is one-hot on the device), as
#: ``actors.envs.describe_env`` reports them.
ModalityInput = dataclasses.make_dataclass("ModalityInput", _input_fields(), bases=(_InputChecks,), frozen=True)
ModalityInput.__module__ = __name__  # pickled by reference: model specs travel to learner actors


@dataclass(frozen=True)
class PolicyEntry:
    """One policy of a multi-agent run's ``multiagent.policies``: its name, its own hidden layers (None: the
    learner's), its own learning rate (None: the learner's) and whether it trains at all."""

    name: str
    hidden_sizes: tuple[int, ...] | None = None
    lr: float | None = None
    frozen: bool = False

    def __post_init__(self):
        if self.hidden_sizes is not None:
            object.__setattr__(self, "hidden_sizes", tuple(int(h) for h in self.hidden_sizes))


@dataclass(frozen=True)
class PolicySpec:
    """The model's view of the environment: its modalities and its action space."""

    modalities: tuple[ModalityInput, ...]
    #: "discrete" (one Categorical over ``action_dim`` choices, stored as an int64), "continuous" (one diagonal
    #: Gaussian of ``action_dim`` dims) or "composite" (``action_parts``, stored as ``action_dim`` float32 columns;
    #: ``pipeline.actions``).
    action_kind: str
    action_dim: int
    #: Hidden layers after the encoders: CleanRL's separate actor and critic MLPs for state-only observations,
    #: one shared trunk otherwise (may be empty: the heads then sit directly on the fused features).
    hidden_sizes: tuple[int, ...] = (64, 64)
    #: The distributions read off the policy head, in order (``pipeline.actions.ActionPart``, or (kind, size)
    #: pairs); empty for discrete and continuous, which are one part of ``action_dim``.
    action_parts: tuple = ()
    #: The observation key holding the action mask (one flag per choice of every categorical part), or None.
    action_mask: str | None = None
    #: Recurrent core after the trunk: "lstm", "gru" or None (learner.rnn), and its width.
    rnn: str | None = None
    rnn_hidden_size: int = 128
    #: Several policies in one model (``learner.model.PolicySet``, ``multiagent.policies``): empty for one policy.
    #: Each row of an observation then ends in one more column, the index of the policy that acts for it
    #: (``actors.multiagent.AgentSlotVectorEnv`` appends it), and each policy reads the columns before it.
    policies: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "modalities", tuple(self.modalities))
        object.__setattr__(self, "hidden_sizes", tuple(int(h) for h in self.hidden_sizes))
        if not self.modalities:
            raise ValueError("PolicySpec needs at least one modality")
        names = [m.name for m in self.modalities]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate modality names: {names}")
        if self.action_kind not in ACTION_KINDS:
            raise ValueError(f"action_kind must be one of {ACTION_KINDS}, got {self.action_kind!r}")
        if self.action_dim < 1:
            raise ValueError("action_dim must be >= 1")
        parts = tuple(p if isinstance(p, ActionPart) else ActionPart(*p) for p in self.action_parts)
        if self.action_kind != "composite":
            kind = "categorical" if self.action_kind == "discrete" else "gaussian"
            if parts and parts != (ActionPart(kind, self.action_dim),):
                raise ValueError(f"{self.action_kind} action: action_parts must be empty or ({kind}, {self.action_dim})")
            parts = (ActionPart(kind, self.action_dim),)
        elif not parts or sum(p.stored_width for p in parts) != self.action_dim:
            raise ValueError(f"composite action: action_dim {self.action_dim} must be the stored width of "
                             f"action_parts {parts}")
        object.__setattr__(self, "action_parts", parts)
        if self.rnn not in (None, "lstm", "gru"):
            raise ValueError(f"learner.rnn: {self.rnn!r} is not one of null, lstm, gru")
        if self.rnn is not None and self.rnn_hidden_size < 1:
            raise ValueError(f"learner.rnn_hidden_size: {self.rnn_hidden_size}; must be >= 1")
        policies = tuple(p if isinstance(p, PolicyEntry) else PolicyEntry(**p) for p in self.policies)
        object.__setattr__(self, "policies", policies)
        if policies:
            if len({p.name for p in policies}) != len(policies):
                raise ValueError(f"multiagent.policies: duplicate names {[p.name for p in policies]}")
            if len(self.modalities) != 1 or self.modalities[0].kind != "vector" or len(self.modalities[0].shape) != 1:
                raise ValueError("multiagent.policies: several policies need flat Box (vector) observations")
            if self.rnn is not None:
                raise ValueError(f"learner.rnn: {self.rnn!r} with multiagent.policies; allowed: null (several "
                                 f"recurrent policies are not built yet)")
        if self.action_mask is not None:
            if self.action_mask in names:
                raise ValueError(f"action mask key {self.action_mask!r} is also a modality")
            if not self.mask_width:
                raise ValueError(f"action mask key {self.action_mask!r} set, but the actions have no discrete part")

    def policy_spec(self, entry: PolicyEntry) -> "PolicySpec":
        """The spec of one policy of ``policies``: the observation without its policy-index column, and the
        policy's own hidden layers."""
        vector = self.modalities[0]
        columns = dataclasses.replace(vector, shape=(vector.shape[0] - 1,))
        return dataclasses.replace(self, modalities=(columns,), policies=(),
                                   hidden_sizes=entry.hidden_sizes if entry.hidden_sizes is not None
                                   else self.hidden_sizes)

    @property
    def state_only(self) -> bool:
        """Every modality a vector: nothing expensive to encode, so actor and critic get their own MLPs."""
        return all(m.kind == "vector" for m in self.modalities)

    @property
    def state_size(self) -> int:
        """Floats of one env's recurrent state (an LSTM's h and c side by side); 0 without a core."""
        if self.rnn is None:
            return 0
        return self.rnn_hidden_size * (2 if self.rnn == "lstm" else 1)

    @property
    def head_width(self) -> int:
        """Policy head outputs: logits per choice, means per Gaussian dim, logits per Bernoulli dim."""
        return head_width(self.action_parts)

    @property
    def gaussian_dims(self) -> int:
        """Dims with a learned log std."""
        return sum(p.size for p in self.action_parts if p.kind == "gaussian")

    @property
    def mask_width(self) -> int:
        return mask_width(self.action_parts)

    @property
    def sample_nbytes(self) -> int:
        """Bytes of one sample in the learner's feed: observations at their dtypes, the action (and its mask),
        and logp / value / advantage / return (float32)."""
        action = 8 if self.action_kind == "discrete" else 4 * self.action_dim
        mask = self.mask_width if self.action_mask is not None else 0
        recurrent = 4 * self.state_size + 1 if self.rnn else 0  # the stored state and the episode-start flag
        return sum(m.nbytes for m in self.modalities) + action + mask + recurrent + 4 * 4


def spec_from_description(description: dict, hidden_sizes: tuple[int, ...], rnn: str | None = None,
                          rnn_hidden_size: int = 128, policies: tuple = ()) -> PolicySpec:
    """``actors.envs.describe_env`` output (plain data) and the learner's model settings -> the model's spec.
    ``policies``: ``PolicyEntry`` items (or their fields as dicts) of a run with several policies."""
    return PolicySpec(modalities=tuple(ModalityInput(**m) for m in description["modalities"]),
                      action_kind=description["action_kind"], action_dim=description["action_dim"],
                      hidden_sizes=tuple(hidden_sizes),
                      action_parts=tuple(tuple(p) for p in description.get("action_parts", ())),
                      action_mask=description.get("action_mask"), rnn=rnn, rnn_hidden_size=rnn_hidden_size,
                      policies=tuple(policies))
