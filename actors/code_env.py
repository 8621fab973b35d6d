"""A code-execution env: each episode a small programming task, the actions a short program, the reward the share
of hidden tests it passes (``actors.code_env:AscentRL/Code-v0``; configs/code.yaml).

A task is a function of one integer (``x + 1``, ``2x``, ...) shown by ``EXAMPLES`` input/output pairs. Each action
appends one instruction of ``INSTRUCTIONS``; ``end`` (or the program's last slot) turns the program into Python
source and runs it on ``HIDDEN_TESTS`` other inputs, in a process of its own with a time limit
(``program_timeout_s``). The instruction set can express what code nobody has read does: ``loop`` puts every
instruction after it inside ``while True:`` (a program that never ends), ``grow`` doubles a list (under ``loop``:
allocation without bound), ``fork`` forks (under ``loop``: a fork bomb), ``write`` writes a file outside the
program's directory. A random policy writes such programs all the time; they score 0 and must not hurt the run,
which is what ``env.isolation: process`` is for (actors/sandbox.py): its address-space, process-count and file
limits and its uid contain them, and this env kills each program's process group when its time is up.

So the env refuses to run outside a sandbox (``ASCENT_SANDBOX`` in its environment) unless ``hazards`` is false:
then ``loop``, ``grow``, ``fork`` and ``write`` compile to ``pass`` (what the cost bench's ``none`` column runs).
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import time

import gymnasium as gym
import numpy as np

CODE_ID = "AscentRL/Code-v0"

#: The instructions, in action order; each a line of the program's body (``loop`` opens a block).
INSTRUCTIONS = ("end", "inc", "dec", "double", "neg", "square", "loop", "grow", "fork", "write")
_LINES = {"inc": "x = x + 1", "dec": "x = x - 1", "double": "x = x * 2", "neg": "x = -x", "square": "x = x * x",
          "grow": "buf = buf + buf", "fork": "os.fork()",
          "write": "open('/var/lib/ascent-code-env-escape', 'a').write(str(x))"}
HAZARDS = ("loop", "grow", "fork", "write")
#: The tasks: target programs over the safe instructions. Distinct functions, so the examples tell them apart.
TASKS = (("inc",), ("double",), ("neg",), ("inc", "inc"), ("double", "inc"), ("dec", "neg"))
#: Shown input/output pairs per task (in the observation) and hidden ones (the reward): fixed inputs, so a task
#: is one function and its examples; the hidden ones are other inputs, so copying outputs scores nothing.
EXAMPLE_INPUTS = (1, 2, 3)
HIDDEN_INPUTS = (-3, 0, 4, 5, 7)
#: Divides the examples' values in the observation: they stay within +-2 for every task.
SCALE = 10.0


def source(program) -> str:
    """The program (instruction names) as the Python function it runs as."""
    lines, indent = ["def program(x):", "    import os", "    buf = [0] * 1024"], "    "
    for name in program:
        if name == "loop":
            lines.append(indent + "while True:")
            indent += "    "
            lines.append(indent + "pass")
        elif name != "end":
            lines.append(indent + _LINES[name])
    lines.append("    return x")
    return "\n".join(lines)


def run_program(program, inputs, timeout_s: float, memory_mb: int | None = 256) -> tuple[list | None, str]:
    """Run ``program`` on each input in a forked process of its own (its own process group, killed whole when
    ``timeout_s`` passes) -> (outputs or None, outcome: ok, timeout, or the error's type)."""
    code = source(program)
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:  # the sandbox's process limit, held by an earlier program's leftovers
        os.close(r)
        os.close(w)
        return None, type(e).__name__
    if pid == 0:  # the program's process: never returns into the env
        me = os.getpid()
        try:
            os.close(r)
            os.setpgid(0, 0)
            if memory_mb:
                soft, hard = resource.getrlimit(resource.RLIMIT_AS)
                cap = memory_mb * 2**20 if hard == resource.RLIM_INFINITY else min(memory_mb * 2**20, hard)
                resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
            scope: dict = {}
            exec(compile(code, "<program>", "exec"), scope)  # noqa: S102 - what the sandbox exists for
            out = [scope["program"](x) for x in inputs]
            if os.getpid() == me:
                os.write(w, json.dumps({"ok": [o if abs(o) < 2**53 else None for o in out]}).encode())
        except BaseException as e:  # noqa: BLE001 - any failure of the program is its outcome
            if os.getpid() == me:
                try:
                    os.write(w, json.dumps({"error": type(e).__name__}).encode())
                except BaseException:  # noqa: BLE001
                    pass
        os._exit(0)
    os.close(w)
    try:  # here too: under load the program may not have run its own setpgid when its time is up
        os.setpgid(pid, pid)
    except OSError:  # it got there first, or is gone already: its group is set either way
        pass
    try:
        ready, _, _ = select.select([r], [], [], timeout_s)
        data = os.read(r, 1 << 16) if ready else b""
    finally:
        os.close(r)
        for kill in (os.killpg, os.kill):  # the program and whatever it forked; the program itself in any case
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os.waitpid(pid, 0)
    if not ready:
        return None, "timeout"
    try:
        reply = json.loads(data or b"{}")
    except ValueError:
        return None, "garbled"
    if "ok" in reply:
        return reply["ok"], "ok"
    return None, reply.get("error", "died")


class CodeEnv(gym.Env):
    """Observation: the examples (inputs and outputs / SCALE), the program so far (one-hot per slot) and the slot
    to fill next; action: an instruction; reward: at the program's end, the share of hidden tests passed."""

    metadata = {"render_modes": []}

    def __init__(self, max_len: int = 4, program_timeout_s: float = 0.05, hazards: bool = True,
                 tasks: int = len(TASKS), program_memory_mb: int = 256):
        if hazards and not os.environ.get("ASCENT_SANDBOX"):
            raise ValueError(f"{CODE_ID} runs programs that loop, allocate, fork and write without bound, outside "
                             f"a sandbox; allowed: env.isolation: process, or env.kwargs.hazards: false (those "
                             f"instructions then do nothing)")
        if not 1 <= tasks <= len(TASKS):
            raise ValueError(f"env.kwargs.tasks: {tasks!r}; allowed: 1 to {len(TASKS)}")
        self.max_len, self.timeout_s, self.hazards = int(max_len), float(program_timeout_s), bool(hazards)
        self.tasks, self.memory_mb = TASKS[:tasks], program_memory_mb
        k = len(INSTRUCTIONS)
        size = 2 * len(EXAMPLE_INPUTS) + self.max_len * k + self.max_len
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (size,), np.float32)
        self.action_space = gym.spaces.Discrete(k)
        self.outcomes: dict[str, int] = {}  # programs run, by outcome (ok, timeout, MemoryError, ...)
        self._task = self.tasks[0]
        self._program: list[str] = []

    def _obs(self) -> np.ndarray:
        k = len(INSTRUCTIONS)
        obs = np.zeros(self.observation_space.shape, np.float32)
        expected = run_reference(self._task, EXAMPLE_INPUTS)
        n = len(EXAMPLE_INPUTS)
        obs[:n] = np.asarray(EXAMPLE_INPUTS) / SCALE
        obs[n:2 * n] = np.asarray(expected) / SCALE
        base = 2 * n
        for slot, name in enumerate(self._program):
            obs[base + slot * k + INSTRUCTIONS.index(name)] = 1.0
        if len(self._program) < self.max_len:
            obs[base + self.max_len * k + len(self._program)] = 1.0
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        self._program = []
        return self._obs(), {}

    def step(self, action):
        name = INSTRUCTIONS[int(action)]
        if name != "end":
            self._program.append(name if self.hazards or name not in HAZARDS else "end")
        if name != "end" and len(self._program) < self.max_len:
            return self._obs(), 0.0, False, False, {}
        program = [p for p in self._program if p != "end"]
        outputs, outcome = run_program(program, HIDDEN_INPUTS, self.timeout_s, self.memory_mb)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        expected = run_reference(self._task, HIDDEN_INPUTS)
        passed = 0.0 if outputs is None else float(np.mean([o == e for o, e in zip(outputs, expected)]))
        return self._obs(), passed, True, False, {"outcome": outcome, "program": program}


def run_reference(task, inputs) -> list[int]:
    """A task's outputs, computed here (its instructions are the safe ones)."""
    out = []
    for x in inputs:
        for name in task:
            x = {"inc": x + 1, "dec": x - 1, "double": x * 2, "neg": -x, "square": x * x}[name]
        out.append(x)
    return out


if CODE_ID not in gym.registry:
    gym.register(CODE_ID, entry_point=CodeEnv, max_episode_steps=64)
