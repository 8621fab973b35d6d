"""Encoders: one per modality kind, each (B, *shape) on the model's device -> (B, out_dim) float features.

Observations arrive with the pipeline's dtype (images ``uint8`` channels-last, text ``int64`` token ids, everything
else ``float32``, or uint8 for a Box env's uint8 vector) and are converted to float only here, on the model's device,
so the host-device link carries the small dtype. No forward reads a value back to the host (no ``.item()``, no
data-dependent Python branching): the learner keeps its one host sync per update.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from learner.spec import ModalityInput

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


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """Orthogonal weights with gain ``std`` and constant bias (PPO detail #2)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


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
    """(B, *shape) float32 or uint8, flattened -> (B, VECTOR_FEATURES), optionally normalised first.

    ``features=0``: no layer of its own, the (normalised) flat vector is the output. State-only models use that:
    their actor and critic MLPs read the state directly (CleanRL's layout).

    The running mean/var are buffers, not parameters: they get no gradient, but they are
    in ``state_dict`` and so travel with the weights. A rollout actor loading policy
    version k therefore normalises with exactly the statistics the learner used for k.
    """

    def __init__(self, mod: ModalityInput, features: int = VECTOR_FEATURES):
        super().__init__()
        dim = int(np.prod(mod.shape))
        # Integer ids (``categories``): each value becomes a one-hot block of its channel's count, on the device
        # (the host sends the ids, not blocks up to 20x larger). A Linear over one-hots is an embedding per
        # (position, id): key and ball are as far apart as key and wall.
        self.categories = mod.categories
        if self.categories is not None:
            channels = mod.shape[-1] if mod.shape else 1
            counts = list(self.categories) * (channels if len(self.categories) == 1 else 1)
            self.register_buffer("id_offsets", torch.tensor(np.cumsum([0] + counts[:-1]), dtype=torch.long),
                                 persistent=False)
            self.channels, self.id_count = channels, sum(counts)
            dim = dim // channels * self.id_count
        self.normalize = bool(mod.normalize) and self.categories is None
        if self.normalize:
            # Same starting point as gymnasium's RunningMeanStd: a tiny pseudo-count at mean 0,
            # var 1, so the first real batch dominates and nothing divides by zero.
            self.register_buffer("running_mean", torch.zeros(dim, dtype=torch.float32))
            self.register_buffer("running_var", torch.ones(dim, dtype=torch.float32))
            self.register_buffer("running_count", torch.tensor(NORM_INITIAL_COUNT, dtype=torch.float32))
        self.mlp = nn.Sequential(layer_init(nn.Linear(dim, features)), nn.ReLU()) if features else nn.Identity()
        self.out_dim = features or dim

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        if self.categories is not None:
            ids = x.reshape(x.shape[0], -1, self.channels).long() + self.id_offsets
            hot = torch.zeros(*ids.shape[:2], self.id_count, device=ids.device, dtype=torch.float32)
            return hot.scatter_(2, ids, 1.0).reshape(x.shape[0], -1)
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
