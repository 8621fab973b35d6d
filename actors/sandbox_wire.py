"""What crosses from a sandboxed env child to its parent (``actors.sandbox``), and nothing else: no pickle, no
marshal, no eval of anything the child can steer.

The child runs code nobody has read, so every byte it sends is an attacker's. Three things cross, each read
into a fixed shape and checked before the parent uses it:

* **frames** on the control socket: a fixed header (``FRAME``: status, errno, payload length) and a payload of at
  most the reader's limit, read whole against one deadline (half a frame then silence, or a byte a second, is a
  missed deadline, not a hang). A step's reply is a header alone; an error's payload is its text (at most
  ``TEXT_LIMIT`` bytes, shown with control characters removed); the ``ready`` payload is the spaces as JSON;
* **spaces** as JSON (``space_to_wire`` in the child, ``space_from_wire`` in the parent): Box, Discrete,
  MultiDiscrete, MultiBinary, Text, this project's EncodedImage (PNG or JPEG bytes), and Dict and Tuple of those,
  each field checked (dtype from ``DTYPES``, shape
  sizes, bounds), rebuilt by the parent from plain numbers; ``SPACES_LIMIT`` bytes at most;
* **observations, rewards and flags** in a shared memory block the *parent* makes, sizes from the checked space
  and seals against shrinking (``Layout``): a child cannot change what the parent maps, make it read past the
  end, or hand it anything but numbers of the declared dtype and shape. The parent copies each field out before
  it checks it (a Discrete in range, a Text that decodes and fits its space, a finite reward, flags 0 or 1).

``info`` does not cross: the rollouts read no key of it (``VectorEnv.step`` returns none), so none is carried.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import socket
import struct
import time
from typing import Any

import numpy as np

#: One frame's header: status (``OK`` / ``ERROR`` / ``READY``), the number of the command it answers (0 before
#: the first), errno (-1: none), payload length. The number makes a reply sent early, twice or for another command
#: a breach rather than the answer to the next one.
FRAME = struct.Struct("<BIiI")
OK, ERROR, READY = 0, 1, 2
#: An error's text: a line for the run's ``last_rollout_fault``, not a place to move data.
TEXT_LIMIT = 1024
#: The spaces' JSON: room for a Box's per-element bounds on a large image (84 x 84 x 4 floats as text is ~0.5 MB).
SPACES_LIMIT = 4 * 2**20
#: One observation's bytes: a 4K RGB frame is 25 MB; a space past this makes the parent map more than a rollout
#: actor should give one env, whatever the env's own memory limit.
OBS_LIMIT = 64 * 2**20
#: Dims and parts of a space, so that checking one takes bounded work.
MAX_DIMS, MAX_PARTS = 8, 256
#: dtypes an array may have: plain numbers only (an ``object`` dtype would hold references, not values).
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64")
#: One Text character as UTF-8: at most four bytes.
_UTF8_MAX = 4


class ProtocolBreach(Exception):
    """What the child sent is not what the protocol allows: the child is failed like any other breach."""


# --------------------------------------------------------------------------- frames


def send_frame(sock: socket.socket, status: int, payload: bytes = b"", err: int | None = None, seq: int = 0) -> None:
    sock.sendall(FRAME.pack(status, seq, -1 if err is None else int(err), len(payload)) + payload)


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes | None:
    """``n`` bytes before ``deadline``, or None (the deadline passed, or the other side closed)."""
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except (socket.timeout, BlockingIOError, InterruptedError):
            continue
        except OSError:
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, deadline: float, limit: int, seq: int = 0) -> tuple[int, int, bytes] | None:
    """(status, errno, payload) of the frame answering command ``seq``, read whole before ``deadline``; None when
    it did not come (a death or a missed deadline: the caller tells which). ProtocolBreach for a header the
    protocol does not allow."""
    header = _recv_exactly(sock, FRAME.size, deadline)
    if header is None:
        return None
    status, answers, err, length = FRAME.unpack(header)
    if status not in (OK, ERROR, READY):
        raise ProtocolBreach(f"a frame of unknown status {status}")
    if not 0 <= length <= limit:
        raise ProtocolBreach(f"a frame of {length} bytes (allowed: at most {limit})")
    if answers != seq:
        raise ProtocolBreach(f"a reply to command {answers} where one to command {seq} was due")
    payload = _recv_exactly(sock, length, deadline) if length else b""
    if payload is None:
        return None
    return status, err, payload


def error_text(payload: bytes) -> str:
    """An error's payload as one printable line."""
    text = payload.decode("utf-8", errors="replace")
    return "".join(c if c.isprintable() else " " for c in text)[:TEXT_LIMIT]


# --------------------------------------------------------------------------- spaces


def space_to_wire(space) -> dict:
    """The child's side: a gymnasium space as plain data (raises for a space the wire does not carry)."""
    import gymnasium as gym

    if isinstance(space, gym.spaces.Box):
        def bound(a):
            a = np.asarray(a, dtype=np.float64)
            return float(a.flat[0]) if a.size and (a == a.flat[0]).all() else a.tolist()
        return {"kind": "Box", "shape": list(space.shape), "dtype": str(space.dtype),
                "low": bound(space.low), "high": bound(space.high)}
    if isinstance(space, gym.spaces.Discrete):
        return {"kind": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, gym.spaces.MultiDiscrete):
        return {"kind": "MultiDiscrete", "nvec": np.asarray(space.nvec).tolist(), "dtype": str(space.dtype)}
    if isinstance(space, gym.spaces.MultiBinary):
        return {"kind": "MultiBinary", "n": np.atleast_1d(space.n).tolist()}
    if _is_encoded_image(space):
        return {"kind": "EncodedImage", "shape": list(space.image_shape), "encoding": str(space.encoding)}
    if isinstance(space, gym.spaces.Text):
        return {"kind": "Text", "min_length": int(space.min_length), "max_length": int(space.max_length),
                "charset": "".join(sorted(space.character_set))}
    if isinstance(space, gym.spaces.Dict):
        return {"kind": "Dict", "spaces": [[str(k), space_to_wire(s)] for k, s in space.spaces.items()]}
    if isinstance(space, gym.spaces.Tuple):
        return {"kind": "Tuple", "spaces": [space_to_wire(s) for s in space.spaces]}
    raise TypeError(f"a {type(space).__name__} space does not cross the sandbox; allowed: Box, Discrete, "
                    f"MultiDiscrete, MultiBinary, Text, and Dict or Tuple of those")


def spaces_to_wire(observation_space, action_space) -> bytes:
    return json.dumps({"observation": space_to_wire(observation_space),
                       "action": space_to_wire(action_space)}).encode()


def _int(value, what: str, low: int = 0, high: int = 2**62) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ProtocolBreach(f"{what}: {value!r:.60} is not an integer in [{low}, {high}]")
    return value


def _shape(value, what: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) > MAX_DIMS:
        raise ProtocolBreach(f"{what}: a shape of at most {MAX_DIMS} dims, not {value!r:.60}")
    return tuple(_int(d, what, 0) for d in value)


def _bound(value, shape, dtype: str, what: str) -> np.ndarray:
    """A Box bound in the Box's own dtype (a float64 bound on a float32 Box would be cast, with a warning)."""
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise ProtocolBreach(f"{what}: bounds that are not numbers") from None
    if array.ndim == 0:
        array = np.full(shape, float(array))
    if array.shape != shape:
        raise ProtocolBreach(f"{what}: bounds of shape {array.shape}, not {shape}")
    kind = np.dtype(dtype).kind
    if kind != "f":
        if not np.isfinite(array).all():
            raise ProtocolBreach(f"{what}: {dtype} bounds that are not finite")
        if kind in "iu":
            array = np.clip(array, np.iinfo(dtype).min, np.iinfo(dtype).max)
    return array.astype(dtype)


def space_from_wire(data: Any, where: str = "space", depth: int = 0):
    """The parent's side: plain data from the child -> a gymnasium space, every field checked; ProtocolBreach for
    anything else."""
    import gymnasium as gym

    if depth > 4 or type(data) is not dict:
        raise ProtocolBreach(f"{where}: not a space description")
    kind = data.get("kind")
    try:
        if kind == "Box":
            dtype = data.get("dtype")
            if dtype not in DTYPES:
                raise ProtocolBreach(f"{where}: dtype {dtype!r:.40}; allowed: {', '.join(DTYPES)}")
            shape = _shape(data.get("shape"), where)
            if math.prod(shape) * np.dtype(dtype).itemsize > OBS_LIMIT:
                raise ProtocolBreach(f"{where}: {shape} {dtype} is over {OBS_LIMIT // 2**20} MiB")
            low, high = (_bound(data.get(b), shape, dtype, where) for b in ("low", "high"))
            return gym.spaces.Box(low, high, shape, np.dtype(dtype))
        if kind == "Discrete":
            return gym.spaces.Discrete(_int(data.get("n"), where, 1), start=_int(data.get("start"), where, -2**62))
        if kind == "MultiDiscrete":
            dtype = data.get("dtype")
            if dtype not in DTYPES:
                raise ProtocolBreach(f"{where}: dtype {dtype!r:.40}")
            nvec = data.get("nvec")
            flat = np.asarray(nvec, dtype=np.int64) if type(nvec) is list else None
            if flat is None or flat.size > 2**16 or (flat < 1).any():
                raise ProtocolBreach(f"{where}: nvec is not a list of counts")
            return gym.spaces.MultiDiscrete(flat, dtype=np.dtype(dtype))
        if kind == "MultiBinary":
            n = [_int(d, where, 1, 2**16) for d in data.get("n") or [None]]
            return gym.spaces.MultiBinary(n if len(n) > 1 else n[0])
        if kind == "Text":
            charset = data.get("charset")
            if type(charset) is not str or not 0 < len(charset) <= 4096:
                raise ProtocolBreach(f"{where}: a Text charset of 1 to 4096 characters")
            high = _int(data.get("max_length"), where, 1, 2**16)
            return gym.spaces.Text(max_length=high, min_length=_int(data.get("min_length"), where, 0, high),
                                   charset=charset)
        if kind == "EncodedImage":
            shape = _shape(data.get("shape"), where)
            if len(shape) != 3 or _encoded_bytes(shape) > OBS_LIMIT:
                raise ProtocolBreach(f"{where}: an EncodedImage of (H, W, C) under {OBS_LIMIT // 2**20} MiB")
            from pipeline.modality import EncodedImage  # this project's space for PNG/JPEG frames (cv2 loads)

            return EncodedImage(shape, str(data.get("encoding")))
        if kind in ("Dict", "Tuple"):
            parts = data.get("spaces")
            if type(parts) is not list or not 0 < len(parts) <= MAX_PARTS:
                raise ProtocolBreach(f"{where}: {kind} of 1 to {MAX_PARTS} parts")
            if kind == "Tuple":
                return gym.spaces.Tuple([space_from_wire(p, f"{where}[{i}]", depth + 1) for i, p in enumerate(parts)])
            spaces = {}
            for part in parts:
                if type(part) is not list or len(part) != 2 or type(part[0]) is not str or len(part[0]) > 64:
                    raise ProtocolBreach(f"{where}: a Dict part is [name, space] with a name of at most 64 chars")
                spaces[part[0]] = space_from_wire(part[1], f"{where}.{part[0]}", depth + 1)
            return gym.spaces.Dict(spaces)
    except ProtocolBreach:
        raise
    except (TypeError, ValueError, OverflowError, AssertionError) as e:  # gymnasium's own checks of the fields
        raise ProtocolBreach(f"{where}: {kind} rejected ({type(e).__name__}: {e})"[:300]) from None
    raise ProtocolBreach(f"{where}: kind {kind!r:.40}; allowed: Box, Discrete, MultiDiscrete, MultiBinary, Text, "
                         f"Dict, Tuple")


def spaces_from_wire(payload: bytes):
    """(observation space, action space) from the ``ready`` payload; ProtocolBreach for anything else."""
    try:
        data = json.loads(payload.decode("utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ProtocolBreach(f"spaces that are not JSON ({type(e).__name__})") from None
    if type(data) is not dict:
        raise ProtocolBreach("spaces that are not a JSON object")
    return (space_from_wire(data.get("observation"), "observation space"),
            space_from_wire(data.get("action"), "action space"))


# --------------------------------------------------------------------------- the shared block


def _fields(space) -> list[tuple[str | None, tuple, np.dtype, Any]]:
    """(Dict key or None, shape, dtype, sub-space) of each array an observation of ``space`` is stored as. A Text
    is its UTF-8 bytes after an int32 length; a Discrete one int64."""
    import gymnasium as gym

    def one(key, s):
        if isinstance(s, gym.spaces.Box):
            return (key, s.shape, s.dtype, s)
        if isinstance(s, gym.spaces.Discrete):
            return (key, (), np.dtype(np.int64), s)
        if isinstance(s, gym.spaces.MultiBinary):
            return (key, s.shape, np.dtype(np.int8), s)
        if isinstance(s, gym.spaces.MultiDiscrete):
            return (key, s.shape, s.dtype, s)
        if isinstance(s, gym.spaces.Text):
            return (key, (4 + _UTF8_MAX * s.max_length,), np.dtype(np.uint8), s)
        if _is_encoded_image(s):
            return (key, (4 + _encoded_bytes(s.image_shape),), np.dtype(np.uint8), s)
        raise ProtocolBreach(f"observation space: a {type(s).__name__} observation does not cross the sandbox; "
                             f"allowed: Box, Discrete, MultiBinary, MultiDiscrete, Text, or a Dict of those")

    if isinstance(space, gym.spaces.Dict):
        return [one(k, s) for k, s in space.spaces.items()]
    return [one(None, space)]


def _is_box(space) -> bool:
    import gymnasium as gym

    return isinstance(space, gym.spaces.Box)


def _is_encoded_image(space) -> bool:
    """``pipeline.modality.EncodedImage``, known by name: the wire does not load cv2 for envs without one."""
    return type(space).__name__ == "EncodedImage" and type(space).__module__ == "pipeline.modality"


def _encoded_bytes(shape) -> int:
    """Room for one PNG or JPEG frame of ``shape``: twice its pixels' bytes and a header's room, above what either
    encoding makes of any frame (PNG's worst case is the pixels, a filter byte a row and a few bytes a block)."""
    return 2 * math.prod(shape) + 4096


def _is_text(space) -> bool:
    import gymnasium as gym

    return isinstance(space, gym.spaces.Text)


def _aligned(n: int) -> int:
    return (n + 7) // 8 * 8


def array_action(space) -> tuple[tuple, np.dtype] | None:
    """(shape, dtype) of one action when it travels in the shared block (Discrete, Box, MultiDiscrete,
    MultiBinary), else None (a Dict or Tuple action goes in the command's pickle)."""
    import gymnasium as gym

    if isinstance(space, gym.spaces.Discrete):
        return (), np.dtype(np.int64)
    if isinstance(space, (gym.spaces.Box, gym.spaces.MultiDiscrete)):
        return tuple(space.shape), np.dtype(space.dtype)
    if isinstance(space, gym.spaces.MultiBinary):
        return tuple(space.shape), np.dtype(np.int8)
    return None


class Layout:
    """Where ``k`` envs' actions, observations (current and an ended episode's final one), rewards and flags sit
    in one shared block. The parent makes the block (``make_block``) from the checked spaces; the child maps the
    same descriptor with the layout of the same spaces (it rebuilds them from what it sent)."""

    def __init__(self, observation_space, k: int, action_space=None):
        self.space, self.k = observation_space, k
        self.action = array_action(action_space) if action_space is not None else None
        self.fields = _fields(observation_space)
        self.offsets, at = [], 0
        for _, shape, dtype, _ in self.fields:
            self.offsets.append(at)
            at += _aligned(max(1, math.prod(shape) * np.dtype(dtype).itemsize))
        self.obs_bytes = at
        if self.obs_bytes > OBS_LIMIT:
            raise ProtocolBreach(f"observation space: {self.obs_bytes} bytes an observation, over {OBS_LIMIT}")
        self.rewards_at = 0
        self.flags_at = _aligned(8 * k)
        self.actions_at = self.flags_at + _aligned(2 * k)
        action_bytes = k * math.prod(self.action[0]) * self.action[1].itemsize if self.action else 0
        if action_bytes > OBS_LIMIT:
            raise ProtocolBreach(f"action space: {action_bytes} bytes of actions a step, over {OBS_LIMIT}")
        self.obs_at = self.actions_at + _aligned(action_bytes)
        self.size = self.obs_at + 2 * k * self.obs_bytes

    def make_block(self) -> int:
        """A sealed memfd of this layout's size: neither side can shrink or grow it, so neither can make the other
        read past its end (SIGBUS)."""
        fd = os.memfd_create("ascent-env-block", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, self.size)
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return fd

    def map(self, fd: int) -> "Block":
        return Block(self, mmap.mmap(fd, self.size))


class Block:
    """A mapped shared block: typed views by env (``j`` within the child) and slot (0 current, 1 final)."""

    def __init__(self, layout: Layout, buf: mmap.mmap):
        self.layout, self.buf = layout, buf
        k = layout.k
        self.rewards = np.ndarray((k,), np.float64, buf, layout.rewards_at)
        self.flags = np.ndarray((k, 2), np.uint8, buf, layout.flags_at)
        #: The parent writes a step's actions here when they are arrays (``array_action``); None otherwise.
        self.actions = (np.ndarray((k,) + layout.action[0], layout.action[1], buf, layout.actions_at)
                        if layout.action else None)
        self.views = [[[np.ndarray(shape, dtype, buf, layout.obs_at + (slot * k + j) * layout.obs_bytes + off)
                        for (_, shape, dtype, _), off in zip(layout.fields, layout.offsets)]
                       for slot in (0, 1)] for j in range(k)]
        #: For a plain Box space, each slot of all ``k`` envs as one (k, *shape) view: read with one copy, and
        #: nothing to check past its dtype and shape, which the view fixes.
        self.box = None
        (key, shape, dtype, space), = layout.fields[:1] if len(layout.fields) == 1 else [(1, 0, 0, 0)]
        if key is None and _is_box(space):
            strides = (layout.obs_bytes,) + np.empty(shape, dtype).strides
            self.box = [np.ndarray((k,) + tuple(shape), dtype, buf, layout.obs_at + slot * k * layout.obs_bytes,
                                   strides=strides) for slot in (0, 1)]

    # the child's side
    def write_obs(self, j: int, slot: int, obs) -> None:
        if self.box is not None:
            self.box[slot][j] = obs
            return
        for (key, _, _, space), view in zip(self.layout.fields, self.views[j][slot]):
            value = obs if key is None else obs[key]
            if _is_text(space) or _is_encoded_image(space):
                data = (bytes(value) if _is_encoded_image(space) else str(value).encode("utf-8"))[: view.size - 4]
                view[:4] = np.frombuffer(struct.pack("<i", len(data)), np.uint8)
                view[4:4 + len(data)] = np.frombuffer(data, np.uint8)
            else:
                view[...] = value

    # the parent's side
    def read_obs(self, j: int, slot: int):
        """A checked copy of env ``j``'s observation; ProtocolBreach when it is not in its space."""
        if self.box is not None:
            return self.box[slot][j].copy()
        import gymnasium as gym

        out = {}
        for (key, _, _, space), view in zip(self.layout.fields, self.views[j][slot]):
            value = view.copy()  # copied before it is checked: the child may write on after its reply
            name = key or "observation"
            if isinstance(space, gym.spaces.Text) or _is_encoded_image(space):
                (n,) = struct.unpack("<i", value[:4].tobytes())
                if not 0 <= n <= value.size - 4:
                    raise ProtocolBreach(f"{name}: {n} bytes in a slot of {value.size - 4}")
                value = value[4:4 + n].tobytes()
                if isinstance(space, gym.spaces.Text):
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError:
                        raise ProtocolBreach(f"{name}: a text that is not UTF-8") from None
                if not space.contains(value):
                    raise ProtocolBreach(f"{name}: a {type(space).__name__} outside its space ({len(value)} long)")
            elif isinstance(space, gym.spaces.Discrete):
                value = np.int64(value)
                if not space.start <= value < space.start + space.n:
                    raise ProtocolBreach(f"{name}: {int(value)} outside Discrete({space.n}, start={space.start})")
            if key is None:
                return value
            out[key] = value
        return out

    def read_steps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rewards, terminated, truncated) of all ``k`` envs, copied, then checked: finite rewards, flags 0 or 1."""
        rewards, flags = self.rewards.copy(), self.flags.copy()
        if not np.isfinite(rewards).all():
            raise ProtocolBreach(f"a reward of {rewards[~np.isfinite(rewards)][0]}")
        if (flags > 1).any():
            raise ProtocolBreach(f"flags {flags[(flags > 1).any(axis=1)][0].tolist()} that are not booleans")
        return rewards, flags[:, 0].astype(bool), flags[:, 1].astype(bool)

    def read_all(self, slot: int):
        """Every env's observation in ``slot``, checked (``read_obs``): a list, or for a plain Box one (k, ...)
        array, copied at once."""
        if self.box is not None:
            return self.box[slot].copy()
        return [self.read_obs(j, slot) for j in range(self.layout.k)]

    def close(self) -> None:
        self.views = []
        self.rewards = self.flags = self.box = self.actions = None
        try:
            self.buf.close()
        except BufferError:  # a view still exported; the mapping goes with the last one
            pass
