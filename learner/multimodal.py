"""Multimodal actor-critic: one encoder per observation modality, fused into a shared trunk.

Observations arrive as a dict of tensors keyed by modality name, each of shape
``(B, *shape)`` with the pipeline Processor's dtype (images ``uint8`` channels-last,
text ``int64`` token ids, everything else ``float32``). Each modality gets a small
encoder chosen by its kind; the encoders' outputs are concatenated into one fused
feature vector, a shared trunk MLP follows, and a policy head and a value head sit on
the trunk. Unlike :class:`learner.model.ActorCritic` (CleanRL's separate actor and
critic MLPs) the policy and value share the encoders and trunk: encoding a camera frame
or a point cloud is the expensive part, so it is done once per call.

The public interface mirrors ``ActorCritic``: ``act`` (rollout actors: sample, log-prob,
value in one pass), ``evaluate`` (learner: log-prob, entropy, value of stored actions)
and ``value``; plus ``update_normalizers`` for the running statistics of vector inputs.

Device discipline: the forward paths never read a value back to the host (no
``.item()``, no data-dependent Python branching) so the learner keeps its one host sync
per update, and images are converted from ``uint8`` to float only after they are on the
model's device, so the host-device link carries a quarter of the bytes.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from learner.model import POLICY_HEAD_STD, VALUE_HEAD_STD, Tanh, action_logp_entropy, layer_init, sample_action
from pipeline.contract import KIND_DTYPES, KINDS, MODEL_SETTINGS, ModalitySpec  # standard library only: no cv2

#: Output width of each encoder. Small on purpose: the fused vector feeds one shared trunk,
#: and PPO on these tasks is limited by sample count, not by encoder capacity.
IMAGE_FEATURES = 64
TEXT_EMBED_DIM = 32
TEXT_FEATURES = 64
POINT_FEATURES = 64
AUDIO_CHANNELS = 32
AUDIO_FEATURES = 32
VECTOR_FEATURES = 64

#: Images whose shorter side is at most this use the minigrid-style 2x2 conv stack.
SMALL_IMAGE_MAX_SIDE = 10
#: Larger images are halved by stride-2 convs until the shorter side is at most this.
LARGE_IMAGE_TARGET_SIDE = 4

#: Running-statistics constants, as gymnasium's RunningMeanStd / NormalizeObservation.
NORM_EPS = 1e-8
NORM_CLIP = 10.0
NORM_INITIAL_COUNT = 1e-4


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
        object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        if not self.name or "." in self.name:
            # Names become module keys (state_dict prefixes); '.' would split them.
            raise ValueError(f"modality name must be non-empty and contain no '.': {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"modality {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.dtype != KIND_DTYPES[self.kind]:
            raise ValueError(
                f"modality {self.name!r} ({self.kind}): dtype {self.dtype} expected {KIND_DTYPES[self.kind]}"
            )
        expected_rank = {"image": 3, "text": 1, "pointcloud": 2, "audio": 2}.get(self.kind)
        if expected_rank is not None and len(self.shape) != expected_rank:
            raise ValueError(f"modality {self.name!r} ({self.kind}): shape {self.shape} must have {expected_rank} dims")
        if self.kind == "pointcloud" and self.shape[1] != 3:
            raise ValueError(f"modality {self.name!r} (pointcloud): shape {self.shape} must be (N, 3)")
        if self.kind == "text" and self.vocab_size < 2:
            raise ValueError(f"modality {self.name!r} (text): vocab_size must be >= 2 (0 = pad, 1 = unknown)")
        if self.kind == "image" and self.scale <= 0:
            raise ValueError(f"modality {self.name!r} (image): scale must be > 0")
        if any(s <= 0 for s in self.shape):
            raise ValueError(f"modality {self.name!r}: shape {self.shape} has an empty dimension")


#: What the model needs to know about one preprocessed modality: ``name``, ``kind``, ``shape`` (one env's value,
#: without the batch dimension), ``dtype`` (numpy name: KIND_DTYPES[kind]), ``vocab_size`` (text: ids lie in
#: [0, vocab_size), 0 is padding), and the rest of MODEL_SETTINGS (``scale``: images are divided by it on the device;
#: ``normalize``: vectors get running mean/std normalisation), as ``actors.envs.describe_modalities`` reports them.
ModalityInput = dataclasses.make_dataclass("ModalityInput", _input_fields(), bases=(_InputChecks,), frozen=True)
ModalityInput.__module__ = __name__  # pickled by reference: model specs travel to learner actors


@dataclass(frozen=True)
class MultiModalSpec:
    """The model's view of the environment: its modalities and its action space."""

    modalities: tuple[ModalityInput, ...]
    #: "discrete" (Categorical over ``action_dim`` choices) or "continuous" (diagonal Gaussian).
    action_kind: str
    action_dim: int
    #: Shared trunk after fusion (may be empty: the heads then sit directly on the fused features).
    hidden_sizes: tuple[int, ...] = (128,)

    def __post_init__(self):
        object.__setattr__(self, "modalities", tuple(self.modalities))
        object.__setattr__(self, "hidden_sizes", tuple(int(h) for h in self.hidden_sizes))
        if not self.modalities:
            raise ValueError("MultiModalSpec needs at least one modality")
        names = [m.name for m in self.modalities]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate modality names: {names}")
        if self.action_kind not in ("discrete", "continuous"):
            raise ValueError(f"action_kind must be 'discrete' or 'continuous', got {self.action_kind!r}")
        if self.action_dim < 1:
            raise ValueError("action_dim must be >= 1")

    @property
    def action_shape(self) -> tuple[int, ...]:
        return () if self.action_kind == "discrete" else (self.action_dim,)

    @property
    def action_dtype(self):
        return np.int64 if self.action_kind == "discrete" else np.float32


def conv_init(layer: nn.Conv1d | nn.Conv2d, std: float = math.sqrt(2)) -> nn.Module:
    """Orthogonal init (over the flattened in_channels x kernel fan-in) with zero bias, like ``layer_init``."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


# --------------------------------------------------------------------------- encoders
#
# Every encoder takes the batch as it sits in the obs dict, (B, *shape) on the model's
# device, and returns (B, out_dim) float features. Encoders end in ReLU (conv/MLP feature
# extractors, as in the minigrid and Atari PPO baselines); the trunk after fusion is tanh.


class ImageEncoder(nn.Module):
    """(B, H, W, C) uint8 -> (B, IMAGE_FEATURES).

    Small inputs (minigrid's 7x7x3 symbolic view, where one cell is one pixel) get three
    2x2 stride-1 convs as in the minigrid PPO baselines: a 3x3 stride-2 conv would skip
    over cells. Larger frames are halved by 3x3 stride-2 convs until the map is small, which
    keeps the flattened size (and the Linear after it) bounded whatever the resolution.
    """

    def __init__(self, mod: ModalityInput):
        super().__init__()
        height, width, channels = mod.shape
        self.scale = float(mod.scale)
        layers: list[nn.Module] = []
        if min(height, width) <= SMALL_IMAGE_MAX_SIDE:
            if min(height, width) < 4:
                raise ValueError(f"modality {mod.name!r} (image): {mod.shape} too small for three 2x2 convs")
            in_ch = channels
            for out_ch in (16, 32, 64):
                layers += [conv_init(nn.Conv2d(in_ch, out_ch, kernel_size=2)), nn.ReLU()]
                in_ch = out_ch
        else:
            in_ch, side, widths = channels, min(height, width), (16, 32)
            i = 0
            while side > LARGE_IMAGE_TARGET_SIDE:
                out_ch = widths[i] if i < len(widths) else 32
                layers += [conv_init(nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=2, padding=1)), nn.ReLU()]
                in_ch, side, i = out_ch, (side + 1) // 2, i + 1
        self.convs = nn.Sequential(*layers)
        self.conv_channels = in_ch
        # The flatten size depends on the conv arithmetic; a dummy forward gets it right for any shape.
        with torch.no_grad():
            flat = self.convs(torch.zeros(1, channels, height, width)).numel()
        self.head = nn.Sequential(nn.Flatten(), layer_init(nn.Linear(flat, IMAGE_FEATURES)), nn.ReLU())
        self.out_dim = IMAGE_FEATURES

    def to_float(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 channels-last -> float channels-first in [0, 255 / scale]; runs on the model's device."""
        return x.permute(0, 3, 1, 2).float() / self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.convs(self.to_float(x)))


class TextEncoder(nn.Module):
    """(B, L) int64 token ids (0 = padding) -> (B, TEXT_FEATURES).

    Bag of words: the masked mean of the token embeddings. Minigrid-style missions ("get a
    red ball", "open the yellow door") are identified by which words occur, and word order
    rarely matters within such a family, so a mean keeps what counts at the cost of one
    embedding lookup. A GRU would add a sequential L-step loop on every act and evaluate
    for information these missions do not carry. Padding is masked out of the mean, so
    the same mission padded to different lengths encodes identically.
    """

    def __init__(self, mod: ModalityInput):
        super().__init__()
        self.embedding = nn.Embedding(mod.vocab_size, TEXT_EMBED_DIM, padding_idx=0)
        self.head = nn.Sequential(layer_init(nn.Linear(TEXT_EMBED_DIM, TEXT_FEATURES)), nn.ReLU())
        self.out_dim = TEXT_FEATURES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.long()
        mask = (tokens != 0).unsqueeze(-1)
        emb = self.embedding(tokens)
        summed = (emb * mask.to(emb.dtype)).sum(dim=1)
        # clamp, not a branch: an all-padding mission gives a zero mean without a host sync.
        count = mask.sum(dim=1).clamp(min=1).to(emb.dtype)
        return self.head(summed / count)


class PointCloudEncoder(nn.Module):
    """(B, N, 3) float32 -> (B, POINT_FEATURES), PointNet style.

    A shared per-point MLP followed by a max over points: the result does not depend on
    the points' order and ignores duplicates (the pipeline pads short clouds by repeating
    points for exactly this reason).
    """

    def __init__(self, mod: ModalityInput):
        super().__init__()
        self.point_mlp = nn.Sequential(
            layer_init(nn.Linear(3, 64)), nn.ReLU(), layer_init(nn.Linear(64, POINT_FEATURES)), nn.ReLU()
        )
        self.out_dim = POINT_FEATURES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.point_mlp(x.float()).amax(dim=1)


class AudioEncoder(nn.Module):
    """(B, frames, bins) float32 log-magnitude spectrogram -> (B, AUDIO_FEATURES).

    Conv1d over time with the frequency bins as channels (each filter is a spectral pattern
    across 3 frames), then mean and max over frames concatenated: the mean describes the
    steady background, the max catches a short event wherever it falls in the window.
    """

    def __init__(self, mod: ModalityInput):
        super().__init__()
        _, bins = mod.shape
        # padding=1 keeps the frame count, so even a 1-frame window is accepted.
        self.conv = nn.Sequential(conv_init(nn.Conv1d(bins, AUDIO_CHANNELS, kernel_size=3, padding=1)), nn.ReLU())
        self.head = nn.Sequential(layer_init(nn.Linear(2 * AUDIO_CHANNELS, AUDIO_FEATURES)), nn.ReLU())
        self.out_dim = AUDIO_FEATURES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.float().transpose(1, 2))  # (B, channels, frames)
        return self.head(torch.cat([h.mean(dim=2), h.amax(dim=2)], dim=1))


class VectorEncoder(nn.Module):
    """(B, *shape) float32, flattened -> (B, VECTOR_FEATURES), optionally normalised first.

    The running mean/var are buffers, not parameters: they get no gradient, but they are
    in ``state_dict`` and so travel with the weights. A rollout actor loading policy
    version k therefore normalises with exactly the statistics the learner used for k.
    """

    def __init__(self, mod: ModalityInput):
        super().__init__()
        dim = int(np.prod(mod.shape))
        self.normalize = bool(mod.normalize)
        if self.normalize:
            # Same starting point as gymnasium's RunningMeanStd: a tiny pseudo-count at mean 0,
            # var 1, so the first real batch dominates and nothing divides by zero.
            self.register_buffer("running_mean", torch.zeros(dim, dtype=torch.float32))
            self.register_buffer("running_var", torch.ones(dim, dtype=torch.float32))
            self.register_buffer("running_count", torch.tensor(NORM_INITIAL_COUNT, dtype=torch.float32))
        self.mlp = nn.Sequential(layer_init(nn.Linear(dim, VECTOR_FEATURES)), nn.ReLU())
        self.out_dim = VECTOR_FEATURES

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1).float()
        if not self.normalize:
            return flat
        z = (flat - self.running_mean) / torch.sqrt(self.running_var + NORM_EPS)
        return z.clamp(-NORM_CLIP, NORM_CLIP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.normalized(x))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold a batch into the running statistics (Chan et al.'s parallel merge of two
        (count, mean, M2) summaries, with M2 = var * count). Runs on the device, no host sync."""
        if not self.normalize:
            return
        flat = x.reshape(x.shape[0], -1).float()
        batch_count = flat.shape[0]  # a shape, not a tensor read: no sync
        if batch_count == 0:
            return
        batch_mean = flat.mean(dim=0)
        batch_var = flat.var(dim=0, unbiased=False)  # population variance, as np.var
        count = self.running_count
        total = count + batch_count
        delta = batch_mean - self.running_mean
        new_mean = self.running_mean + delta * (batch_count / total)
        m2 = self.running_var * count + batch_var * batch_count + delta.square() * (count * batch_count / total)
        self.running_mean.copy_(new_mean)
        self.running_var.copy_(m2 / total)
        self.running_count.copy_(total)


ENCODERS = {
    "image": ImageEncoder,
    "text": TextEncoder,
    "pointcloud": PointCloudEncoder,
    "audio": AudioEncoder,
    "vector": VectorEncoder,
}


# --------------------------------------------------------------------------- actor-critic


class MultiModalActorCritic(nn.Module):
    """Shared multimodal encoder + tanh trunk, with a policy head and a value head.

    The trunk uses tanh, like ``learner.model.mlp`` and the minigrid PPO baselines' actor and
    critic layers: the heads then see bounded features whatever the encoders' (ReLU, unbounded)
    scale, which keeps the initial policy near uniform through the 0.01-gain head and the
    early value targets from being dominated by one large modality.
    """

    def __init__(self, spec: MultiModalSpec):
        super().__init__()
        self.spec = spec
        self.modality_names = tuple(m.name for m in spec.modalities)
        self.modality_shapes = {m.name: m.shape for m in spec.modalities}
        self.modality_kinds = {m.name: m.kind for m in spec.modalities}
        self.encoders = nn.ModuleDict()
        for mod in spec.modalities:
            try:
                self.encoders[mod.name] = ENCODERS[mod.kind](mod)
            except KeyError as e:  # ModuleDict refuses names that shadow its own attributes ("keys", ...)
                raise ValueError(f"modality name {mod.name!r} cannot be used as a module key: {e}") from e
        # Instruction conditioning (FiLM, as in the BabyAI baselines): when there is text, each image encoder's
        # conv feature map is scaled and shifted per channel by functions of the text features. A plain concat
        # leaves the trunk to learn "the colour the text names, at the place the camera shows it" as an
        # XOR-like product of two inputs, which PPO learns slowly; FiLM makes the product one layer deep.
        # Zero-initialised, so the model starts as the plain concat.
        self.text_names = tuple(m.name for m in spec.modalities if m.kind == "text")
        self.film = nn.ModuleDict()
        if self.text_names:
            text_dim = sum(self.encoders[n].out_dim for n in self.text_names)
            for mod in spec.modalities:
                if mod.kind == "image":
                    channels = self.encoders[mod.name].conv_channels
                    film = nn.Linear(text_dim, 2 * channels)
                    nn.init.zeros_(film.weight)
                    nn.init.zeros_(film.bias)
                    self.film[mod.name] = film
        fused_dim = sum(enc.out_dim for enc in self.encoders.values())
        trunk: list[nn.Module] = []
        in_dim = fused_dim
        for h in spec.hidden_sizes:
            trunk += [layer_init(nn.Linear(in_dim, h)), Tanh()]
            in_dim = h
        self.trunk = nn.Sequential(*trunk)
        self.fused_dim = fused_dim
        # Policy head gain 0.01 keeps the initial policy near uniform; value head gain 1.
        self.policy_head = layer_init(nn.Linear(in_dim, spec.action_dim), std=POLICY_HEAD_STD)
        self.value_head = layer_init(nn.Linear(in_dim, 1), std=VALUE_HEAD_STD)
        if spec.action_kind == "continuous":
            # State-independent log std, as in CleanRL's continuous PPO and learner.model.ActorCritic.
            self.actor_logstd = nn.Parameter(torch.zeros(spec.action_dim))

    # ---- inputs

    def _device(self) -> torch.device:
        return self.policy_head.weight.device

    def _input(self, obs: dict, name: str) -> torch.Tensor:
        """The modality's batch on the model's device, in its pipeline dtype (no cast before the copy)."""
        try:
            x = obs[name]
        except KeyError:
            raise KeyError(
                f"observation dict lacks modality {name!r} ({self.modality_kinds[name]}); "
                f"got keys {sorted(obs)}"
            ) from None
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x)
        if tuple(x.shape[1:]) != self.modality_shapes[name]:
            # Shapes are host metadata, so this check costs no device sync.
            raise ValueError(
                f"modality {name!r} ({self.modality_kinds[name]}): expected (B, *{self.modality_shapes[name]}), "
                f"received {tuple(x.shape)}"
            )
        # A no-op when already on the device; otherwise the raw (uint8 for images) batch is
        # what crosses the link, and the float conversion happens in the encoder, on the device.
        return x.to(self._device(), non_blocking=True)

    def encode(self, obs: dict) -> torch.Tensor:
        """Fused features (B, fused_dim): every encoder's output, concatenated in spec order."""
        feats = {name: self.encoders[name](self._input(obs, name)) for name in self.text_names}
        text = torch.cat([feats[n] for n in self.text_names], dim=-1) if self.text_names else None
        for name in self.modality_names:
            if name in feats:
                continue
            encoder, x = self.encoders[name], self._input(obs, name)
            if name in self.film:
                maps = encoder.convs(encoder.to_float(x))
                gamma, beta = self.film[name](text).chunk(2, dim=-1)
                maps = maps * (1 + gamma[:, :, None, None]) + beta[:, :, None, None]
                feats[name] = encoder.head(maps)
            else:
                feats[name] = encoder(x)
        return torch.cat([feats[name] for name in self.modality_names], dim=-1)

    def _trunk(self, obs: dict) -> torch.Tensor:
        return self.trunk(self.encode(obs))

    # ---- ActorCritic interface

    def value(self, obs: dict) -> torch.Tensor:
        return self.value_head(self._trunk(obs)).squeeze(-1)

    @torch.inference_mode()
    def act(self, obs: dict, generator: torch.Generator | None = None):
        """Sample actions. Returns (action, logp, value), all detached, on the model's device."""
        h = self._trunk(obs)
        value = self.value_head(h).squeeze(-1)
        out = self.policy_head(h)
        action, logp = sample_action(self.spec.action_kind, out, getattr(self, "actor_logstd", None), generator)
        return action, logp, value

    def evaluate(self, obs: dict, actions: torch.Tensor):
        """Log-prob and entropy of ``actions`` under the current policy, and V(obs)."""
        h = self._trunk(obs)
        value = self.value_head(h).squeeze(-1)
        out = self.policy_head(h)
        logp, entropy = action_logp_entropy(self.spec.action_kind, out, actions, getattr(self, "actor_logstd", None))
        return logp, entropy, value

    def update_normalizers(self, obs: dict) -> None:
        """Fold a batch's vector statistics into the running buffers of every normalising vector encoder."""
        for name in self.modality_names:
            encoder = self.encoders[name]
            if isinstance(encoder, VectorEncoder) and encoder.normalize:
                encoder.update(self._input(obs, name))


def make_policy(spec) -> nn.Module:
    """The policy for a spec: the multimodal model for Dict observations, CleanRL's MLP pair for Box ones."""
    if isinstance(spec, MultiModalSpec):
        return MultiModalActorCritic(spec)
    from learner.model import ActorCritic

    return ActorCritic(spec)


def spec_from_description(description: dict, hidden_sizes: tuple[int, ...]) -> MultiModalSpec:
    """``actors.envs.describe_modalities`` output (plain data) -> the model's spec."""
    return MultiModalSpec(modalities=tuple(ModalityInput(**m) for m in description["modalities"]),
                          action_kind=description["action_kind"], action_dim=description["action_dim"],
                          hidden_sizes=tuple(hidden_sizes))
