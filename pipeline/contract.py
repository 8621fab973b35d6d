"""The observation contract: what one observation key (a modality) is, declared once.

Every env's observation is a set of modalities: a Dict env's keys, as ``env.modalities`` describes them, or a Box
env's one array (``actors.envs.box_modality``: ``vector``, or ``image`` for H x W x C uint8).

``ModalitySpec`` is the one description of a modality. Each field carries its type (the annotation), its default,
its documentation and its allowed values (``metadata``, written with ``setting``), and every layer reads that one
declaration:

* the config (``cluster.config``) embeds ``ModalitySpec`` as ``env.modalities.<key>``: its generic loader checks
  the types, ranges and choices from the metadata, ``conflicts`` adds the rules that span fields, and the configuration
  reference's (docs/configuration.md) ``env.modalities.<key>.*`` rows are generated from the same metadata;
* the pipeline (``pipeline.modality``) preprocesses with the spec objects themselves (``specs_from`` turns the
  ``env.modalities`` mapping into named specs, plain dicts included) and does not check them again;
* the model (``learner.spec``, ``learner.encoders``) takes ``KINDS``, ``KIND_DTYPES`` and the settings it reads
  (``MODEL_SETTINGS``) from here.

Adding a setting is one field here plus its use. This module imports only the standard library (no numpy, cv2 or
torch), so the config CLI and the model can import it for nothing.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, fields, replace
from typing import Iterator, Mapping, Optional

#: What an observation key may hold; picks its preprocessing (pipeline.modality) and its encoder (learner.encoders).
KINDS = ("image", "text", "vector", "pointcloud", "audio")
#: When a new value arrives: every step (a fast modality), every `every` episode steps, or once per episode.
RATES = ("step", "every", "reset")
ENCODINGS = ("none", "png", "jpeg")
ON_CORRUPT = ("fail", "drop_episode")

#: dtype of each kind's preprocessed value: what the pipeline's processors produce and the model's encoders read.
#: Images stay uint8 up to the learner device (a quarter of the bytes of float32 on the host-device link).
KIND_DTYPES = {"image": "uint8", "text": "int64", "vector": "float32", "pointcloud": "float32", "audio": "float32"}

#: The spec settings the model reads; they travel to the learners (and into checkpoints) in the model's spec,
#: next to what preprocessing made of the key (shape, dtype, vocabulary size).
MODEL_SETTINGS = ("kind", "scale", "normalize", "categories")


def setting(default, doc: str, *, unit: str = "", min=None, max=None, min_exclusive=False, choices=None,
            auto=False):
    """A documented field. ``auto=True``: the string "auto" is accepted besides the annotated type.

    The metadata convention every config section and ``ModalitySpec`` share; ``cluster.config`` validates it and
    turns it into the configuration reference's table (docs/configuration.md).
    """
    mutable = isinstance(default, (dict, list))
    return field(
        **({"default_factory": lambda: type(default)(default)} if mutable else {"default": default}),
        metadata={"doc": doc, "unit": unit, "min": min, "max": max, "min_exclusive": min_exclusive, "choices": choices,
                  "auto": auto},
    )


@dataclass(frozen=True)
class ModalitySpec:
    """One observation key of a Dict-observation env (``env.modalities.<key>``); see docs/multimodal.md.

    ``name`` is the observation key. It is not a setting (the config files entries under their key, and the loader,
    ``asdict`` and the README see only the fields below): ``ModalitySpec("camera", "image")`` and ``specs_from`` set
    it, an entry of a loaded config has ``""``. Equality and hashing compare the settings.

    Nothing is checked here: the config loader validated every value it built, and a spec written in code is taken
    as written (lists given for ``size`` / ``vocab`` are stored as tuples, so specs hash).
    """

    name: InitVar[str] = ""
    kind: str = setting("vector", "What the key holds; picks its preprocessing and its encoder.", choices=KINDS)
    rate: str = setting("step", "When a new value arrives: step (every env step: a fast modality, on the action's "
                                "critical path), every (every `every` episode steps) or reset (once per episode); "
                                "every and reset are slow modalities.", choices=RATES)
    every: int = setting(1, "Period of a rate: every modality (>= 2 there).", unit="steps", min=1, max=100000)
    budget_ms: float = setting(5.0, "Latency budget; the preprocessing deadline is submit time + budget (the "
                                    "scheduler serves earliest deadline first).", unit="ms", min=0.0,
                               min_exclusive=True)
    max_staleness: Optional[int] = setting(
        None, "Slow modalities: oldest value (t - source step) an observation may use; the rollout waits for the "
              "pending value rather than go past it. null = every - 1 (the value is never older than its period).",
        unit="steps", min=0)
    encoding: str = setting("none", "Images: none (raw HxWxC uint8) or png / jpeg bytes, decoded on the rollout host.",
                            choices=ENCODINGS)
    size: Optional[tuple] = setting(None, "Images: resize to [H, W] (area interpolation); null keeps the size.",
                                    unit="pixels")
    grayscale: bool = setting(False, "Images: one luma channel (0.299 R + 0.587 G + 0.114 B, alpha dropped) before "
                                     "resizing; the model sees [H, W, 1].")
    scale: float = setting(255.0, "Images: the model divides the uint8 values by this on the learner device.",
                           min=0.0, min_exclusive=True)
    max_tokens: int = setting(16, "Text: token ids per observation (padded with 0 / truncated).", min=1, max=4096)
    vocab: Optional[list] = setting(
        None, "Text: the vocabulary (lower-case words); null builds it from the env's mission space (minigrid).")
    num_points: int = setting(64, "Point clouds: points per observation (random subset or repeated points).",
                              min=1, max=1_000_000)
    point_scale: float = setting(1.0, "Point clouds: coordinates are divided by this.", min=0.0, min_exclusive=True)
    center: bool = setting(False, "Point clouds: subtract the centroid first.")
    n_fft: int = setting(64, "Audio: samples per spectrogram frame.", unit="samples", min=2, max=65536)
    hop: int = setting(32, "Audio: samples between frames.", unit="samples", min=1, max=65536)
    normalize: bool = setting(True, "Vectors: running mean/std normalisation in the model (the statistics travel "
                                    "with the policy weights, so actors and learners agree).")
    categories: Optional[tuple] = setting(
        None, "Vectors of integer ids: how many values each id takes, one number per channel of the last axis or one "
              "for all (minigrid's symbolic view: [11, 6, 3], its object, colour and state ids). The model one-hots "
              "them on its device, so an id is a category, not a magnitude (key 5 and ball 6 would otherwise be "
              "nearly the same input); normalize is not applied. null: the values are read as numbers.")
    on_corrupt: str = setting("fail", "Encoded images that do not decode: fail (stop the run with the error) or "
                                      "drop_episode (abandon that env's episode, count it).", choices=ON_CORRUPT)

    def __post_init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)
        for seq in ("size", "vocab", "categories"):
            value = getattr(self, seq)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, seq, tuple(value))

    @classmethod
    def from_dict(cls, name: str, d: Mapping) -> ModalitySpec:
        """A spec from plain data (``Config.to_dict()``'s entries, a table written in code); missing keys default.

        The values are taken as they are: the config loader is where plain data is validated.
        """
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"env.modalities.{name}: unknown key(s) {', '.join(map(str, unknown))}; "
                             f"allowed keys here: {', '.join(f.name for f in fields(cls))}")
        return cls(name, **d)

    def named(self, name: str) -> ModalitySpec:
        """The same settings, filed under ``name``."""
        return replace(self, name=name)

    @property
    def is_fast(self) -> bool:
        """A fast modality changes every step, so its preprocessing sits on the action's critical path."""
        return self.rate == "step"

    def due(self, episode_step: int) -> bool:
        """Whether the env produces a fresh value of this modality at `episode_step` (0 = the reset observation)."""
        if self.rate == "step":
            return True
        if self.rate == "every":
            return episode_step % self.every == 0
        return episode_step == 0

    @property
    def staleness_bound(self) -> int | None:
        """Largest (t - source_step) the aligner accepts for this modality; None means no bound applies.

        A step-rate value is always fresh and a reset-rate value is meant to last the whole episode, so neither has
        a bound. An every-k value is legitimately up to k - 1 steps old between refreshes.
        """
        if self.rate != "every":
            return None
        return self.max_staleness if self.max_staleness is not None else self.every - 1


def conflicts(spec: ModalitySpec) -> Iterator[tuple[str, str]]:
    """(field, message) for each rule that spans fields or values (the metadata holds the per-field ones).

    The config raises the first as ``env.modalities.<key>.<field>: <message>``.
    """
    if spec.rate == "every" and spec.every < 2:
        yield "every", f"{spec.every} with rate: every is a per-step modality; allowed: >= 2 (or rate: step)"
    if spec.rate == "every" and spec.max_staleness is not None and spec.max_staleness < spec.every - 1:
        yield "max_staleness", (f"{spec.max_staleness} is below every - 1 = {spec.every - 1}, the age a value "
                                f"arriving every {spec.every} steps reaches by construction; allowed: >= "
                                f"{spec.every - 1}")
    if spec.size is not None and len(spec.size) != 2:
        yield "size", f"{list(spec.size)!r} is not [height, width]; allowed: two positive integers"
    if spec.categories is not None and spec.kind != "vector":
        yield "categories", (f"{list(spec.categories)!r} with kind {spec.kind}: only vector modalities hold ids; "
                             f"allowed: null, or kind: vector")
    if spec.kind == "audio" and spec.hop > spec.n_fft:
        yield "hop", f"{spec.hop} is larger than n_fft ({spec.n_fft}), which skips samples; allowed: <= {spec.n_fft}"


def category_problem(categories: tuple, kind: str, shape: tuple) -> str | None:
    """Why ``categories`` cannot describe a value of ``shape`` (None: it can): the preprocessing and the model
    both ask, with the shape the env declares."""
    if kind != "vector":
        return f"categories {list(categories)!r} with kind {kind}: only vector modalities hold ids"
    channels = shape[-1] if shape else 1
    if len(categories) not in (1, channels):
        return (f"categories has {len(categories)} entries and the value's last axis (shape {tuple(shape)}) has "
                f"{channels} channels; allowed: one number per channel, or one for all")
    return None


def specs_from(modalities: Mapping[str, ModalitySpec | Mapping]) -> list[ModalitySpec]:
    """``env.modalities`` (key -> spec object, or its plain data) -> one spec per key, named by it.

    The rollout side's one conversion: spec objects (``cfg.env.modalities``) are filed under their key as they are,
    dicts (``cfg.to_dict()``'s, a table written in code) go through ``ModalitySpec.from_dict``.
    """
    specs = []
    for name, value in modalities.items():
        if isinstance(value, ModalitySpec):
            specs.append(value if value.name == name else value.named(name))
        else:
            specs.append(ModalitySpec.from_dict(name, value))
    return specs
