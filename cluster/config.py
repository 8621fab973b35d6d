"""The config schema: the one place that defines every setting.

Each field carries its documentation (meaning, unit) and its allowed range in
``metadata``; ``validate`` reads the same metadata, and the configuration
reference's table (docs/configuration.md) is generated from it (``python -m
cluster.config --markdown``, ``make docs``), so the docs cannot drift from the
code. The settings of one modality
(``env.modalities.<key>``) are ``pipeline.contract.ModalitySpec``, declared
there the same way and embedded here as they are.

Errors are ``ConfigError``: one line naming the key path, the bad value and
what is allowed. The CLI turns them into exit code 2 before Ray starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

import yaml

from learner.device import KINDS as DEVICE_KINDS  # the device table only: no torch
from pipeline.contract import ModalitySpec, conflicts, setting  # the observation contract: standard library only
from pipeline.errors import MAX_ERROR_CHARS, ConfigError  # noqa: F401  (re-exported: callers import it from here)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, path: str, first_line: int, second_line: int):
        super().__init__(f"{path} is given twice (lines {first_line} and {second_line})")
        self.path, self.lines = path, (first_line, second_line)


#: Largest config file (and --set value) read: a config is settings written by hand (the shipped ones are 1-3 KB);
#: past this it is not a config, and PyYAML's pure-Python loader would spend seconds on it.
MAX_YAML_BYTES = 1 << 20
#: Deepest nesting of a config's YAML (sections, env.kwargs, ...), aliases expanded. PyYAML composes and builds
#: nodes recursively, so a deeper document is a RecursionError rather than an answer; the schema's own settings
#: nest 6 deep (env.modalities.<key>.size and its entries).
MAX_YAML_DEPTH = 64
#: Most values a config's YAML may hold, aliases expanded. An alias repeats its node without repeating its text, so
#: a few hundred bytes can expand to 10^9 values (the "billion laughs"); every setting plus any env.kwargs a person
#: writes is far below this, and this many build in well under a second.
MAX_YAML_NODES = 100_000


class _TooLarge(yaml.YAMLError):
    """A document past MAX_YAML_DEPTH or MAX_YAML_NODES, or an alias that holds itself (endless when expanded)."""

    def __init__(self, problem: str, mark=None):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a float (YAML 1.2); PyYAML (YAML 1.1) wants a dot.

    Resolving it in the loader keeps quoted scalars such as ``"1e3"`` strings.

    It also refuses a key given twice in one mapping: PyYAML silently keeps the last one, so a file with ``lr:``
    twice under ``learner:`` would train with whichever the reader did not look at. And it refuses documents that
    would not load in bounded time and stack (MAX_YAML_DEPTH, MAX_YAML_NODES) before building anything.
    """

    _depth = 0

    def compose_node(self, parent, index):
        # Counted while composing, which recurses once per level: a deep document stops here, not at the
        # interpreter's recursion limit.
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _TooLarge(f"nested deeper than {MAX_YAML_DEPTH} levels; allowed: at most {MAX_YAML_DEPTH}",
                                self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node):
        self._check_expansion(node, 1, {}, set())
        self._refuse_duplicate_keys(node, "", set())
        return super().construct_document(node)

    def _check_expansion(self, node, depth: int, done: dict, open_: set) -> tuple[int, int]:
        """(values, levels) of ``node`` with its aliases expanded, each shared node counted once per use but
        walked once (``done``), so a bomb is measured without being built."""
        key = id(node)
        if key in open_:
            raise _TooLarge("an alias holds the node it names, so it never ends; allowed: aliases of other nodes",
                            node.start_mark)
        if key not in done:
            open_.add(key)
            values, levels = 1, 1
            children = node.value if isinstance(node, yaml.SequenceNode) else (
                [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else [])
            for child in children:
                n, h = self._check_expansion(child, depth + 1, done, open_)
                values, levels = values + n, max(levels, h + 1)
                if values > MAX_YAML_NODES:
                    raise _TooLarge(f"expands to more than {MAX_YAML_NODES:,} values (aliases repeat what they "
                                    f"name); allowed: at most {MAX_YAML_NODES:,}", node.start_mark)
            open_.discard(key)
            done[key] = (values, levels)
        values, levels = done[key]
        if depth - 1 + levels > MAX_YAML_DEPTH:
            raise _TooLarge(f"nested deeper than {MAX_YAML_DEPTH} levels once its aliases are expanded; allowed: at "
                            f"most {MAX_YAML_DEPTH}", node.start_mark)
        return values, levels

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # past Python's limit on reading an int from text, which no setting comes near
            raise _TooLarge(f"an integer of {len(str(node.value)):,} characters; allowed: at most "
                            f"{sys.get_int_max_str_digits():,} digits", node.start_mark) from None

    def _refuse_duplicate_keys(self, node, path: str, seen: set) -> None:
        if id(node) in seen:  # an alias: already checked (and a recursive one would never end)
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._refuse_duplicate_keys(item, f"{path}[{i}]", seen)
        elif isinstance(node, yaml.MappingNode):
            lines: dict = {}
            for key, value in node.value:
                sub = path
                # A '<<' merge key may repeat and may be overridden: that is what it is for.
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    sub = f"{path}.{key.value}" if path else key.value
                    line = key.start_mark.line + 1
                    if (key.tag, key.value) in lines:
                        raise _DuplicateKey(sub, lines[key.tag, key.value], line)
                    lines[key.tag, key.value] = line
                self._refuse_duplicate_keys(value, sub, seen)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


# --------------------------------------------------------------------------- upper bounds


class Bound(typing.NamedTuple):
    """An upper bound a setting takes from its kind when the schema gives it no ``max`` of its own."""

    value: float
    shown: str  # as the reference's table and the error write it
    why: str  # what breaks past it, for the error line


#: Longest duration a setting may ask for. The run waits on its timeouts through Ray (int64 milliseconds: 2^63 ms)
#: and through the OS's lock and timer waits (threading.TIMEOUT_MAX: 2^63 ns, ~292 years here); some waits are a
#: duration plus a grace or a multiple of it (run.stall_timeout_s + the driver's 30 s, the learners' process group
#: at 2 x run.stall_timeout_s + 120 s), so the bound sits well under the tighter one.
MAX_DURATION_S = 1e9
#: Largest count (steps, samples, iterations, ...): exact as a float64 (rates, the progress line's ETA, JSON
#: metrics) and within the int64 of torch and numpy counters.
MAX_COUNT = 2**53
#: Most CPUs a setting may reserve or offer: Ray keeps resource amounts as int64 ten-thousandths (overflowing past
#: ~9.2e14), and no cluster comes near a million.
MAX_CPUS = 1_000_000

_DURATION = Bound(MAX_DURATION_S, f"{MAX_DURATION_S:g}",
                  "about 31 years: the longest wait Ray's int64-millisecond timeouts and the OS's timer waits "
                  "(threading.TIMEOUT_MAX) accept, with room for the grace a run adds")
#: Bounds by unit, then by type: every duration and count has one even where the schema names no max.
UNIT_BOUNDS = {
    "s": _DURATION,
    "ms": _DURATION._replace(value=MAX_DURATION_S * 1000, shown=f"{MAX_DURATION_S * 1000:g}"),
    "CPUs": Bound(MAX_CPUS, f"{MAX_CPUS:,}", "Ray keeps resource amounts as int64 ten-thousandths"),
}
COUNT_BOUND = Bound(MAX_COUNT, "2^53", "a count must stay exact as a float64 and within int64")


def upper_bound(cls, name: str) -> Bound | None:
    """The upper bound of setting ``name`` of section ``cls``: its ``max``, else its unit's (UNIT_BOUNDS), else
    COUNT_BOUND for an integer (and for each entry of a list of integers such as learner.hidden_sizes)."""
    m = _fields(cls)[name].metadata
    if m.get("max") is not None:
        return Bound(m["max"], str(m["max"]), "")
    if m.get("unit") in UNIT_BOUNDS:
        return UNIT_BOUNDS[m["unit"]]
    tp = _type_of(cls, name)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1:
        tp = args[0]
    return COUNT_BOUND if tp in (int, tuple) else None


def _shown(value) -> str:
    """A value for an error line: a huge integer (10**400) as its size, not hundreds of digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18:
        if value.bit_length() < 1000:  # within a float: 1e99 reads back as written
            return f"{float(value):.6g}"
        try:
            return f"an integer of {len(str(abs(value))):,} digits"
        except ValueError:  # past Python's int-to-text limit
            return f"an integer of over {sys.get_int_max_str_digits():,} digits"
    return repr(value)


@dataclass
class WrapperConfig:
    path: str = setting("", "The wrapper: `module:Callable`, called as Callable(env, **kwargs) -> env.")
    kwargs: dict = setting({}, "Keyword arguments of the wrapper.")


@dataclass
class EnvLimitsConfig:
    memory_mb: Optional[int] = setting(
        1024, "env.isolation: process: memory of each env child: its cgroup's limit over every process it forks, "
              "memfd, shared memory and tmpfs pages together (past it the kernel's OOM killer ends the child), and "
              "the address space of each of its processes (RLIMIT_AS: an allocation past it fails in the env, "
              "MemoryError). Either way the child is replaced. Python with numpy and gymnasium maps about 300 MiB "
              "of address space before the env is made. null: no limit.", unit="MiB", min=64,
        max=2**30)
    cpu_s: Optional[int] = setting(
        60, "env.isolation: process: CPU seconds an env child may use per episode, all its processes together "
            "(the kernel's count for its cgroup, read by the rollout actor at least once a second); past it the "
            "child is killed and replaced. null: no limit.", unit="s", min=1, max=10**6)
    processes: Optional[int] = setting(
        16, "env.isolation: process: processes and threads an env child and everything it starts may have at "
            "once (its pids cgroup, and RLIMIT_NPROC under a uid of its own); a fork past it fails in the env. "
            "null: no limit.",
        min=1, max=4096)
    open_files: Optional[int] = setting(
        64, "env.isolation: process: open file descriptors of an env's process (RLIMIT_NOFILE). null: no limit.",
        min=16, max=1_048_576)
    file_mb: Optional[int] = setting(
        64, "env.isolation: process: largest file an env may write (RLIMIT_FSIZE), and the size of its private "
            "/tmp (its working directory is there). null: no limit.", unit="MiB", min=1, max=2**30)
    step_timeout_s: float = setting(
        10.0, "env.isolation: process: wall time one step (or reset) of an env may take; a process that has not "
              "answered by then is killed and replaced (an env that loops, blocks or sleeps).", unit="s", min=0.0,
        min_exclusive=True, max=86400.0)


@dataclass
class EnvConfig:
    id: str = setting("CartPole-v1", "Gymnasium environment id; `module:Id` imports the module first (e.g. "
                                     "`minigrid:MiniGrid-Fetch-5x5-N2-v0`). Box observations, or Dict observations "
                                     "described in env.modalities; actions Discrete, MultiDiscrete, MultiBinary, a Box of any shape, or "
                                     "Tuple/Dict of those.")
    backend: str = setting(
        "gymnasium", "How the rollouts' envs are made and stepped: gymnasium (gymnasium.make per env, stepped in turn) "
                     "or envpool (EnvPool's C++ vectorised envs, one batched call per step; env.id is an EnvPool task "
                     "such as Pong-v5, and env.kwargs go to envpool.make; the `envpool` extra). Same fragments, "
                     "autoreset and truncation bootstrapping either way.", choices=("gymnasium", "envpool"))
    max_episode_steps: Optional[int] = setting(
        None, "Time limit override; episodes cut by it are truncated (bootstrapped), not terminated. null keeps the env's own.",
        unit="steps", min=1)
    modalities: Dict[str, ModalitySpec] = setting(
        {}, "Dict-observation envs: one entry per observation key used, `env.modalities.<key>.<field>` (fields in the "
            "table below); keys left out are ignored. Empty for Box observations.")
    kwargs: dict = setting({}, "Keyword arguments of the env's constructor (gymnasium.make(env.id, **kwargs)).")
    wrappers: typing.List[WrapperConfig] = setting(
        [], "Wrappers applied in order inside every actor: `module:Callable` strings, or {path: module:Callable, "
            "kwargs: {...}} entries (the module is imported on the actor's host, e.g. from --working-dir).")
    normalize_obs: Optional[bool] = setting(
        None, "Box envs: running mean/std of the observations in the model (the statistics travel with the "
              "weights); null = on for continuous actions (as CleanRL's continuous PPO), off otherwise.")
    normalize_reward: Optional[bool] = setting(
        None, "Scale rewards by a running std of the discounted return (VecNormalize's reward scaling, clipped to "
              "+-10) before GAE; null = on for continuous actions, off otherwise.")

    defaults: str = setting(
        "auto", "Which defaults the learning settings this config leaves unset take: discrete (the schema's values in "
                "this table), continuous (cluster.config.CONTINUOUS_DEFAULTS, CleanRL's continuous-action PPO: "
                "replay.max_policy_lag 0, ppo.ent_coef 0, ppo.update_epochs 10, learner.minibatch_size 64, learner.lr "
                "3e-4), or auto: continuous for a Box action space, discrete for any other. A setting the config "
                "names keeps its value; --dry-run and the run's config.yaml show what was picked.",
        choices=("auto", "discrete", "continuous"))

    action_mask_key: Optional[str] = setting(
        "action_mask", "Dict observations: the key of an action mask (PettingZoo's classic convention), one flag per "
                       "choice of every Discrete/MultiDiscrete part; illegal actions are never sampled and log-probs "
                       "and entropy are over the legal ones. Not an env.modalities entry. Used when the env has the "
                       "key; null ignores it.")

    isolation: str = setting(
        "none", "Where each env runs: none (in its rollout actor's process: fastest, and the env is trusted code) or "
                "process (a child process of its own per env, with no Ray, no handles and no token, its own uid, "
                "its own working directory, no network, and the env.limits caps; a child that breaks one is killed, "
                "its episode dropped and counted in env_failures, and the actor goes on; docs/sandbox.md). process "
                "is for envs that run code nobody has read (the code env, configs/code.yaml).",
        choices=("none", "process"))
    envs_per_child: int = setting(
        1, "env.isolation: process: envs each child process holds, stepped in one round trip. 1: a crash costs one "
           "episode, and env.limits hold per env; more: fewer processes and round trips (CartPole with 8 envs in "
           "one child steps several times faster than in 8), but a child's failure ends the episodes of all its "
           "envs, and env.limits hold for them together (docs/sandbox.md).", min=1, max=4096)
    limits: EnvLimitsConfig = field(default_factory=EnvLimitsConfig)

    def make_args(self) -> dict:
        """How to make one env, as plain data (it travels to the actors): actors.envs.make_env's arguments."""
        return {"max_episode_steps": self.max_episode_steps, "env_kwargs": dict(self.kwargs),
                "wrappers": [dataclasses.asdict(w) for w in self.wrappers], "backend": self.backend}

    def isolation_args(self) -> dict | None:
        """env.isolation as plain data for every env made under this config (None under none): the limits of
        ``actors.sandbox.Limits`` and the envs each child holds. Under process a policy's single env is a sandboxed
        child too (``actors.envs.SandboxedEnv``), and videos are refused."""
        return None if self.isolation == "none" else {"limits": dataclasses.asdict(self.limits),
                                                      "envs_per_child": self.envs_per_child}


@dataclass
class PreprocessConfig:
    workers: int = setting(2, "Preprocessing threads in each rollout actor, shared by the fast and slow queues "
                              "(earliest deadline first); 0 runs preprocessing inline in the stepping loop.",
                           min=0, max=256)
    max_slow_workers: Optional[int] = setting(
        None, "Threads that may work on slow modalities at once; null = workers - 1 (one stays free for the next "
              "action's fast modalities).", min=1)
    fast_queue: int = setting(64, "Bound of the fast queue (jobs; one job = one modality for all envs of a step).",
                              unit="jobs", min=1, max=100000)
    slow_queue: int = setting(64, "Bound of the slow queue.", unit="jobs", min=1, max=100000)
    remote_actors: int = setting(
        0, "Second tier: Ray actors on CPU hosts that run the slow modalities' preprocessing for each rollout actor "
           "(the hierarchical pipeline for many heavy modalities); 0 keeps it in the rollout actor's threads.",
        min=0, max=1024)


@dataclass
class RolloutConfig:
    num_actors: int = setting(
        1, "Rollout actors (one CPU process each, on CPU hosts). auto: start at rollout.min_actors and follow the "
           "run's host-bound signal between rollout.min_actors and rollout.max_actors (cluster/autoscale.py).",
        min=1, max=4096, auto=True)
    min_actors: int = setting(1, "Fewest rollout actors (and the start) under rollout.num_actors: auto; at least "
                                 "replay.num_shards.", min=1, max=4096)
    max_actors: int = setting(64, "Most rollout actors rollout.num_actors: auto runs (never more than the free CPUs "
                                  "hold).", min=1, max=4096)
    autoscale_host_bound: float = setting(
        0.2, "rollout.num_actors: auto adds rollout actors when the learners waited for data at least this share of "
             "their time over rollout.autoscale_window iterations, and removes them when they waited under half of "
             "it while the actors waited for tickets at least half of theirs.", unit="fraction", min=0.0,
        min_exclusive=True, max=1.0)
    autoscale_window: int = setting(4, "Iterations rollout.num_actors: auto averages over before a decision (and "
                                       "measures afresh after one).", unit="iterations", min=1, max=1000)
    envs_per_actor: int = setting(16, "Environments stepped together in each actor's vector env (N).", min=1, max=65536)
    fragment_length: int = setting(128, "Steps per fragment (T); a fragment is T x N transitions from one policy version.",
                                   unit="steps", min=1, max=100000)
    num_cpus_per_actor: float = setting(1.0, "Ray CPU resource each rollout actor reserves.", unit="CPUs", min=0.0)
    fragments_per_add: int = setting(
        8, "Most fragments an actor sends to its shard in one add. A fragment goes at once when the previous add is "
           "acknowledged; those made while it is still out go together, up to this many (then the actor waits for "
           "the ack). So adds grow only under load: fewer shard and board calls per fragment, no added latency. "
           "1: one fragment per add, always.", unit="fragments", min=1, max=256)
    ticket_blocks: bool = setting(
        True, "An actor asks the supply board for a block of tickets in one poll (about pipeline.protocol.BLOCK_S of "
              "fragments, a fair share of what is free), not one ticket a poll: fewer board calls at hundreds of "
              "actors. false: one ticket a poll (the same ledger, more calls; docs/protocol.md).")
    torch_threads: int = setting(1, "torch intra-op threads in each rollout actor (small MLPs run fastest on 1).",
                                 min=1, max=256)
    fragment_timeout_s: float = setting(
        "auto", "Lease of one ticket: a fragment not stored this long after its ticket was issued is given to another "
                "actor (a late copy is refused), and an actor whose env makes no step for this long, or that does not "
                "answer its health call, is killed and replaced (rollout_hangs). auto: 4 x the median time from issue "
                "to store over the recent fragments, at least 10 s.", unit="s", min=0.0, min_exclusive=True, auto=True)
    max_env_failures: int = setting(
        1000, "Rollout actor faults a run survives (an env that raises in reset or step, a crashed, hung or "
              "over-memory actor: each is replaced and counted); one more ends the run (exit 5, final.pt). Fresh "
              "actors failing with the same error 3 times in a row before their first fragment end it sooner.",
        min=0, max=10_000_000)
    memory_limit_mb: Optional[int] = setting(
        None, "Resident memory a rollout actor's process may reach; past it the actor is killed and replaced like a "
              "crashed one (counted in rollout_memory_kills), before a leaking env takes its host down. null: no "
              "limit.", unit="MiB", min=1)
    node_relays: str = setting(
        "auto", "A ticket relay per node (pipeline/relay.py): the node's rollout actors take their tickets from it, "
                "and it takes them from the supply board in one call per block for the whole node, carrying the "
                "actors' stats up with it, so the board's calls grow with nodes, not actors. An actor whose relay "
                "fails polls the board itself. auto: on a cluster (rollout actors on several nodes), for each node "
                "that starts with at least 16 rollout actors; never on one node, where a relay only moves the "
                "board's work to another process on the same cores. always: every rollout node (also one). "
                "never.", choices=("auto", "always", "never"))
    inference: str = setting(
        "local", "Where the rollout actors' policy forward runs. local: each actor's CPU copy. remote: one inference "
                 "server per rollout node (actors/inference.py) batches the forwards of all its actors, on the "
                 "node's accelerator when it has one (learner.device's kind), else on its CPU; each actor still draws "
                 "its actions itself, from the server's policy-head output with its own generator (the local copy's "
                 "actions), and serves a step from its local copy when the server fails or is late "
                 "(inference_fallbacks). One memoryless policy: not with learner.rnn or multiagent.policies.",
        choices=("local", "remote"))
    relay_calls_per_s: float = setting(
        100.0, "The node relays' calls to the supply board together, at most, a second: the board tells each relay "
               "the least interval between its calls (relays / this, at most 1 s), so the board's calls follow this, "
               "not the node count (a busy relay calls ~15-20 times a second on its own clocks, ~0.85 ms of the "
               "board's CPU each). The price is latency: an update's last confirmations and a node's next tickets "
               "wait up to that interval at the relay. Raise it on many nodes when the learners wait for data "
               "(host-bound) and the board has CPU to spare (bench/control_plane.py; docs/results.md).",
        unit="calls/s", min=1.0, max=100_000.0)


@dataclass
class ReplayConfig:
    num_shards: int = setting(1, "Replay shard actors holding fragments in Ray's object store (rollout actor a writes "
                                 "to shard a mod num_shards, on its node; every learner reads every shard); at most "
                                 "rollout.num_actors.", min=1, max=1024)
    capacity_fragments: int = setting(
        "auto", "Hard ceiling of fragments in one shard. The supply board's tickets already bound all shards together "
                "to (max_policy_lag + 1) x fragments per update; auto is that bound, and a number must be at least it.",
        unit="fragments", min=1, max=1_000_000, auto=True)
    max_policy_lag: int = setting(
        1, "Oldest policy a fragment may come from, in versions behind the update that trains on it. Rollouts get "
           "tickets for update u once policy u - max_policy_lag exists, so nothing is made stale. 0 is strictly "
           "on-policy (rollouts wait while the learners update).", unit="versions", min=0, max=1000)
    stored_pacing: bool = setting(
        True, "A shard confirms the adds nobody waits for once every pipeline.protocol.STORED_PACE_S, in one call, "
              "and an update's tail on the short clock (STORED_GATHER_S) once the board asks: fewer board calls at "
              "hundreds of actors. false: every add confirmed on the short clock (the same ledger, more calls; "
              "docs/protocol.md).")


@dataclass
class PPOConfig:
    gamma: float = setting(0.99, "Discount factor.", min=0.0, max=1.0)
    gae_lambda: float = setting(0.95, "GAE lambda (computed on the rollout host).", min=0.0, max=1.0)
    clip_coef: float = setting(0.2, "Surrogate and value clipping range epsilon.", min=0.0, min_exclusive=True, max=10.0)
    clip_vloss: bool = setting(True, "Clip the value loss around the behaviour values (pessimistic max); under "
                                     "clip_around update_start, around the update start's.")
    clip_around: str = setting(
        "behaviour", "What the ratio and the value are clipped around. behaviour: the policy that sampled the rows "
                     "(PPO as published). update_start: the weights each update starts from, one forward of the "
                     "batch without gradients, with behaviour -> start as each row's importance weight (the "
                     "decoupled objective of Hilton et al. 2022): with replay.max_policy_lag > 0 every update gets "
                     "its whole clip range; at lag 0 the two agree.", choices=("behaviour", "update_start"))
    # max (vf_coef, ent_coef): weights in use are 0.25-1 and 0-0.1; past these the term swamps the normalised
    # policy loss (advantages of std 1) a hundredfold and more, and 1e308 overflows the loss to inf, which can only
    # make every update non-finite (run.max_nonfinite_updates).
    vf_coef: float = setting(0.5, "Value-loss weight in the total loss (at most 100: past it the value loss swamps "
                                  "the policy loss, and a huge weight only overflows the loss).", min=0.0, max=100.0)
    ent_coef: float = setting(0.01, "Entropy bonus weight (at most 10: at 10 the bonus already outweighs any "
                                    "normalised advantage, so the policy only spreads out; a huge weight only "
                                    "overflows the loss).", min=0.0, max=10.0)
    # max: the clip scales the gradient by max_grad_norm / norm in float32 (3.4e38 at most); 1e6 already leaves any
    # gradient of a finite loss unclipped, so a larger value means nothing more and can overflow.
    max_grad_norm: float = setting(0.5, "Global gradient-norm clip, applied after the all-reduce (at most 1e6, which "
                                        "already clips no gradient a finite loss gives: set it that high for no "
                                        "clip).", min=0.0, min_exclusive=True, max=1e6)
    norm_adv: bool = setting(True, "Normalise advantages per minibatch.")
    update_epochs: int = setting(4, "Passes over each batch.", min=1, max=1000)
    target_kl: Optional[float] = setting(
        None, "Stop an update's epochs early once an epoch's mean approx-KL (averaged over the learners, so all "
              "stop together) passes this (CleanRL's and SB3's target_kl; 0.01-0.05 is usual). null = every epoch "
              "runs. Costs one host sync per epoch. At most 10: an epoch past a KL of 10 has replaced the policy; a "
              "larger value never stops anything.", min=0.0, min_exclusive=True, max=10.0)
    ent_coef_end: Optional[float] = setting(
        None, "Anneal ppo.ent_coef linearly to this over the run's updates (as learner.anneal_lr does the LR); "
              "null = constant. At most 10, as ppo.ent_coef.", min=0.0, max=10.0)
    clip_coef_end: Optional[float] = setting(
        None, "Anneal ppo.clip_coef linearly to this over the run's updates; null = constant.", min=0.0,
        min_exclusive=True, max=10.0)


@dataclass
class LearnerConfig:
    num_learners: int = setting(1, "Learner actors (data parallel; gradients all-reduced).", min=1, max=1024)
    device: str = setting("auto", "Learner device; auto detects NPU, then CUDA, then CPU.",
                          choices=DEVICE_KINDS)
    placement_resource: str = setting(
        "auto", "Ray resource each learner reserves one of, which makes its host an accelerator host. auto follows "
                "learner.device (npu -> NPU, cuda -> GPU, cpu -> none); set it to place CPU-compute learners on NPU/GPU "
                "hosts (e.g. a test cluster without real devices).", choices=("auto", "none", "NPU", "GPU"))
    batch_size: int = setting(
        2048, "Samples per PPO update across all learners; each learner takes batch_size / num_learners, in whole "
              "fragments. auto: the largest batch within [batch_size_min, batch_size_max] whose feed buffers fit in "
              "auto_batch_memory_fraction of the learner device's free memory, measured on a learner host at start-up.",
        unit="samples", min=1, auto=True)
    batch_size_min: int = setting(1024, "Smallest batch learner.batch_size: auto may pick.", unit="samples", min=1)
    batch_size_max: int = setting(65536, "Largest batch learner.batch_size: auto may pick.", unit="samples", min=1)
    auto_batch_memory_fraction: float = setting(
        0.25, "Share of the learner device's free memory learner.batch_size: auto may fill with batch buffers.",
        min=0.0, min_exclusive=True, max=1.0)
    minibatch_size: int = setting(512, "Samples per gradient step across all learners.", unit="samples", min=1)
    lr: float = setting(1e-3, "Adam learning rate (annealed, see anneal_lr). 1e-3: on a config that names only "
                              "env.id, Acrobot-v1 reached -92 to -97 at 500k env steps, against "
                              "-114 to -123 at 2.5e-4 (bench/defaults.py).", min=0.0, min_exclusive=True, max=1.0)
    adam_eps: float = setting(1e-5, "Adam epsilon (PPO uses 1e-5, not torch's 1e-8). At most 1: eps is added to the "
                                    "root of the squared-gradient average, so past 1 it, not the gradient, sets the "
                                    "step (a slower SGD).", min=0.0, min_exclusive=True, max=1.0)
    anneal_lr: bool = setting(True, "Anneal the learning rate linearly to 0 over run.total_env_steps.")
    # max: as rnn_hidden_size; a wider layer is an allocation failure in the learner, not a model.
    hidden_sizes: tuple = setting((64, 64), "Hidden layer widths: of the actor and of the critic MLP when every observation is a vector, else of the shared trunk after the encoders. "
                                            "Their weights (with the recurrent core's) at most 2^34, 64 GiB in float32: "
                                            "with the gradient and Adam's moments every learner holds, more than any "
                                            "one accelerator's memory (cluster.config.MAX_HIDDEN_WEIGHTS).",
                                  max=65536)
    rnn: Optional[str] = setting(
        None, "Recurrent core between the trunk and the heads (encoders -> trunk -> core -> actor and critic heads, for "
              "every observation kind): lstm or gru; null = none (memoryless). Trained by truncated BPTT over chunks of "
              "learner.rnn_seq_len steps from the states the rollouts stored.", choices=(None, "lstm", "gru"))
    rnn_hidden_size: int = setting(128, "Width of the recurrent core's state (an LSTM stores its h and c: twice that).",
                                   min=1, max=65536)
    rnn_seq_len: Optional[int] = setting(
        None, "BPTT chunk: steps per training sequence; must divide rollout.fragment_length and the per-learner "
              "minibatch. null = rollout.fragment_length (one sequence per env per fragment).", unit="steps", min=1)
    precision: str = setting("fp32", "Learner compute precision: bf16 / fp16 run the model under torch.autocast on the "
                                     "learner's device type (the loss stays fp32); fp16 adds a gradient scaler.",
                             choices=("fp32", "bf16", "fp16"))
    # max: each step that overflows halves the scale, so 2^32 comes down to the default 2^16 in 16 skipped steps;
    # past float32's 3.4e38 the scale is inf, which never comes down (every step skipped).
    fp16_init_scale: float = setting(65536.0, "fp16 gradient scaler: initial loss scale (at most 2^32: a larger one "
                                              "only overflows fp16's 65504 and skips steps until it halves back).",
                                     min=1.0, max=2.0**32)
    fp16_growth_factor: float = setting(2.0, "fp16 gradient scaler: scale growth factor after a run of finite steps "
                                             "(at most 16: a larger jump overflows at once, a skipped step each "
                                             "time).", min=1.0, min_exclusive=True, max=16.0)
    compile: bool = setting(False, "Wrap the model's evaluation in torch.compile; falls back to eager, with a warning "
                                   "and the reason in the metrics, where compilation does not work.")
    fused_update: bool = setting(True, "State-only models (every observation a vector) in fp32 train through the fused "
                                       "step (learner/fused_update.py: flat buffers, actor and critic as one batched "
                                       "matmul chain, the backward written out), the same numbers as autograd to 1e-5; "
                                       "false forces autograd. The metrics' update_path says which ran.")
    graphs: str = setting(
        "auto", "The fused step's launches: auto copies each minibatch into static buffers and replays the step as "
                "one captured device graph (weights, gradient and Adam state in it, no host sync inside), where the "
                "device can capture (torch.accelerator.Graph / CUDAGraph, torch_npu's NPUGraph); where it cannot "
                "(CPU) it runs the eager fused step, and a capture that fails falls back to the eager step. "
                "update_path says which ran and why (e.g. 'fused (graphs: no capture on cpu)'). off: the eager "
                "fused step.",
        choices=("auto", "off"))
    prefetch_batches: int = setting(1, "Batches the feed thread prepares ahead of the update (1 = double buffering).",
                                    min=1, max=16)
    group_claims: bool = setting(True, "With several learners, rank 0 claims every rank's fragments of an update in "
                                       "one supply-board call and sends each rank its part (pipeline/feed.py); "
                                       "false: each rank claims its own, one board call per learner and update.")
    num_cpus: float = setting(1.0, "Ray CPU resource each learner reserves.", unit="CPUs", min=0.0)
    torch_threads: int = setting(1, "torch intra-op threads in each learner.", min=1, max=256)


@dataclass
class RunConfig:
    # max: an int32, which every consumer takes (torch.manual_seed overflows on 1e99) and which leaves room for the
    # offsets added to it (+ 424_242 for the evaluator, ... * 7919 + actor_id for action sampling).
    seed: int = setting(1, "Base seed (torch, env resets, action sampling).", min=0, max=2**31 - 1)
    total_env_steps: int = setting(500_000, "Stop after this many environment steps; also the lr annealing horizon.",
                                   unit="steps", min=1)
    target_return: Optional[float] = setting(
        None, "Stop successfully once the 100-episode mean return reaches this; null disables it.")
    target_success_rate: Optional[float] = setting(
        None, "Stop successfully once this share of the last target_window episodes had a positive return (sparse-"
              "reward tasks: minigrid, the multi-rate env); null disables it. Either target stops the run.",
        min=0.0, max=1.0)
    target_window: int = setting(100, "Episodes in the moving mean compared with target_return.", unit="episodes",
                                 min=1, max=100000)
    require_target: bool = setting(
        False, "Exit with code 1 if the run ends without reaching target_return (for make train and benches).")
    time_budget_s: Optional[float] = setting(None, "Wall-clock budget for training; null disables it.", unit="s",
                                             min=0.0, min_exclusive=True)
    loggers: list = setting(["jsonl", "tensorboard"], "Metric sinks, each with the same metric names: jsonl "
                            "(metrics.jsonl, which the report and --resume read), tensorboard, wandb, mlflow (the "
                            "last two are optional extras).", choices=("jsonl", "tensorboard", "wandb", "mlflow"))
    wandb_project: Optional[str] = setting(None, "W&B project (run.loggers: wandb); null = ascent-rl.")
    mlflow_experiment: Optional[str] = setting(None, "MLflow experiment (run.loggers: mlflow); null = ascent-rl.")
    output_dir: str = setting("runs", "Parent directory for run outputs (metrics.jsonl, checkpoints); relative or "
                                      "absolute, without `..` components.")
    run_name: Optional[str] = setting(None, "Run directory name under output_dir, one plain path component (no `/`, "
                                            "not `.` or `..`); null picks <env>-<timestamp>.")
    checkpoint_interval_s: Optional[float] = setting(
        300.0, "Seconds between periodic checkpoints (checkpoints/ckpt-<iteration>.pt); null writes only the final "
               "one (checkpoints/final.pt).", unit="s", min=0.0, min_exclusive=True)
    keep_checkpoints: int = setting(3, "Periodic checkpoints kept (the newest); the final one is always kept.",
                                    min=1, max=10000)
    max_learner_restarts: int = setting(3, "Learner-group restarts in a row, with no update completed between them, "
                                           "before the run gives up (a group that trains between deaths is restarted "
                                           "as often as it dies).", min=0, max=1000)
    max_nonfinite_updates: int = setting(
        3, "Updates in a row whose loss, gradient or resulting weights are NaN or inf before the run stops (exit 3, "
           "one line naming the metric, the iteration and the last finite checkpoint). Each such update is not "
           "applied (every learner keeps its weights and optimizer state from before it) and is counted in "
           "updates_skipped_nonfinite; a finite update between them starts the count again. No checkpoint with a "
           "non-finite value is ever written.", min=1, max=1000)
    progress_interval_s: float = setting(1.0, "Seconds between progress lines.", unit="s", min=0.0,
                                         min_exclusive=True)
    board_memory_limit_mb: Optional[int] = setting(
        1024, "Resident memory the supply board's process may reach; past it the driver replaces the board (as a "
              "dead one is: the tickets in flight are made again) and the run goes on. A backstop: the board's memory "
              "levels off (docs/status.md), and this bounds what a regression or another Ray version would add over "
              "days. Not applied in process (one process has one RSS), nor when a fresh board is "
              "already over it (then one warning a run). null: no limit.", unit="MiB", min=1)
    stall_timeout_s: float = setting(
        120.0, "A learner that gets no batch for this long stops the run (exit 5, final checkpoint) with one line: "
               "the update it waits for and where its fragments are. Also the deadline of every other wait on the "
               "data path (rollout adds, weight fetches).", unit="s", min=0.0, min_exclusive=True)
    startup_timeout_s: float = setting(
        180.0, "Deadline for the actor graph to come up (Ray placing each actor and its process importing torch), "
               "for a replacement actor to start and for a restarted learner group: past it, one line names what "
               "did not start and what Ray has free. Apart from stall_timeout_s because a loaded host's start-up "
               "can take far longer than a healthy run's longest wait for data.", unit="s", min=0.0,
        min_exclusive=True)
    shutdown_grace_s: float = setting(
        20.0, "After SIGTERM (a scheduler's stop, ray job stop) the run stops as on Ctrl-C: final checkpoint, report, "
              "shutdown; past this many seconds it exits at once (exit 143 either way). A second SIGTERM or Ctrl-C "
              "exits at once.", unit="s", min=0.0, min_exclusive=True)


@dataclass
class EvalConfig:
    interval_iterations: Optional[int] = setting(
        None, "Evaluate the newest policy every this many iterations, in an actor of its own on a CPU host (the "
              "learners never wait for it); its eval_* metrics join the records and checkpoints/best.pt keeps the "
              "best evaluated policy. null = no periodic evaluation.", unit="iterations", min=1)
    episodes: int = setting(10, "Episodes per evaluation (the same reset seeds every time).", min=1, max=100000)
    deterministic: bool = setting(True, "Act with the policy's mode (argmax, or the Gaussian's mean).")


@dataclass
class PolicyConfig:
    """One policy of ``multiagent.policies``: its own model size and learning rate, or frozen."""

    hidden_sizes: Optional[tuple] = setting(None, "This policy's hidden layer widths; null = learner.hidden_sizes.",
                                            max=65536)
    lr: Optional[float] = setting(None, "This policy's Adam learning rate (annealed like learner.lr); null = "
                                        "learner.lr.", min=0.0, min_exclusive=True, max=1.0)
    frozen: bool = setting(False, "Acts in the rollouts but never trains (no optimizer group): a fixed player at "
                                  "its initial weights, e.g. a baseline for the others.")


@dataclass
class MultiAgentConfig:
    """PettingZoo envs (the ``multiagent`` extra): ``actors/multiagent.py`` says how their agents fill env slots."""

    api: str = setting("auto", "PettingZoo API: parallel (every agent acts every step; each agent is an env slot "
                               "and all of them learn), aec (turn-based; one learning seat per game, the other "
                               "seats played by multiagent.opponent), auto = parallel where the env has it.",
                       choices=("auto", "parallel", "aec"))
    agent_index: bool = setting(False, "Parallel games: append the agent's one-hot index to its (flat Box) "
                                       "observation, so the shared policy can tell the agents apart.")
    opponent: str = setting("latest", "Turn-based games: who plays the other seats: latest (the current policy), "
                                      "random (uniform over legal actions), heuristic (a one-step lookahead: wins "
                                      "when it can, blocks when it must; Connect Four). Ignored under self_play.",
                            choices=("latest", "random", "heuristic"))
    self_play: bool = setting(False, "Turn-based games: the other seats are played by frozen snapshots of the "
                                     "learning policy, from a pool of the last multiagent.pool_size, one drawn per "
                                     "episode.")
    snapshot_every: int = setting(10, "Self-play: a snapshot every this many policy versions.", unit="updates",
                                  min=1)
    pool_size: int = setting(8, "Self-play: snapshots kept (the oldest goes first).", min=1, max=1000)
    opponent_sampling: str = setting(
        "uniform", "Self-play: how an episode's snapshot is drawn: uniform, or prioritized (weighted toward the "
                   "snapshots the learning seat wins least against).", choices=("uniform", "prioritized"))
    random_opponent_share: float = setting(
        0.0, "Self-play: the share of episodes whose other seats play uniformly at random (legal moves) instead of a "
             "snapshot, so the policy also meets the positions its past selves never make.", min=0.0, max=1.0)
    policies: Dict[str, PolicyConfig] = setting(
        {}, "Parallel games: several policies by name, `multiagent.policies.<name>.<field>` (fields in the table "
            "below); empty = one policy shared by every agent. Each trained policy gets its own rows of every batch, "
            "its own update, optimizer, metrics (policy/<name>/...) and checkpoint entry; multiagent.mapping says "
            "which agents each one plays.")
    mapping: dict = setting(
        {}, "With multiagent.policies: agent id pattern (fnmatch: `adversary_*`, `agent_0`) -> policy name; an "
            "agent takes the first pattern that matches it, and every agent must match one.")
    eval_opponents: list = setting(
        ["random"], "Turn-based games: the players periodic evaluation scores the policy against (eval_win_rate/"
                    "<player>, eval_draw_rate/..., eval_loss_rate/...): random, heuristic.",
        choices=("random", "heuristic"))

    def env_args(self) -> dict:
        """The settings that shape an env (``actors.envs.make_env``'s ``multiagent``), as plain data."""
        return {"api": self.api, "opponent": self.opponent, "agent_index": self.agent_index,
                "self_play": self.self_play, "policies": list(self.policies), "mapping": dict(self.mapping)}

    def policy_entries(self) -> tuple:
        """``learner.spec.PolicyEntry`` fields of each policy, in ``policies`` order (plain data for the spec)."""
        return tuple({"name": name, "hidden_sizes": p.hidden_sizes, "lr": p.lr, "frozen": p.frozen}
                     for name, p in self.policies.items())


@dataclass
class RayConfig:
    address: Optional[str] = setting(
        None, "Ray cluster to join: auto, host:port or ray://host:port (a run that joins a cluster prints which); "
              "null starts an embedded local Ray unless RAY_ADDRESS is set; "
              "'inprocess' runs the whole job in this process without Ray (one learner; fastest start, for "
              "laptops, debuggers and tests).")
    num_cpus: Optional[int] = setting(
        None, "Logical CPUs for the embedded Ray; null = max(machine cores, what the config reserves).", unit="CPUs",
        min=1)
    include_dashboard: bool = setting(False, "Start the dashboard (embedded Ray only; it binds to 127.0.0.1).")
    listen_address: str = setting(
        "127.0.0.1", "Where the embedded Ray listens. 127.0.0.1: every port it opens (GCS, raylet, object manager, "
                     "workers, agents) on loopback only, reachable from this machine alone. To let other hosts join "
                     "(docs/cluster.md): 0.0.0.0, Ray's own default (its ports on all interfaces, this node known by "
                     "the address Ray picks), or this host's IPv4 address (all interfaces too, known by that "
                     "address: Ray 2.60 binds loopback or every interface, nothing between). Joining a cluster "
                     "(ray.address, --address) ignores it.")
    allow_unauthenticated: bool = setting(
        False, "Let the embedded Ray start without token authentication (RAY_AUTH_MODE set to anything but token in "
               "the environment), with a warning on every start. false refuses that start in one line: without a "
               "token anyone who reaches the cluster's ports can run code on this machine.")


@dataclass
class Config:
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    multiagent: MultiAgentConfig = field(default_factory=MultiAgentConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def env_args(self) -> dict:
        """How to make one env, as plain data (it travels to the actors): ``actors.envs.make_env``'s arguments."""
        return {**self.env.make_args(), "multiagent": self.multiagent.env_args()}

    # Derived values, computed once.
    @property
    def fragment_samples(self) -> int:
        return self.rollout.fragment_length * self.rollout.envs_per_actor

    @property
    def local_batch_size(self) -> int:
        return self.learner.batch_size // self.learner.num_learners

    @property
    def fragments_per_learner(self) -> int:
        return self.local_batch_size // self.fragment_samples

    @property
    def fragments_per_update(self) -> int:
        """Fragments one PPO update takes over all learners: the supply board's tickets per update."""
        return self.learner.batch_size // self.fragment_samples

    @property
    def autoscale_rollouts(self) -> bool:
        """rollout.num_actors: auto (cluster/autoscale.py)."""
        return self.rollout.num_actors == "auto"

    @property
    def rollout_actors_at_start(self) -> int:
        """The rollout actors a run starts with (and placement plans for): rollout.min_actors under auto."""
        return self.rollout.min_actors if self.autoscale_rollouts else self.rollout.num_actors

    @property
    def replay_bound(self) -> int:
        """Most fragments in flight at once over all shards: tickets of max_policy_lag + 1 updates."""
        return (self.replay.max_policy_lag + 1) * self.fragments_per_update

    @property
    def replay_capacity(self) -> int:
        cap = self.replay.capacity_fragments
        return self.replay_bound if cap == "auto" else cap

    @property
    def seq_len(self) -> int:
        """learner.rnn_seq_len resolved: the BPTT chunk of a recurrent model."""
        return self.learner.rnn_seq_len or self.rollout.fragment_length

    @property
    def local_minibatch_size(self) -> int:
        return self.learner.minibatch_size // self.learner.num_learners

    @property
    def total_updates(self) -> int:
        return max(1, self.run.total_env_steps // self.learner.batch_size)

    def to_dict(self) -> dict:
        """Plain data (tuples as lists): what YAML, JSON and weights_only checkpoints can hold."""
        return plain_data(dataclasses.asdict(self))


def plain_data(obj):
    """Tuples -> lists, recursively."""
    if isinstance(obj, dict):
        return {k: plain_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain_data(v) for v in obj]
    return obj


# --------------------------------------------------------------------------- loading


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    # Resolving the annotations costs ~15 ms a section and never changes: once per class, not per load.
    return typing.get_type_hints(cls)


def _type_of(cls, name):
    return _hints(cls)[name]


def _unknown_key(path: str, key: str, known) -> ConfigError:
    shown = key if re.fullmatch(r"[A-Za-z0-9_]+", key) else repr(key)
    full = f"{path}.{shown}" if path else shown
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f" (did you mean '{(path + '.') if path else ''}{close[0]}'?)" if close else ""
    allowed = ", ".join(sorted(known))
    return ConfigError(f"{full}: unknown key{hint}; allowed keys here: {allowed}")


def _coerce(path: str, value: Any, tp) -> Any:
    """Check ``value`` against the annotated type; ints widen to floats, nothing else converts."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(path, value, args[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: {value!r} is not a boolean; allowed: true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # 5e5 steps is a fine way to write 500000
            return int(value)
        raise ConfigError(f"{path}: {value!r} is not an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{path}: {value!r} is not allowed; allowed: a finite number")
            return float(value)
        raise ConfigError(f"{path}: {value!r} is not a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (dict, list)):  # `address: ::::` or `id: a: b` in a file: YAML read the colons
            raise ConfigError(f"{path}: {value!r} is not a string (YAML read a {type(value).__name__} there); "
                              f"allowed: text, quoted where it holds ': ' or starts with a colon, [ or {{")
        raise ConfigError(f"{path}: {value!r} is not a string")
    if origin is dict:
        _, value_type = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of names to settings, got {type(value).__name__} {value!r}")
        out = {}
        for key, sub in value.items():
            if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9_\-]+", key):
                raise ConfigError(f"{path}: {key!r} is not a valid name; allowed: letters, digits, _ and -")
            out[key] = _build(value_type, sub, f"{path}.{key}")
        return out
    if origin is list:  # a list of sections; a string entry is shorthand for the section's first field
        (item_type,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        first = next(iter(_fields(item_type)))
        return [_build(item_type, {first: v} if isinstance(v, str) else v, f"{path}[{i}]")
                for i, v in enumerate(value)]
    if tp is dict:  # free-form plain data (constructor kwargs): any YAML mapping with string keys
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{path}: expected a mapping of argument names to values, got {value!r}")
        return dict(value)
    if tp is list:
        if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
            return list(value)
        raise ConfigError(f"{path}: {value!r} is not a non-empty list of strings")
    if tp is tuple:
        if isinstance(value, (list, tuple)) and value and all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            return tuple(value)
        raise ConfigError(f"{path}: {value!r} is not a non-empty list of positive integers")
    raise TypeError(f"unsupported annotation {tp} at {path}")


def _build(cls, data: Any, path: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping of keys, got {type(data).__name__} {data!r}")
    fields = _fields(cls)
    for key in data:
        if key not in fields:
            raise _unknown_key(path, str(key), fields)
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        tp = _type_of(cls, name)
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data.get(name), sub)
        elif name in data:
            value = data[name]
            choices = f.metadata.get("choices") or ()
            if isinstance(value, bool) and tp is str and "off" in choices:  # YAML 1.1 reads a bare off / on as a bool
                if value:
                    raise ConfigError(f"{sub}: {value!r} (YAML reads a bare on, yes or true so) is not allowed; "
                                      f"allowed: {', '.join(map(str, choices))}")
                value = "off"
            kwargs[name] = value if (value == "auto" and f.metadata.get("auto")) else _coerce(sub, value, tp)
    return cls(**kwargs)


def _check_ranges(obj, path: str = "") -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        sub = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(value):
            _check_ranges(value, sub)
            continue
        if isinstance(value, dict):  # sections by name (env.modalities); free-form kwargs have nothing to check
            for key, item in value.items():
                if dataclasses.is_dataclass(item):
                    _check_ranges(item, f"{sub}.{key}")
            continue
        if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                _check_ranges(item, f"{sub}[{i}]")
            continue
        m = f.metadata
        if value is None or not m or (value == "auto" and m.get("auto")):
            continue
        if m.get("choices") is not None:
            for item in value if isinstance(value, list) else [value]:  # a list setting: each entry is a choice
                if item not in m["choices"]:
                    raise ConfigError(f"{sub}: {item!r} is not allowed; allowed: {', '.join(map(str, m['choices']))}")
        lo, hi = m.get("min"), upper_bound(type(obj), f.name)
        # A list of numbers (learner.hidden_sizes) is checked entry by entry.
        items = [(f"{sub}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, tuple) else [(sub, value)]
        for where, item in items:
            if not isinstance(item, (int, float)) or isinstance(item, bool):
                continue
            if lo is not None:
                if m.get("min_exclusive") and not item > lo:
                    raise ConfigError(f"{where}: {_shown(item)} is out of range; allowed: > {lo}")
                if not m.get("min_exclusive") and item < lo:
                    raise ConfigError(f"{where}: {_shown(item)} is out of range; allowed: >= {lo}")
            if hi is not None and item > hi.value:
                why = f" ({hi.why})" if hi.why else ""
                raise ConfigError(f"{where}: {_shown(item)} is out of range; allowed: <= {hi.shown}{why}")


def _check_envpool(cfg: Config) -> None:
    """env.backend: envpool takes what EnvPool's own envs are: a task id, its options, Box observations."""
    for key, value, why in (("env.wrappers", cfg.env.wrappers, "gymnasium wrappers wrap one Python env"),
                            ("env.modalities", cfg.env.modalities, "EnvPool's observations are arrays, not Dicts")):
        if value:
            raise ConfigError(f"{key}: set, but env.backend is envpool ({why}); allowed: empty with envpool, or "
                              f"env.backend: gymnasium (EnvPool's options, e.g. stack_num, go in env.kwargs)")
    from actors.envpool_env import check_task  # imports envpool only for an envpool config

    try:
        check_task(cfg.env.id)
    except ValueError as e:
        raise ConfigError(str(e)) from None


#: Most weights the hidden layers a config names may hold (learner.hidden_sizes, learner.rnn_hidden_size, each
#: multiagent policy's hidden_sizes): 2^34, 64 GiB in float32. Every learner holds the whole model (data parallel),
#: with its gradient and Adam's two moments: 16 bytes a weight, 256 GiB, more than any one accelerator's memory (the
#: largest hold 192 GB). Past it the model does not fit and the run would die allocating it, or swap for hours.
MAX_HIDDEN_WEIGHTS = 2**34


def hidden_weights(hidden_sizes, rnn: str | None = None, rnn_hidden_size: int = 0) -> int:
    """Weights between the hidden layers a config names (input and head sizes come from the env, unknown here):
    the lower bound of the model's size, the same for one trunk or for actor and critic MLPs each."""
    hidden = [int(h) for h in hidden_sizes or ()]
    n = sum(a * b for a, b in zip(hidden, hidden[1:]))
    if rnn is not None:
        gates = 4 if rnn == "lstm" else 3
        n += gates * rnn_hidden_size * ((hidden[-1] if hidden else 0) + rnn_hidden_size)
    return n


def _check_model_size(cfg: Config) -> None:
    models = [("learner.hidden_sizes", cfg.learner.hidden_sizes)]
    models += [(f"multiagent.policies.{name}.hidden_sizes", p.hidden_sizes)
               for name, p in cfg.multiagent.policies.items() if p.hidden_sizes is not None]
    for key, hidden in models:
        rnn = cfg.learner.rnn if key == "learner.hidden_sizes" else None
        n = hidden_weights(hidden, rnn, cfg.learner.rnn_hidden_size)
        if n > MAX_HIDDEN_WEIGHTS:
            with_rnn = f" with a {rnn} of learner.rnn_hidden_size {cfg.learner.rnn_hidden_size}" if rnn else ""
            raise ConfigError(f"{key}: {list(hidden)}{with_rnn} makes {n:.3g} weights between the hidden layers alone "
                              f"({n * 4 / 2**30:,.0f} GiB in float32, {n * 16 / 2**30:,.0f} GiB with the gradient and "
                              f"Adam's moments every learner holds); allowed: at most 2^34 = {MAX_HIDDEN_WEIGHTS:.3g} "
                              f"weights (more than any one accelerator's memory holds)")


def validate(cfg: Config) -> Config:
    """Ranges from the schema, then the combinations that cannot work."""
    _check_ranges(cfg)
    _check_model_size(cfg)
    if cfg.ray.address is not None:
        check_address(cfg.ray.address, "ray.address")
    check_listen_address(cfg.ray.listen_address)
    _check_run_paths(cfg)
    if cfg.ray.address == "inprocess" and cfg.learner.num_learners > 1:  # pipeline.runtime.INPROCESS
        raise ConfigError(f"learner.num_learners: {cfg.learner.num_learners} needs one process per learner (one "
                          f"torch process group each), but ray.address: inprocess runs the whole job in one "
                          f"process; allowed: 1, or a Ray address (null starts a local Ray)")
    if "jsonl" not in cfg.run.loggers:
        raise ConfigError(f"run.loggers: {cfg.run.loggers!r} lacks jsonl, which the report, the API and the tests "
                          f"read; allowed: jsonl plus any of tensorboard, wandb, mlflow")
    if cfg.env.backend == "envpool":
        _check_envpool(cfg)
    if cfg.env.isolation == "process":
        if cfg.env.backend != "gymnasium":
            raise ConfigError(f"env.isolation: process runs each env in a child of its own, and env.backend: "
                              f"{cfg.env.backend} steps its envs as one pool in the actor; allowed: env.backend: "
                              f"gymnasium with process, or env.isolation: none")
    for i, wrapper in enumerate(cfg.env.wrappers):
        if not re.fullmatch(r"[\w.]+:[\w.]+", wrapper.path):
            raise ConfigError(f"env.wrappers[{i}].path: {wrapper.path!r} is not module:Callable; allowed: e.g. "
                              f"gymnasium.wrappers:ClipReward")
    L = cfg.learner.num_learners
    bs, mb = cfg.learner.batch_size, cfg.learner.minibatch_size
    frag = cfg.fragment_samples
    minibatch_error = ConfigError(f"learner.minibatch_size: {mb} is not divisible by learner.num_learners ({L}); "
                                  f"allowed: a multiple of {L}")
    if bs == "auto":
        if mb % L:
            raise minibatch_error
        _check_local_minibatch(cfg)
        lo, hi, g = cfg.learner.batch_size_min, cfg.learner.batch_size_max, batch_granule(cfg)
        if lo > hi:
            raise ConfigError(f"learner.batch_size_min: {lo} is larger than learner.batch_size_max ({hi}); "
                              f"allowed: <= {hi}")
        if hi // g * g < lo:
            raise ConfigError(f"learner.batch_size_max: {hi} leaves no batch in [{lo}, {hi}] that is a multiple of "
                              f"{g} (whole fragments per learner and whole minibatches); allowed: a range holding a "
                              f"multiple of {g}")
        _check_other_combinations(cfg)
        return cfg
    if mb > bs:
        raise ConfigError(f"learner.minibatch_size: {mb} is larger than learner.batch_size ({bs}); allowed: <= {bs}")
    if bs % L:
        raise ConfigError(f"learner.batch_size: {bs} is not divisible by learner.num_learners ({L}); "
                          f"allowed: a multiple of {L}")
    if mb % L:
        raise minibatch_error
    _check_local_minibatch(cfg)
    if bs % mb:
        raise ConfigError(f"learner.batch_size: {bs} is not a multiple of learner.minibatch_size ({mb}); "
                          f"allowed: a multiple of {mb}")
    if (bs // L) % frag:
        raise ConfigError(
            f"learner.batch_size: {bs} gives {bs // L} samples per learner, which is not a whole number of fragments "
            f"of rollout.fragment_length x rollout.envs_per_actor = {frag}; allowed: a multiple of {frag * L}")
    if cfg.run.total_env_steps < bs:
        raise ConfigError(f"run.total_env_steps: {cfg.run.total_env_steps} is less than one batch "
                          f"(learner.batch_size = {bs}); allowed: >= {bs}")
    check_replay_capacity(cfg)
    _check_other_combinations(cfg)
    return cfg


#: What ray.address, --address and RAY_ADDRESS may hold besides auto and inprocess: a GCS address host:port, or a
#: Ray Client address ray://host:port; the host a name, an IPv4 address or a bracketed IPv6 one.
_ADDRESS = re.compile(r"(?:ray://)?(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?|\[[0-9A-Fa-f:.]+\]):(\d{1,5})")
ADDRESS_ALLOWED = "auto, inprocess, host:port or ray://host:port (null: an embedded local Ray)"


def check_address(address: str, key: str) -> None:
    """A Ray address from ``key`` (ray.address, --address or RAY_ADDRESS) that Ray can join, or a ConfigError:
    Ray itself takes nearly any text and fails later, far from the setting."""
    if address in ("auto", "inprocess"):
        return
    match = _ADDRESS.fullmatch(address)
    if match is None or not 0 < int(match.group(1)) < 65536:
        raise ConfigError(f"{key}: {address!r} is not a Ray address; allowed: {ADDRESS_ALLOWED}")


#: ray.listen_address: loopback only (the default), or open to other hosts.
LOOPBACK = "127.0.0.1"
LISTEN_ALLOWED = "127.0.0.1 (loopback only), 0.0.0.0 (all interfaces) or this host's IPv4 address"


def check_listen_address(value: str) -> None:
    """ray.listen_address is 127.0.0.1, 0.0.0.0 or one host's IPv4 address, or a ConfigError. Another loopback
    address (127.0.0.2) is refused: Ray keeps its ports on loopback for 127.0.0.1 alone, and would open every
    interface for the others."""
    import ipaddress

    try:
        ip = ipaddress.IPv4Address(value)
    except ValueError:
        raise ConfigError(f"ray.listen_address: {value!r} is not an IPv4 address; allowed: {LISTEN_ALLOWED}") from None
    if ip.is_loopback and value != LOOPBACK:
        raise ConfigError(f"ray.listen_address: {value!r} is a loopback address other than 127.0.0.1, on which Ray "
                          f"2.60 would listen on every interface; allowed: {LISTEN_ALLOWED}")
    if ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise ConfigError(f"ray.listen_address: {value!r} is not one host's address; allowed: {LISTEN_ALLOWED}")


def _check_run_paths(cfg: Config) -> None:
    """The run directory stays where run.output_dir says: run.run_name is one directory in it, and no `..` climbs
    out of either (a shared or copied config must not write checkpoints somewhere else)."""
    name, out = cfg.run.run_name, cfg.run.output_dir
    # Empty is null's spelling in a file (`run_name: ""`): the default name.
    if name and (name in (".", "..") or re.search(r"[/\\\x00-\x1f]", name)):
        raise ConfigError(f"run.run_name: {name!r} is not a plain directory name; allowed: one path component, "
                          f"without / or \\ or control characters, not . or .. (the directory goes under "
                          f"run.output_dir)")
    if ".." in re.split(r"[/\\]", out) or re.search(r"[\x00-\x1f]", out):
        raise ConfigError(f"run.output_dir: {out!r} is not allowed; allowed: a relative or absolute path without .. "
                          f"components or control characters")


def check_replay_capacity(cfg: Config) -> None:
    """A shard ceiling below the ticket bound could block the very update that would drain it."""
    cap = cfg.replay.capacity_fragments
    if cap != "auto" and cap < cfg.replay_bound:
        raise ConfigError(
            f"replay.capacity_fragments: {cap} is less than the {cfg.replay_bound} fragments that may be in flight "
            f"((replay.max_policy_lag + 1) x {cfg.fragments_per_update} fragments per update), so a full shard could "
            f"block the update that would drain it; allowed: >= {cfg.replay_bound}, or auto")


def _check_local_minibatch(cfg: Config) -> None:
    """Per-minibatch advantage normalisation takes a std over each learner's local minibatch: it needs 2 samples."""
    L, mb = cfg.learner.num_learners, cfg.learner.minibatch_size
    if cfg.ppo.norm_adv and mb // L < 2:
        raise ConfigError(f"learner.minibatch_size: {mb} gives {mb // L} sample per learner per gradient step "
                          f"({L} learner{'s' if L != 1 else ''}), and per-minibatch advantage normalisation "
                          f"(ppo.norm_adv: true) needs at least 2; allowed: >= {2 * L} (2 per learner), "
                          f"or ppo.norm_adv: false")


def batch_granule(cfg: Config) -> int:
    """Batch sizes must be multiples of this: whole fragments per learner and whole minibatches."""
    return math.lcm(cfg.fragment_samples * cfg.learner.num_learners, cfg.learner.minibatch_size)


def _check_other_combinations(cfg: Config) -> None:
    if cfg.learner.rnn is not None:
        T, L, local_mb = cfg.rollout.fragment_length, cfg.seq_len, cfg.local_minibatch_size
        if T % L:
            raise ConfigError(f"learner.rnn_seq_len: {L} does not divide rollout.fragment_length ({T}); allowed: a "
                              f"divisor of {T} (training sequences are whole chunks of a fragment)")
        if local_mb % L:
            raise ConfigError(f"learner.rnn_seq_len: {L} does not divide the per-learner minibatch "
                              f"(learner.minibatch_size / learner.num_learners = {local_mb}); allowed: a divisor "
                              f"of {local_mb}, or a minibatch that is a multiple of {L} (minibatches are whole "
                              f"sequences)")
    actors_key = "rollout.min_actors" if cfg.autoscale_rollouts else "rollout.num_actors"
    if cfg.replay.num_shards > cfg.rollout_actors_at_start:
        raise ConfigError(f"replay.num_shards: {cfg.replay.num_shards} is more than {actors_key} "
                          f"({cfg.rollout_actors_at_start}), so some shard would never be fed; allowed: <= "
                          f"{cfg.rollout_actors_at_start}")
    if cfg.autoscale_rollouts and cfg.rollout.min_actors > cfg.rollout.max_actors:
        raise ConfigError(f"rollout.min_actors: {cfg.rollout.min_actors} is more than rollout.max_actors "
                          f"({cfg.rollout.max_actors}); allowed: <= {cfg.rollout.max_actors}")
    for key, m in cfg.env.modalities.items():
        for name, problem in conflicts(m):  # the rules spanning fields live with the fields, in the contract
            raise ConfigError(f"env.modalities.{key}.{name}: {problem}")
    pre = cfg.preprocess
    if pre.max_slow_workers is not None and pre.workers and pre.max_slow_workers > pre.workers:
        raise ConfigError(f"preprocess.max_slow_workers: {pre.max_slow_workers} is more than preprocess.workers "
                          f"({pre.workers}); allowed: <= {pre.workers}")
    if cfg.multiagent.self_play and cfg.multiagent.opponent != "latest":
        raise ConfigError(f"multiagent.opponent: {cfg.multiagent.opponent!r} with multiagent.self_play: true, where "
                          f"the pool of past selves plays the other seats; allowed: latest (the default), or "
                          f"self_play: false")
    _check_policies(cfg)
    _check_inference(cfg)
    if cfg.run.require_target and cfg.run.target_return is None and cfg.run.target_success_rate is None:
        raise ConfigError("run.require_target: true needs run.target_return or run.target_success_rate to be set; "
                          "allowed: a number")


def _check_inference(cfg: Config) -> None:
    """rollout.inference: remote serves the heads of one memoryless policy (actors/inference.py)."""
    if cfg.rollout.inference != "remote":
        return
    for key, value, why in (("learner.rnn", cfg.learner.rnn, "a recurrent policy's state"),
                            ("multiagent.policies", dict(cfg.multiagent.policies) or None, "several policies")):
        if value is not None:
            shown = value if isinstance(value, str) else ", ".join(value)
            raise ConfigError(f"rollout.inference: remote, and {key} is {shown!r} ({why}: the inference server "
                              f"serves one memoryless policy); allowed: rollout.inference: local with {key}")


def _check_policies(cfg: Config) -> None:
    """multiagent.policies and multiagent.mapping, as far as they can be checked without the env's agents."""
    ma = cfg.multiagent
    names = list(ma.policies)
    if not names:
        if ma.mapping:
            raise ConfigError(f"multiagent.mapping: {ma.mapping!r} is set, but multiagent.policies is empty; allowed: "
                              f"name the policies it maps to under multiagent.policies, or leave mapping empty")
        return
    if not ma.mapping:
        raise ConfigError(f"multiagent.mapping: empty, but multiagent.policies names {', '.join(names)}; allowed: "
                          f"agent id patterns mapped to those names, e.g. {{'adversary_*': {names[0]}}}")
    for pattern, name in ma.mapping.items():
        if not isinstance(name, str) or name not in ma.policies:
            raise ConfigError(f"multiagent.mapping.{pattern}: {name!r} is not a policy of multiagent.policies; "
                              f"allowed: {', '.join(names)}")
    if all(p.frozen for p in ma.policies.values()):
        raise ConfigError("multiagent.policies: every policy is frozen, so nothing would train; allowed: at least "
                          "one with frozen: false")
    for key, value, allowed in (("multiagent.self_play", ma.self_play, "false"),
                                ("learner.rnn", cfg.learner.rnn, "null")):
        if value:
            raise ConfigError(f"{key}: {value!r} with multiagent.policies (several policies are built for parallel "
                              f"games of memoryless policies so far); allowed: {allowed}")


def check_agents(cfg: Config, agents: dict | None) -> None:
    """The settings that depend on a PettingZoo env's agents (``actors.multiagent.describe_agents``)."""
    if agents is None:
        return
    ma, slots = cfg.multiagent, agents["slots_per_game"]
    if ma.policies and agents["api"] != "parallel":
        raise ConfigError(f"multiagent.policies: set, and {cfg.env.id!r} runs turn-based (one learning seat, the "
                          f"others played by multiagent.opponent); allowed: a parallel game (multiagent.api: "
                          f"parallel), or no policies")
    if cfg.rollout.envs_per_actor % slots:
        raise ConfigError(f"rollout.envs_per_actor: {cfg.rollout.envs_per_actor} is not a whole number of "
                          f"{cfg.env.id!r} games of {slots} agents (one env slot per agent); allowed: a multiple of "
                          f"{slots}")
    if agents["api"] != "aec":
        return
    wanted = [p for p in [ma.opponent, *ma.eval_opponents] if p == "heuristic"]
    if wanted and not agents.get("heuristic"):
        key = "multiagent.opponent" if ma.opponent == "heuristic" else "multiagent.eval_opponents"
        raise ConfigError(f"{key}: 'heuristic', and there is no heuristic player for {cfg.env.id!r}; allowed: "
                          f"random (or latest as multiagent.opponent)")
    if cfg.learner.rnn is not None and (ma.self_play or ma.opponent == "latest"):
        raise ConfigError(f"learner.rnn: {cfg.learner.rnn!r}, and the other seats of {cfg.env.id!r} are played by "
                          f"the policy (multiagent.opponent: latest or self_play), whose moves carry no recurrent "
                          f"state yet; allowed: null, or multiagent.opponent: random/heuristic")


# --------------------------------------------------------------------------- defaults by env class

#: The learning settings a config leaves unset take these under env.defaults: continuous (auto: a Box action
#: space). They are CleanRL's continuous-action PPO (ppo_continuous_action.py): many small gradient steps per batch
#: and no entropy bonus, strictly on-policy. The schema's own values are tuned for discrete envs (Acrobot,
#: CartPole), on which they learn in a quarter of the gradient steps; on Pendulum they stay far from solved at 500k
#: env steps, and these solve it (docs/results.md, "defaults for a new env").
CONTINUOUS_DEFAULTS: dict[str, Any] = {
    "replay.max_policy_lag": 0,
    "ppo.ent_coef": 0.0,
    "ppo.update_epochs": 10,
    "learner.minibatch_size": 64,
    "learner.lr": 3e-4,
}


def keys_set_in(data: Any) -> frozenset[str]:
    """The settings plain config data names (``section.key``): what a config file and its overrides set, against
    the schema's defaults."""
    if not isinstance(data, dict):
        return frozenset()
    return frozenset(f"{section}.{key}" for section, keys in data.items() if isinstance(keys, dict) for key in keys)


def class_defaults_for(cfg: Config, action_kind: str) -> dict[str, Any]:
    """The env-class defaults ``cfg`` takes for an env whose actions are ``action_kind`` (``actors.envs``'
    description: discrete, continuous, ...): {key: value} for the keys it leaves unset; empty for a config not made
    from plain data (``from_dict``/``load``), whose every value is decided."""
    kind = action_kind if cfg.env.defaults == "auto" else cfg.env.defaults
    set_keys = getattr(cfg, "keys_set", None)
    if kind != "continuous" or set_keys is None:
        return {}
    return {key: value for key, value in CONTINUOUS_DEFAULTS.items() if key not in set_keys}


def class_defaults_pending(cfg: Config) -> bool:
    """Whether ``cfg`` may still take env-class defaults (``with_class_defaults`` has not run on it, and a key they
    set is unset): only then is the env's action space needed."""
    return getattr(cfg, "class_defaults", None) is None and bool(class_defaults_for(cfg, "continuous"))


def with_class_defaults(cfg: Config, action_kind: str) -> Config:
    """``cfg`` with its env class's defaults (``class_defaults_for``) in the settings it leaves unset, validated;
    the new config's ``class_defaults`` says what they set ({} for none). A combination they make impossible (a
    recurrent model's 128-step sequences in a minibatch of 64) is a ConfigError that names the key, the value and where it came from."""
    applied = class_defaults_for(cfg, action_kind) if getattr(cfg, "class_defaults", None) is None else {}
    if not applied:
        cfg.class_defaults = getattr(cfg, "class_defaults", None) or {}
        return cfg
    data = cfg.to_dict()
    for key, value in applied.items():
        apply_override(data, key.split("."), value)
    try:
        new = from_dict(data)
    except ConfigError as e:
        picked = ", ".join(f"{k}={v}" for k, v in applied.items())
        raise ConfigError(f"{e} (env.defaults: {cfg.env.defaults} gave this env's {action_kind} actions the "
                          f"continuous defaults {picked}; set the key in the config, or env.defaults: discrete)"
                          ) from None
    new.keys_set = cfg.keys_set  # what the user set, not the resolved config's every key
    new.class_defaults = applied
    return new


def setting_type(key: str):
    """The type of the setting at ``key`` (``learner.lr`` -> float), ``Optional`` taken off; an unknown key is the
    ConfigError a config file naming it would get."""
    cls, path = Config, ""
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = _fields(cls)
        if part not in fields:
            raise _unknown_key(path, part, fields)
        tp = _type_of(cls, part)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) is typing.Union and len(args) == 1:
            tp = args[0]
        path = f"{path}.{part}" if path else part
        if i == len(parts) - 1:
            return tp
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"{path}: is a value, not a section; there is no {key}")
        cls = tp


def parse_override(text: str) -> tuple[list[str], Any]:
    """``learner.lr=1e-3`` -> (["learner", "lr"], 0.001). Values are YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY.PATH=VALUE, e.g. learner.lr=1e-3")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {text!r}: empty key; expected KEY.PATH=VALUE, e.g. learner.lr=1e-3")
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"--set {key.strip()}: a value of {len(raw):,} characters; allowed: at most "
                          f"{MAX_YAML_BYTES:,}")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except _TooLarge as e:
        raise ConfigError(f"--set {key.strip()}: {e.problem}") from None
    except yaml.YAMLError:
        value = raw
    if isinstance(value, (dict, list)) and not raw.lstrip().startswith(("{", "[")) and _is_text_setting(parts):
        # A text setting takes the text as typed: `ray.address=::::` is an address to check, not the YAML mapping
        # {':::': None} that a colon makes of it. Brackets still write a collection.
        value = raw.strip()
    return parts, value


def _is_text_setting(parts: list[str]) -> bool:
    try:
        return setting_type(".".join(parts)) is str
    except ConfigError:  # not a schema key (env.kwargs.<name>, a typo): the value stays as YAML read it
        return False


def apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])}: is a value, not a section; cannot set {'.'.join(path)}")
        node = nxt
    node[path[-1]] = value


def _load_yaml_text(text: str, source: str, empty_is_none: bool = False) -> dict | None:
    """The mapping ``text`` holds; where it holds nothing, {} (None with ``empty_is_none``)."""
    try:
        data = _yaml_load(text)
    except _DuplicateKey as e:
        raise ConfigError(f"{source}: {e}") from None
    except _TooLarge as e:
        where = f" line {e.problem_mark.line + 1}:" if e.problem_mark is not None else ""
        raise ConfigError(f"{source}:{where} {e.problem}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{source}:{where} is not valid YAML ({problem})") from None
    if data is None:
        return None if empty_is_none else {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def from_dict(data: dict) -> Config:
    """A validated Config from plain data; it remembers which settings the data named (``keys_set``), so that
    env-class defaults (``with_class_defaults``) fill only the others."""
    cfg = validate(_build(Config, data, ""))
    cfg.keys_set = keys_set_in(data)
    return cfg


def load(path: Optional[str], overrides: list[str] = ()) -> Config:
    """YAML file (or defaults when ``path`` is None) plus ``--set`` overrides, validated."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: {path!r} does not exist or is not a file")
        size = p.stat().st_size
        if size > MAX_YAML_BYTES:
            raise ConfigError(f"--config: {path!r} is {size:,} bytes; allowed: at most {MAX_YAML_BYTES:,} (a config "
                              f"is settings written by hand)")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"--config: {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        data = _load_yaml_text(text, path, empty_is_none=True)
        if data is None:
            # An empty file (or comments only) would train the defaults, which a config file never means: it was
            # cut short, or is the wrong file. `{}` says "the defaults" on purpose; leaving --config out does too.
            raise ConfigError(f"--config: {path!r} holds no settings (empty, or comments only); allowed: a mapping of "
                              f"sections, {{}} for the defaults, or no --config")
    for text in overrides:
        keys, value = parse_override(text)
        apply_override(data, keys, value)
    return from_dict(data)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the commands: a bad flag is one line, ``PROG: error: MESSAGE (PROG --help lists the flags)``,
    and exit code 2, not the usage block (several lines) and the error under it."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} ({self.prog} --help lists the flags)\n")


# --------------------------------------------------------------------------- docs


def markdown_table() -> str:
    """Every field with its default, unit, range and meaning (pasted into docs/configuration.md)."""
    rows = ["| key | default | unit | allowed | meaning |", "|---|---|---|---|---|"]
    sections = [(s.name, _type_of(Config, s.name)) for s in dataclasses.fields(Config)]
    sections.insert(1, ("env.modalities.<key>", ModalitySpec))
    sections.insert(2, ("env.limits", EnvLimitsConfig))
    sections.insert(sections.index(("multiagent", MultiAgentConfig)) + 1, ("multiagent.policies.<name>", PolicyConfig))
    for section_name, section_cls in sections:
        for f in dataclasses.fields(section_cls):
            if dataclasses.is_dataclass(_type_of(section_cls, f.name)):
                continue  # a section of its own (env.limits), with rows of its own
            m = f.metadata
            allowed = []
            if m.get("choices"):
                allowed.append(" / ".join("null" if c is None else str(c) for c in m["choices"]))
            if m.get("min") is not None:
                allowed.append(f"{'>' if m.get('min_exclusive') else '>='} {m['min']}")
            bound = upper_bound(section_cls, f.name)
            if bound is not None:
                allowed.append(f"<= {bound.shown}")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = list(default) if isinstance(default, tuple) else default
            rows.append(f"| `{section_name}.{f.name}` | `{yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}` "
                        f"| {m.get('unit', '')} | {', '.join(allowed)} | {m['doc']} |")
    return "\n".join(rows)


#: The file holding the configuration reference: the generated table between its config-table markers.
REFERENCE_PATH = "docs/configuration.md"


def update_reference(path: str = REFERENCE_PATH) -> bool:
    """Replace the generated table between the reference's config-table markers. True if it changed."""
    p = Path(path)
    text = p.read_text()
    start = text.index("<!-- config-table:start")
    start = text.index("\n", start) + 1
    end = text.index("<!-- config-table:end -->")
    new = text[:start] + markdown_table() + "\n" + text[end:]
    if new != text:
        p.write_text(new)
    return new != text


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        print(markdown_table())
    elif "--update-reference" in sys.argv or "--update-readme" in sys.argv:
        # --update-reference [PATH] (default docs/configuration.md); --update-readme PATH is the older spelling.
        flag = "--update-reference" if "--update-reference" in sys.argv else "--update-readme"
        rest = sys.argv[sys.argv.index(flag) + 1:]
        default = Path(__file__).resolve().parent.parent / REFERENCE_PATH
        target = rest[0] if rest and not rest[0].startswith("-") else str(default)
        changed = update_reference(target)
        print(f"{target}: config table updated" if changed else f"{target}: config table already current")
