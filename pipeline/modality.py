"""Modalities: what one observation key is, and how its raw value becomes a model input.

An environment with a Dict observation hands the rollout one raw value per key per env step: an encoded camera
frame, a mission string, a joint-state vector, a point cloud, an audio waveform. This module is the single place
that knows how to turn each of those into a fixed-shape numpy array the model can batch:

* ``ModalitySpec`` is the declarative part (what the config file says about one key): its kind, how often it
  produces a new value (``rate``), its latency budget, and the per-kind preprocessing knobs. It is defined, with
  its defaults, ranges and docs, in ``pipeline.contract`` (re-exported here) and validated by the config loader;
  nothing here checks it again.
* ``make_processor(spec, raw_space)`` looks at the env's declared raw space *once* and returns a ``Processor``
  specialised for it, so the per-step path does no dispatching and no re-reading of the space. Anything that
  cannot work (an image kind on a Discrete space, a text kind with no vocabulary) fails here, at start-up, not on
  the first step.
* ``Processor.__call__`` handles one env's raw value; ``Processor.batch`` handles N of them and is vectorised
  where that pays (the audio STFT of all N waveforms is one numpy call; image decoding is inherently per frame).

Every processor validates its input against the declared raw space and raises ``ObservationError`` with a single
line naming the modality, what was expected and what arrived, because a silently broadcast or mis-cast sensor value
is the hardest kind of RL bug to find. Encoded frames that do not decode raise ``CorruptObservation`` (a subclass),
which rollouts can treat per ``spec.on_corrupt`` instead of failing the run.

Processors hold no per-episode state, keep uint8 images as uint8 (the model divides by ``spec.scale`` on the
device, so host-to-device traffic stays 4x smaller) and leave vector normalisation to the model (its running
statistics must travel with the weights). They may be called from several scheduler worker threads at once: the
only mutable state is the text cache (guarded by a lock) and the point-cloud RNG (numpy Generators lock their bit
generator internally).

This module imports nothing from ``actors``, ``learner`` or ``cluster``.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
from collections import OrderedDict

import cv2
import gymnasium
import numpy as np

# ModalitySpec is defined there (and re-exported)
from pipeline.contract import KIND_DTYPES, KINDS, ModalitySpec, category_problem

# Magic bytes at the start of an encoded frame; enough for `contains` without paying for a decode.
_MAGIC = {"png": b"\x89PNG", "jpeg": b"\xff\xd8"}

# Text ids below the vocabulary: 0 pads short missions (the model masks it out), 1 stands for any word the
# vocabulary lacks, so an unseen word still occupies its position instead of silently shifting the rest.
PAD_ID = 0
UNK_ID = 1
_FIRST_WORD_ID = 2

# A token is a run of letters/digits (unicode-aware); punctuation and whitespace only separate tokens.
_TOKEN_RE = re.compile(r"[^\W_]+")

# Enumerating every mission of a MissionSpace is a product over its placeholder lists; beyond this many
# combinations it would stall start-up, and the user is better off declaring the vocabulary.
_MAX_MISSIONS = 200_000


class ObservationError(ValueError):
    """One line naming the modality, the expected and the received shape/dtype (or type)."""


class CorruptObservation(ObservationError):
    """An encoded input that does not decode (bad PNG/JPEG bytes); rollouts apply spec.on_corrupt."""


# --------------------------------------------------------------------------------------------------------------
# Error messages


def _describe(value) -> str:
    """What arrived, in the words of the error message: dtype and shape for arrays, the type name otherwise."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    if isinstance(value, np.generic):
        return f"{value.dtype} scalar"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{type(value).__name__} of {value.nbytes if isinstance(value, memoryview) else len(value)} bytes"
    return type(value).__name__


def _mismatch(spec: ModalitySpec, expected: str, received: str, cls=ObservationError) -> ObservationError:
    return cls(f"observation {spec.name!r} ({spec.kind}): expected {expected}, received {received}")


def _setup_error(spec: ModalitySpec, message: str) -> ObservationError:
    return ObservationError(f"observation {spec.name!r} ({spec.kind}): {message}")


def _is_numeric(dtype: np.dtype) -> bool:
    return dtype.kind in "biuf"


# --------------------------------------------------------------------------------------------------------------
# Encoded image space


class EncodedImage(gymnasium.spaces.Space):
    """Observation space of an encoded camera frame: bytes (or a 1-D uint8 array) holding a PNG/JPEG image that
    decodes to `shape` (H, W, C) uint8. `contains` checks type and magic bytes only (decoding is the pipeline's job).
    """

    def __init__(self, shape: tuple[int, int, int], encoding: str = "png", seed=None):
        shape = tuple(int(d) for d in shape)
        if len(shape) != 3 or min(shape) < 1 or shape[2] not in (1, 3, 4):
            raise ValueError(f"EncodedImage shape must be (H, W, C) with C in 1, 3, 4; got {shape}")
        if encoding not in _MAGIC:
            raise ValueError(f"EncodedImage encoding must be one of {', '.join(_MAGIC)}; got {encoding!r}")
        if encoding == "jpeg" and shape[2] == 4:
            raise ValueError("EncodedImage: JPEG has no alpha channel; use png for 4-channel frames")
        # The decoded shape is kept on its own attribute rather than Space.shape: gymnasium treats Space.shape as
        # the shape of a sample, and a sample here is a variable-length byte string.
        self.image_shape = shape
        self.encoding = encoding
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def sample(self, mask=None, probability=None) -> bytes:
        """A frame of uniformly random pixels, encoded (useful for env checkers and smoke tests)."""
        pixels = self.np_random.integers(0, 256, size=self.image_shape, dtype=np.uint8)
        ok, buf = cv2.imencode(".png" if self.encoding == "png" else ".jpg", _to_cv2_order(pixels))
        if not ok:  # pragma: no cover - cv2 only fails here for unsupported channel counts, excluded above
            raise RuntimeError(f"cv2 could not encode a {self.image_shape} frame as {self.encoding}")
        return buf.tobytes()

    def contains(self, x) -> bool:
        if isinstance(x, np.ndarray):
            if x.dtype != np.uint8 or x.ndim != 1:
                return False
            head = x[:4].tobytes()
        elif isinstance(x, (bytes, bytearray, memoryview)):
            head = bytes(x[:4])
        else:
            return False
        return head.startswith(_MAGIC[self.encoding])

    def __repr__(self) -> str:
        return f"EncodedImage({self.image_shape}, {self.encoding!r})"

    def __eq__(self, other) -> bool:
        return (isinstance(other, EncodedImage) and other.image_shape == self.image_shape
                and other.encoding == self.encoding)

    def __hash__(self) -> int:
        return hash((EncodedImage, self.image_shape, self.encoding))


def _to_cv2_order(rgb: np.ndarray) -> np.ndarray:
    """RGB(A) -> BGR(A): cv2 encodes and decodes colour frames in BGR order."""
    if rgb.shape[2] == 3:
        return cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)
    if rgb.shape[2] == 4:
        return cv2.cvtColor(rgb, cv2.COLOR_RGBA2BGRA)
    return rgb


# --------------------------------------------------------------------------------------------------------------
# Processors


class Processor:
    """Turns one modality's raw values into fixed-shape arrays; built by make_processor for one raw space.

    Attributes every processor has: `spec`, `raw_space`, `out_shape` (one env's value), `out_dtype`, and
    `vocab_size` (text: ids lie in [0, vocab_size); 0 for other kinds) so the model can be sized from processors.
    """

    spec: ModalitySpec
    raw_space: gymnasium.spaces.Space
    out_shape: tuple[int, ...]
    out_dtype: np.dtype
    vocab_size: int = 0

    def __call__(self, raw) -> np.ndarray:
        raise NotImplementedError

    def batch(self, raws: list) -> np.ndarray:
        """N raw values -> (N, *out_shape). Default: one __call__ each, written into one preallocated array."""
        out = np.empty((len(raws), *self.out_shape), dtype=self.out_dtype)
        for i, raw in enumerate(raws):
            out[i] = self(raw)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.name!r}, out={self.out_shape} {np.dtype(self.out_dtype)})"


class ImageProcessor(Processor):
    """uint8 (H, W, C) frames, from raw arrays or decoded from PNG/JPEG bytes, optionally resized (INTER_AREA)."""

    out_dtype = np.dtype(KIND_DTYPES["image"])

    def __init__(self, spec: ModalitySpec, raw_space: gymnasium.spaces.Space):
        self.spec, self.raw_space = spec, raw_space
        if isinstance(raw_space, EncodedImage):
            if spec.encoding == "none":
                raise _setup_error(spec, f"the env sends {raw_space} but the modality declares encoding: none; "
                                         f"declare `encoding: {raw_space.encoding}` in env.modalities.{spec.name}")
            # png vs jpeg is not enforced: cv2 recognises the format from the bytes themselves.
            self.encoded = True
            self.in_shape = raw_space.image_shape
        elif isinstance(raw_space, gymnasium.spaces.Box):
            if spec.encoding != "none":
                raise _setup_error(spec, f"encoding {spec.encoding!r} needs an EncodedImage raw space, "
                                         f"the env declares {raw_space}")
            # Other integer Boxes within 0..255 (a board game's int8 planes, an occupancy grid) are cast to uint8.
            fits = raw_space.dtype == np.uint8 or (np.issubdtype(raw_space.dtype, np.integer)
                                                   and np.all(raw_space.low >= 0) and np.all(raw_space.high <= 255))
            if not fits or len(raw_space.shape) not in (2, 3):
                raise _setup_error(spec, f"needs a uint8 Box (or integers within 0..255) of shape (H, W, C) or "
                                         f"(H, W), the env declares {raw_space}")
            self.encoded = False
            self.raw_shape = raw_space.shape
            # A 2-D Box is a grayscale frame; it gets a channel axis so every image reaches the model as HWC.
            self.in_shape = raw_space.shape if len(raw_space.shape) == 3 else (*raw_space.shape, 1)
        else:
            raise _setup_error(spec, f"needs a uint8 Box (H, W, C) or an EncodedImage raw space, "
                                     f"the env declares {raw_space}")
        height, width, channels = self.in_shape
        self.target_hw = tuple(spec.size) if spec.size is not None else (height, width)
        self.resize = self.target_hw != (height, width)
        self.out_shape = (*self.target_hw, 1 if spec.grayscale else channels)
        self.gray_code = {3: cv2.COLOR_RGB2GRAY, 4: cv2.COLOR_RGBA2GRAY}.get(channels) if spec.grayscale else None
        # IMREAD_COLOR/GRAYSCALE force 8-bit output with the declared channel count; 4 channels need UNCHANGED
        # (COLOR drops alpha), after which the shape/dtype check catches a frame without alpha or with 16 bits.
        self.imread_flag = {1: cv2.IMREAD_GRAYSCALE, 3: cv2.IMREAD_COLOR, 4: cv2.IMREAD_UNCHANGED}.get(channels)
        if self.encoded and self.imread_flag is None:
            raise _setup_error(spec, f"encoded images have 1, 3 or 4 channels, the env declares {self.in_shape}")

    def __call__(self, raw) -> np.ndarray:
        image = self._decode(raw) if self.encoded else self._check_array(raw)
        if self.gray_code is not None:  # before resizing, which then interpolates one channel, not 3 or 4
            image = cv2.cvtColor(image, self.gray_code)[:, :, None]
        if self.resize:
            # cv2.resize takes (width, height) and drops a singleton channel axis, which is put back.
            image = cv2.resize(image, (self.target_hw[1], self.target_hw[0]), interpolation=cv2.INTER_AREA)
            image = image.reshape(self.out_shape)
        return image

    def _check_array(self, raw) -> np.ndarray:
        dtype = self.raw_space.dtype
        if not isinstance(raw, np.ndarray) or raw.dtype != dtype or raw.shape != self.raw_shape:
            raise _mismatch(self.spec, f"{dtype} array of shape {self.raw_shape}", _describe(raw))
        return (raw if dtype == np.uint8 else raw.astype(np.uint8)).reshape(self.in_shape)

    def _decode(self, raw) -> np.ndarray:
        if isinstance(raw, np.ndarray):
            if raw.dtype != np.uint8 or raw.ndim != 1:
                raise _mismatch(self.spec, "encoded image bytes (bytes, bytearray, memoryview or 1-D uint8 array)",
                                _describe(raw))
            buf = raw
        elif isinstance(raw, (bytes, bytearray, memoryview)):
            buf = np.frombuffer(raw, np.uint8)  # zero-copy view
        else:
            raise _mismatch(self.spec, "encoded image bytes (bytes, bytearray, memoryview or 1-D uint8 array)",
                            _describe(raw))
        # imdecode returns None for bytes it cannot parse, but asserts (cv2.error) on an empty buffer.
        image = None
        if buf.size:
            try:
                image = cv2.imdecode(buf, self.imread_flag)
            except cv2.error:
                image = None
        if image is None:
            raise _mismatch(self.spec, f"{self.spec.encoding} bytes that decode to shape {self.in_shape}",
                            f"{buf.size} bytes that do not decode", cls=CorruptObservation)
        if image.ndim == 2:
            image = image[:, :, None]
        if image.shape != self.in_shape or image.dtype != np.uint8:
            raise _mismatch(self.spec, f"an encoded uint8 image of shape {self.in_shape}",
                            f"one that decodes to {image.dtype} of shape {image.shape}")
        if image.shape[2] == 3:
            image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
        elif image.shape[2] == 4:
            image = cv2.cvtColor(image, cv2.COLOR_BGRA2RGBA)
        return image


class TextProcessor(Processor):
    """A string -> int64 (max_tokens,) word ids: 0 pads, 1 is an unknown word, vocabulary words from 2."""

    out_dtype = np.dtype(KIND_DTYPES["text"])
    cache_size = 4096

    def __init__(self, spec: ModalitySpec, raw_space: gymnasium.spaces.Space, vocab: list[str]):
        self.spec, self.raw_space = spec, raw_space
        self.vocab = sorted({word.lower() for word in vocab})
        self.word_ids = {word: i + _FIRST_WORD_ID for i, word in enumerate(self.vocab)}
        self.vocab_size = _FIRST_WORD_ID + len(self.vocab)
        self.out_shape = (spec.max_tokens,)
        self._init_cache()

    def _init_cache(self) -> None:
        # Missions repeat across steps and envs (a MiniGrid mission is fixed for a whole episode), so ids are
        # cached per distinct string. LRU-bounded so procedurally generated text cannot grow it without limit;
        # the lock makes the get/move/evict sequence safe across scheduler worker threads.
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        # Locks do not pickle; the cache is cheap to rebuild.
        state = self.__dict__.copy()
        del state["_cache"], state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_cache()

    def tokenize(self, text: str) -> list[str]:
        return _TOKEN_RE.findall(text.lower())

    def _ids(self, raw) -> np.ndarray:
        """Cached ids of `raw`; callers must not modify the returned array."""
        if not isinstance(raw, str):
            raise _mismatch(self.spec, "str", _describe(raw))
        with self._lock:
            ids = self._cache.get(raw)
            if ids is not None:
                self._cache.move_to_end(raw)
                return ids
        ids = np.zeros(self.out_shape, dtype=np.int64)  # PAD_ID == 0 fills the tail
        words = self.tokenize(raw)[: self.spec.max_tokens]
        ids[: len(words)] = [self.word_ids.get(word, UNK_ID) for word in words]
        ids.flags.writeable = False  # shared through the cache: a consumer writing into it would poison it
        with self._lock:
            self._cache[raw] = ids
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return ids

    def __call__(self, raw) -> np.ndarray:
        return self._ids(raw).copy()

    def batch(self, raws: list) -> np.ndarray:
        out = np.empty((len(raws), *self.out_shape), dtype=self.out_dtype)
        for i, raw in enumerate(raws):
            out[i] = self._ids(raw)  # copies into the batch; no intermediate per-item copy
        return out


class BoxVectorProcessor(Processor):
    """A numeric Box value -> float32 of the Box's shape (normalisation happens in the model)."""

    out_dtype = np.dtype(KIND_DTYPES["vector"])

    def __init__(self, spec: ModalitySpec, raw_space: gymnasium.spaces.Box):
        self.spec, self.raw_space = spec, raw_space
        self.out_shape = tuple(raw_space.shape)
        self.limits = None  # with categories: the id count of each last-axis channel, broadcast over the value
        if spec.categories is not None:
            problem = category_problem(spec.categories, spec.kind, self.out_shape)
            if problem:
                raise _setup_error(spec, f"{problem} (env.modalities.{spec.name}.categories)")
            self.limits = np.asarray(spec.categories, dtype=np.float32)

    def _check(self, raw) -> np.ndarray:
        # np.asarray is free for arrays and lets plain lists/floats through (envs do return those), but the shape
        # must match exactly: a (1, 4) or (4, 1) value would otherwise broadcast silently into the batch.
        if isinstance(raw, np.ndarray):
            value = raw
        else:
            try:
                value = np.asarray(raw)
            except ValueError:  # ragged nested lists
                value = None
        if value is None or value.shape != self.out_shape or not _is_numeric(value.dtype):
            if value is None or not _is_numeric(value.dtype) or isinstance(raw, np.ndarray):
                received = _describe(raw)  # names the dtype for arrays, the type for anything else
            else:
                received = f"{_describe(raw)} of shape {value.shape}"  # a list or number: its shape is the news
            raise _mismatch(self.spec, f"numeric array of shape {self.out_shape}", received)
        return value

    def __call__(self, raw) -> np.ndarray:
        return self._check_ids(self._check(raw).astype(np.float32))

    def batch(self, raws: list) -> np.ndarray:
        out = np.empty((len(raws), *self.out_shape), dtype=self.out_dtype)
        for i, raw in enumerate(raws):
            out[i] = self._check(raw)  # the cast happens in the assignment, once
        return self._check_ids(out)

    def _check_ids(self, values: np.ndarray) -> np.ndarray:
        """With ``categories``: every value is a whole id below its channel's count (the model one-hots them on
        the device, where an id out of range would be a device-side assert, not a message). One vectorised pass."""
        if self.limits is None:
            return values
        bad = (values < 0) | (values >= self.limits) | (values != np.floor(values))
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise _mismatch(self.spec, f"integer ids in [0, {list(self.spec.categories)}) per channel (categories)",
                            f"{values[index]!r} at index {list(index)}")
        return values


class DiscreteVectorProcessor(Processor):
    """A Discrete(n) value -> float32 one-hot (n,)."""

    out_dtype = np.dtype(KIND_DTYPES["vector"])

    def __init__(self, spec: ModalitySpec, raw_space: gymnasium.spaces.Discrete):
        self.spec, self.raw_space = spec, raw_space
        self.n, self.start = int(raw_space.n), int(raw_space.start)
        self.out_shape = (self.n,)
        self._eye = np.eye(self.n, dtype=np.float32)

    def _index(self, raw) -> int:
        # bool is an int subclass but not a category; a 0-d integer array is what vector envs often hand back.
        if isinstance(raw, (int, np.integer)) and not isinstance(raw, (bool, np.bool_)):
            value = int(raw)
        elif isinstance(raw, np.ndarray) and raw.shape == () and raw.dtype.kind in "iu":
            value = int(raw)
        else:
            raise _mismatch(self.spec, f"int in [{self.start}, {self.start + self.n})", _describe(raw))
        if not self.start <= value < self.start + self.n:
            raise _mismatch(self.spec, f"int in [{self.start}, {self.start + self.n})", f"int {value}")
        return value - self.start

    def __call__(self, raw) -> np.ndarray:
        return self._eye[self._index(raw)].copy()

    def batch(self, raws: list) -> np.ndarray:
        # One fancy-index gather of the identity rows instead of N small copies.
        return self._eye[np.fromiter((self._index(raw) for raw in raws), dtype=np.intp, count=len(raws))]


class PointCloudProcessor(Processor):
    """A float (m, 3) cloud with any m -> float32 (num_points, 3): optionally centred, scaled, then resampled."""

    out_dtype = np.dtype(KIND_DTYPES["pointcloud"])

    def __init__(self, spec: ModalitySpec, raw_space: gymnasium.spaces.Box, seed: int):
        self.spec, self.raw_space = spec, raw_space
        self.out_shape = (spec.num_points, 3)
        # Seeded so that a run's subsampling is reproducible; one generator per processor (i.e. per actor).
        self.rng = np.random.default_rng(seed)

    def __call__(self, raw) -> np.ndarray:
        cloud = raw if isinstance(raw, np.ndarray) else np.asarray(raw)
        if cloud.ndim != 2 or cloud.shape[1] != 3 or not _is_numeric(cloud.dtype) or cloud.dtype.kind == "b":
            raise _mismatch(self.spec, "finite numeric array of shape (m, 3)", _describe(cloud))
        count = cloud.shape[0]
        n = self.spec.num_points
        if count == 0:
            return np.zeros(self.out_shape, dtype=np.float32)
        if not np.isfinite(cloud).all():
            bad = int(cloud.size - np.count_nonzero(np.isfinite(cloud)))
            raise _mismatch(self.spec, "finite numeric array of shape (m, 3)",
                            f"{_describe(cloud)} with {bad} non-finite values")
        # The centroid comes from all m points, so it does not depend on which points the subsample drew.
        centroid = cloud.mean(axis=0, dtype=np.float64) if self.spec.center else None
        if count > n:
            picked = cloud[self.rng.choice(count, size=n, replace=False)]
        elif count < n:
            # Repeat points cyclically rather than pad with zeros: a max-pooled encoder is invariant to duplicates,
            # while zero rows would inject fake points at the origin.
            picked = cloud[np.arange(n) % count]
        else:
            picked = cloud
        # Centre/scale only the n kept points (cheaper than transforming all m first, same result).
        out = picked.astype(np.float32)  # always a fresh array, so the in-place ops below never touch `raw`
        if centroid is not None:
            out -= centroid.astype(np.float32)
        if self.spec.point_scale != 1.0:
            out /= np.float32(self.spec.point_scale)
        return out


class AudioProcessor(Processor):
    """A waveform (S,) -> log(1 + |rfft(hann * frame)|) over frames of n_fft every hop samples, float32."""

    out_dtype = np.dtype(KIND_DTYPES["audio"])

    def __init__(self, spec: ModalitySpec, raw_space: gymnasium.spaces.Box):
        self.spec, self.raw_space = spec, raw_space
        self.num_samples = int(raw_space.shape[0])
        n_fft, hop = spec.n_fft, spec.hop
        self.frames = 1 + (self.num_samples - n_fft) // hop
        self.out_shape = (self.frames, n_fft // 2 + 1)
        # Periodic Hann (the STFT convention, as in torch.hann_window): overlapping windows at hop = n_fft / 2
        # sum to a constant. Computed once; it is the same for every frame of every step.
        self.window = (0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n_fft) / n_fft)).astype(np.float32)

    def _check(self, raw) -> np.ndarray:
        if not isinstance(raw, np.ndarray) or raw.shape != (self.num_samples,) or raw.dtype.kind not in "iuf":
            raise _mismatch(self.spec, f"numeric array of shape ({self.num_samples},)", _describe(raw))
        return raw

    def _spectrogram(self, waves: np.ndarray) -> np.ndarray:
        """(N, S) float32 -> (N, frames, n_fft // 2 + 1) float32, all N in one set of numpy calls."""
        # sliding_window_view is a zero-copy strided view (N, S - n_fft + 1, n_fft); taking every hop-th window
        # leaves exactly 1 + (S - n_fft) // hop frames. The window multiply makes the one real copy.
        frames = np.lib.stride_tricks.sliding_window_view(waves, self.spec.n_fft, axis=-1)[:, :: self.spec.hop]
        spectrum = np.fft.rfft(frames * self.window, axis=-1)
        return np.log1p(np.abs(spectrum)).astype(np.float32, copy=False)

    def __call__(self, raw) -> np.ndarray:
        wave = self._check(raw).astype(np.float32, copy=False)
        return self._spectrogram(wave[None])[0]

    def batch(self, raws: list) -> np.ndarray:
        waves = np.empty((len(raws), self.num_samples), dtype=np.float32)
        for i, raw in enumerate(raws):
            waves[i] = self._check(raw)
        return self._spectrogram(waves)


def _is_string_space(space) -> bool:
    # gymnasium's Text and minigrid's MissionSpace both declare dtype str (numpy '<U0').
    return isinstance(space, gymnasium.spaces.Text) or (
        getattr(space, "dtype", None) is not None and np.dtype(space.dtype).kind == "U"
    )


def make_processor(spec: ModalitySpec, raw_space: gymnasium.spaces.Space, seed: int = 0) -> Processor:
    """The Processor for `spec` reading values of `raw_space`; ObservationError if the two cannot work together."""
    if spec.kind == "image":
        return ImageProcessor(spec, raw_space)
    if spec.kind == "text":
        if not _is_string_space(raw_space):
            raise _setup_error(spec, f"needs a string-valued raw space (Text or MissionSpace), "
                                     f"the env declares {raw_space}")
        if spec.vocab is not None:
            vocab = list(spec.vocab)
        else:
            try:
                vocab = build_vocab(raw_space)
            except ObservationError as exc:
                raise _setup_error(spec, f"{exc}; declare `vocab` in env.modalities.{spec.name}") from None
        return TextProcessor(spec, raw_space, vocab)
    if spec.kind == "vector":
        if isinstance(raw_space, gymnasium.spaces.Discrete):
            if spec.categories is not None:
                raise _setup_error(spec, f"categories {list(spec.categories)!r} on a Discrete key, which is one-hot "
                                         f"already; allowed: null (env.modalities.{spec.name}.categories)")
            return DiscreteVectorProcessor(spec, raw_space)
        if isinstance(raw_space, gymnasium.spaces.Box):
            return BoxVectorProcessor(spec, raw_space)
        raise _setup_error(spec, f"needs a Box or Discrete raw space, the env declares {raw_space}")
    if spec.kind == "pointcloud":
        if not (isinstance(raw_space, gymnasium.spaces.Box) and len(raw_space.shape) == 2
                and raw_space.shape[1] == 3):
            raise _setup_error(spec, f"needs a Box of shape (M, 3), the env declares {raw_space}")
        return PointCloudProcessor(spec, raw_space, seed)
    if spec.kind != "audio":
        raise _setup_error(spec, f"kind {spec.kind!r} is not one of {', '.join(KINDS)}")
    if not (isinstance(raw_space, gymnasium.spaces.Box) and len(raw_space.shape) == 1):
        raise _setup_error(spec, f"needs a Box of shape (S,), the env declares {raw_space}")
    if raw_space.shape[0] < spec.n_fft:
        raise _setup_error(spec, f"waveforms of {raw_space.shape[0]} samples are shorter than n_fft={spec.n_fft}; "
                                 f"lower `n_fft` in env.modalities.{spec.name}")
    return AudioProcessor(spec, raw_space)


# --------------------------------------------------------------------------------------------------------------
# Vocabulary


def build_vocab(space) -> list[str]:
    """Every word any mission of a minigrid MissionSpace can contain, sorted and lower case.

    Duck-typed on `.mission_func` and `.ordered_placeholders` (so minigrid is not a dependency of this module):
    every combination of placeholders is rendered through the env's own mission function and tokenised exactly as
    the TextProcessor tokenises, so no mission the env can produce has an unknown word. Any other space raises
    ObservationError: its vocabulary has to be declared.
    """
    mission_func = getattr(space, "mission_func", None)
    if mission_func is None or not hasattr(space, "ordered_placeholders"):
        raise ObservationError(f"cannot build a vocabulary from {space!r} (only a minigrid MissionSpace can be "
                               f"enumerated)")
    placeholders = space.ordered_placeholders
    if placeholders is None:
        missions = [mission_func()]
    else:
        combinations = math.prod(len(options) for options in placeholders)
        if combinations > _MAX_MISSIONS:
            raise ObservationError(f"cannot build a vocabulary from {space!r}: {combinations} missions to "
                                   f"enumerate (limit {_MAX_MISSIONS})")
        missions = (mission_func(*combo) for combo in itertools.product(*placeholders))
    words: set[str] = set()
    for mission in missions:
        words.update(_TOKEN_RE.findall(str(mission).lower()))
    return sorted(words)
