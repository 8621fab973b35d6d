"""Many agents: PettingZoo envs as the rollouts' env slots, with one policy shared by every learning agent.

The data plane stays single-agent: a fragment is still T steps x N env *slots*, each slot one agent's trajectory,
so the ticket accounting, GAE, the replay shards and the learners need nothing new. How an env fills its slots
depends on its API (``multiagent.api``):

* **parallel** (every agent acts every step, e.g. ``mpe2:simple_spread_v3``): ``AgentSlotVectorEnv`` runs
  ``envs_per_actor / K`` games of K agents, agent k of game g in slot ``g * K + k``. Every agent's experience is
  trained on (parameter sharing). An agent that leaves before its game ends gets its terminated/truncated flag at
  its last step; until the game ends (or it comes back) its slot repeats that last observation with reward 0 as
  one-step terminal steps that are not episodes (``dead``), since a fixed-length fragment has no hole to leave.
* **aec** (turn-based, e.g. ``pettingzoo.classic:connect_four_v3``): ``SeatEnv`` is one game from one learning
  seat, a plain ``gymnasium.Env``; the seat alternates per episode (so first and second player are both learned)
  and the other seats are played inside ``step`` by an *opponent*: the current policy (``latest``), frozen
  snapshots of it (``multiagent.self_play``: ``PolicyOpponents``' pool), ``random`` or ``heuristic``. A turn-based
  game has one mover per step, so there is no batch of all seats to train on: the opponent's moves are part of
  the env's dynamics, as in every self-play PPO (the snapshots' moves are off-policy anyway).

PettingZoo is the ``multiagent`` extra; nothing here imports it unless an env id names it.
"""

from __future__ import annotations

import fnmatch
import importlib
import warnings
from types import ModuleType
from typing import Mapping, Sequence

import gymnasium as gym
import numpy as np

#: Top-level packages whose env modules are PettingZoo envs (an id such as ``pettingzoo.classic:connect_four_v3``).
PETTINGZOO_PACKAGES = ("pettingzoo", "mpe2")
INSTALL_HINT = "pip install -e '.[multiagent]'"
APIS = ("auto", "parallel", "aec")
OPPONENTS = ("latest", "random", "heuristic")
#: The multiagent settings and their defaults (cluster.config.MultiAgentConfig mirrors them): a single-agent env
#: with any of them changed is an error.
DEFAULTS = {"api": "auto", "opponent": "latest", "agent_index": False, "self_play": False, "policies": [],
            "mapping": {}}


class MultiAgentError(ValueError):
    """A multi-agent env or setting that cannot work; the message names the key and what is allowed."""


def pettingzoo_module(env_id: str) -> ModuleType | None:
    """The PettingZoo env module ``env_id`` names (``package.sub:env_module``), or None for a gymnasium id.

    A PettingZoo package that is not installed is a MultiAgentError naming the extra; any other ``module:Id`` is a
    PettingZoo env when ``Id`` is a module attribute with an ``env`` or ``parallel_env`` factory (gymnasium ids such
    as ``minigrid:MiniGrid-Fetch-5x5-N2-v0`` are registrations, not attributes)."""
    if ":" not in env_id:
        return None
    module_name, _, name = env_id.partition(":")
    top = module_name.split(".")[0]
    try:
        with warnings.catch_warnings():  # PettingZoo 1.27 warns that env modules will give way to a registry
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(module_name)
    except ImportError as e:
        missing = e.name or ""
        if top in PETTINGZOO_PACKAGES and missing.split(".")[0] in (*PETTINGZOO_PACKAGES, "pygame"):
            if missing == top or missing in ("pettingzoo", "pygame"):  # the package itself, not a typo inside it
                raise MultiAgentError(f"env.id: {env_id!r} is a PettingZoo env, and {missing!r} is not installed; "
                                      f"allowed: install the multiagent extra ({INSTALL_HINT})") from None
        return None  # make_env's gym.make reports it
    target = getattr(module, name, None)
    if target is None and top in PETTINGZOO_PACKAGES:
        try:  # env modules are often not imported by their package (pettingzoo.classic imports them all; mpe2 not)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                target = importlib.import_module(f"{module_name}.{name}")
        except ImportError:
            raise MultiAgentError(f"env.id: {env_id!r}: {module_name} has no env {name!r}") from None
    if target is not None and (callable(getattr(target, "env", None)) or callable(getattr(target, "parallel_env", None))):
        return target
    return None


def resolve_api(env_id: str, module: ModuleType, api: str) -> str:
    """``multiagent.api``: auto takes the parallel API where the module has one (every agent acts every step, so
    all of them are trained on), else the turn-based AEC API."""
    has_parallel = callable(getattr(module, "parallel_env", None))
    if api == "auto":
        return "parallel" if has_parallel else "aec"
    if api == "parallel" and not has_parallel:
        raise MultiAgentError(f"multiagent.api: 'parallel', but {env_id!r} has no parallel_env (a turn-based game); "
                              f"allowed: aec or auto")
    if api == "aec" and not callable(getattr(module, "env", None)):
        raise MultiAgentError(f"multiagent.api: 'aec', but {env_id!r} has no AEC env; allowed: parallel or auto")
    return api


def _check_shared_spaces(env_id: str, agents: Sequence[str], obs_space, act_space) -> None:
    """One policy for every agent needs one observation space and one action space."""
    first = agents[0]
    for agent in agents[1:]:
        for what, space in (("observation", obs_space), ("action", act_space)):
            if space(agent) != space(first):
                raise MultiAgentError(
                    f"env.id: {env_id!r} agents {first!r} and {agent!r} have different {what} spaces "
                    f"({space(first)} and {space(agent)}), and one shared policy needs one; allowed: envs whose "
                    f"agents share their spaces, or a policy per kind of agent (multiagent.policies and "
                    f"multiagent.mapping)")


def map_agents(env_id: str, agents: Sequence[str], policies: Sequence[str], mapping: Mapping) -> list[int]:
    """Each agent's policy index (``policies`` order): the first ``mapping`` pattern (fnmatch) that matches the
    agent's id; an agent that none matches is an error naming it."""
    out = []
    for agent in agents:
        name = next((mapping[p] for p in mapping if fnmatch.fnmatchcase(agent, p)), None)
        if name is None:
            raise MultiAgentError(f"multiagent.mapping: no pattern matches agent {agent!r} of {env_id!r} (patterns: "
                                  f"{', '.join(mapping)}); allowed: a pattern for every agent ({', '.join(agents)})")
        out.append(list(policies).index(name))
    return out


def _check_policy_spaces(env_id: str, agents: Sequence[str], agent_policy: Sequence[int], policies: Sequence[str],
                         obs_space, act_space) -> int:
    """Several policies share one data plane: every agent a flat Box observation (padded to the widest), one action
    space for all, and one observation space within each policy. Returns the widest observation."""
    for agent in agents:
        space = obs_space(agent)
        if not (isinstance(space, gym.spaces.Box) and len(space.shape) == 1):
            raise MultiAgentError(f"multiagent.policies: agent {agent!r} of {env_id!r} observes {space}; allowed: "
                                  f"flat Box observations (several policies pad them to one width)")
        if act_space(agent) != act_space(agents[0]):
            raise MultiAgentError(f"multiagent.policies: agents {agents[0]!r} and {agent!r} of {env_id!r} have "
                                  f"different action spaces ({act_space(agents[0])} and {act_space(agent)}); "
                                  f"allowed: one action space for every agent")
    for p, name in enumerate(policies):
        mine = [a for a, q in zip(agents, agent_policy) if q == p]
        for agent in mine[1:]:
            if obs_space(agent) != obs_space(mine[0]):
                raise MultiAgentError(f"multiagent.mapping: agents {mine[0]!r} and {agent!r} of {env_id!r} map to "
                                      f"policy {name!r} but observe {obs_space(mine[0])} and {obs_space(agent)}, "
                                      f"and one policy needs one observation space; allowed: a policy per kind of "
                                      f"agent")
    return max(obs_space(a).shape[0] for a in agents)


def _with_agent_index(space: gym.Space, num_agents: int, env_id: str) -> gym.Space:
    if not (isinstance(space, gym.spaces.Box) and len(space.shape) == 1):
        raise MultiAgentError(f"multiagent.agent_index: true needs flat Box observations, and {env_id!r} has {space}; "
                              f"allowed: false")
    low = np.concatenate([space.low.astype(np.float32), np.zeros(num_agents, np.float32)])
    high = np.concatenate([space.high.astype(np.float32), np.ones(num_agents, np.float32)])
    return gym.spaces.Box(low, high, dtype=np.float32)


# ---------------------------------------------------------------------------------------------- parallel API
class AgentSlotVectorEnv:
    """``actors.envs.VectorEnv``'s interface over parallel PettingZoo games: agent k of game g is slot g * K + k.

    The same SAME_STEP autoreset: a game whose agents have all ended is reset inside ``step``, and each ended
    agent's final observation is in ``finals``. ``dead[i]``: slot i's last step was a filler step of an agent that
    is not in its game (left early, not yet arrived): reward 0, terminated, not an episode.
    """

    def __init__(self, env_id: str, module: ModuleType, num_envs: int, max_episode_steps: int | None = None,
                 env_kwargs: dict | None = None, agent_index: bool = False, policies: Sequence[str] = (),
                 mapping: Mapping | None = None):
        """``policies`` / ``mapping``: several policies (``multiagent.policies``): every observation is padded with
        zeros to the widest agent's, and ends in the index of the policy that plays its agent (``slot_policy``:
        that index per slot), which ``learner.model.PolicySet`` routes by."""
        probe = module.parallel_env(**(env_kwargs or {}))
        self.agents = list(probe.possible_agents)
        K = self.num_agents = len(self.agents)
        self.policies = list(policies)
        if self.policies:
            self.agent_policy = map_agents(env_id, self.agents, self.policies, mapping or {})
            self.width = _check_policy_spaces(env_id, self.agents, self.agent_policy, self.policies,
                                              probe.observation_space, probe.action_space)
        else:
            self.agent_policy = None
            _check_shared_spaces(env_id, self.agents, probe.observation_space, probe.action_space)
        if num_envs % K:
            probe.close()
            raise MultiAgentError(f"rollout.envs_per_actor: {num_envs} is not a whole number of {env_id!r} games of "
                                  f"{K} agents (one env slot per agent); allowed: a multiple of {K}")
        self.games = [probe] + [module.parallel_env(**(env_kwargs or {})) for _ in range(num_envs // K - 1)]
        self.envs = self.games  # what VectorEnv callers iterate over
        self.num_envs = num_envs
        self.agent_index = agent_index
        space = probe.observation_space(self.agents[0])
        if self.policies:  # zero-padded to the widest agent's observation; the policy index comes last
            space = gym.spaces.Box(-np.inf, np.inf, (self.width,), np.float32)
        self.single_observation_space = _with_agent_index(space, K, env_id) if agent_index else space
        if self.policies:
            index = gym.spaces.Box(0.0, len(self.policies) - 1.0, (1,), np.float32)
            self.single_observation_space = gym.spaces.Box(
                np.concatenate([self.single_observation_space.low, index.low]),
                np.concatenate([self.single_observation_space.high, index.high]), dtype=np.float32)
        self.slot_policy = (np.tile(np.asarray(self.agent_policy, np.int64), num_envs // K) if self.policies
                            else None)
        self.single_action_space = probe.action_space(self.agents[0])
        self.max_episode_steps = max_episode_steps
        self.episode_step = np.zeros(num_envs, dtype=np.int64)
        self.episode = np.zeros(num_envs, dtype=np.int64)
        self.dead = np.zeros(num_envs, dtype=bool)
        self.game_step = np.zeros(len(self.games), dtype=np.int64)
        self._last = [None] * num_envs  # each slot's newest observation (what a dead slot repeats)
        space = self.single_observation_space
        self._stacked = (space.shape, space.dtype) if isinstance(space, gym.spaces.Box) else None
        self._eye = np.eye(K, dtype=np.float32)

    def _view(self, k: int, obs):
        """Agent k's observation as its slot shows it: padded (several policies), its index, its policy's."""
        if not (self.agent_index or self.policies):
            return obs
        parts = [np.asarray(obs, dtype=np.float32)]
        if self.policies and parts[0].shape[0] < self.width:
            parts.append(np.zeros(self.width - parts[0].shape[0], np.float32))
        if self.agent_index:
            parts.append(self._eye[k])
        if self.policies:
            parts.append(np.asarray([self.agent_policy[k]], np.float32))
        return np.concatenate(parts)

    def _filler(self, i: int, k: int):
        if self._last[i] is not None:
            return self._last[i]
        space = self.games[0].observation_space(self.agents[k])
        return self._view(k, np.zeros(space.shape, space.dtype)) if isinstance(space, gym.spaces.Box) else space.sample()

    def _batch(self):
        if self._stacked is None:
            return [None] * self.num_envs
        shape, dtype = self._stacked
        return np.empty((self.num_envs,) + shape, dtype=dtype)

    def _reset_game(self, g: int, observations, seed: int | None = None) -> None:
        obs, _ = self.games[g].reset(seed=seed)
        self.game_step[g] = 0
        for k, agent in enumerate(self.agents):
            i = g * self.num_agents + k
            self.episode_step[i] = 0
            self._last[i] = None  # an agent absent at the start shows zeros, not the last game's observation
            if agent in obs:
                self._last[i] = self._view(k, obs[agent])
            observations[i] = self._filler(i, k)

    def reset(self, seed: int):
        """Game g is seeded ``seed + g``."""
        observations = self._batch()
        self.dead[:] = False
        for g in range(len(self.games)):
            self._reset_game(g, observations, seed + g)
        return observations

    def reset_one(self, i: int):
        raise MultiAgentError("env.modalities.*.on_corrupt: drop_episode abandons one env's episode, and a slot of "
                              "a parallel multi-agent game cannot leave it alone; allowed: on_corrupt: fail")

    def step(self, actions):
        K = self.num_agents
        observations = self._batch()
        rewards = np.zeros(self.num_envs, dtype=np.float32)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        finals: dict[int, object] = {}
        self.dead[:] = False
        for g, game in enumerate(self.games):
            live = [k for k, agent in enumerate(self.agents) if agent in game.agents]
            obs, rew, term, trunc, _ = game.step({self.agents[k]: actions[g * K + k] for k in live})
            self.game_step[g] += 1
            cut = self.max_episode_steps is not None and self.game_step[g] >= self.max_episode_steps
            for k, agent in enumerate(self.agents):
                i = g * K + k
                if k in live:
                    rewards[i] = rew.get(agent, 0.0)
                    terminated[i] = bool(term.get(agent, False))
                    truncated[i] = bool(trunc.get(agent, False)) or (cut and not terminated[i])
                    if agent in obs:
                        self._last[i] = self._view(k, obs[agent])
                    if terminated[i] or truncated[i]:
                        finals[i] = self._last[i]
                        self.episode[i] += 1
                        self.episode_step[i] = 0
                    else:
                        self.episode_step[i] += 1
                else:  # not in the game this step: a filler step that ends right away and is no episode
                    terminated[i] = self.dead[i] = True
                    if agent in obs:  # arrived: its first observation starts its episode
                        self._last[i] = self._view(k, obs[agent])
            if cut or not game.agents:
                self._reset_game(g, observations)
            else:
                for k in range(K):
                    observations[g * K + k] = self._filler(g * K + k, k)
        return observations, rewards, terminated, truncated, finals

    def close(self) -> None:
        for game in self.games:
            game.close()


# ---------------------------------------------------------------------------------------------- turn-based API
class RandomOpponent:
    """Uniform over the legal actions (the observation's ``action_mask`` where it has one)."""

    name = "random"

    def __init__(self, action_space: gym.Space, seed: int | None = None):
        self.action_space = action_space
        self.rng = np.random.default_rng(seed)

    def new_episode(self):
        return None

    def act(self, handle, agent: str, obs):
        mask = obs.get("action_mask") if isinstance(obs, Mapping) else None
        if mask is not None:
            return int(self.rng.choice(np.flatnonzero(mask)))
        return self.action_space.sample()

    def result(self, handle, episode_return: float) -> None:
        pass


def connect_four_move(obs: Mapping, rng: np.random.Generator) -> int:
    """A one-step lookahead player for Connect Four: wins when it can, blocks when it must, else a random legal
    column. ``obs["observation"]`` is PettingZoo's (6, 7, 2): plane 0 the mover's pieces, plane 1 the other's."""
    board = np.asarray(obs["observation"])
    legal = np.flatnonzero(obs["action_mask"])
    for plane in (0, 1):  # a win of its own first, then a block of the other's
        for col in legal:
            empty = np.flatnonzero(board[:, col, 0] + board[:, col, 1] == 0)
            row = int(empty.max())
            pieces = board[:, :, plane].copy()
            pieces[row, col] = 1
            if _four_through(pieces, row, col):
                return int(col)
    return int(rng.choice(legal))


def _four_through(pieces: np.ndarray, row: int, col: int) -> bool:
    rows, cols = pieces.shape
    for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
        run = 1
        for sign in (1, -1):
            r, c = row + sign * dr, col + sign * dc
            while 0 <= r < rows and 0 <= c < cols and pieces[r, c]:
                run += 1
                r, c = r + sign * dr, c + sign * dc
        if run >= 4:
            return True
    return False


#: Env metadata name prefix -> its heuristic player (multiagent.opponent: heuristic).
HEURISTICS = {"connect_four": connect_four_move}


class HeuristicOpponent(RandomOpponent):
    name = "heuristic"

    def __init__(self, action_space, move, seed: int | None = None):
        super().__init__(action_space, seed)
        self.move = move

    def act(self, handle, agent, obs):
        return self.move(obs, self.rng)


def heuristic_for(env_id: str, game) -> object | None:
    name = str(game.metadata.get("name", ""))
    return next((move for prefix, move in HEURISTICS.items() if name.startswith(prefix)), None)


class SeatEnv(gym.Env):
    """One turn-based (AEC) game from one learning seat, as a single-agent gymnasium env.

    ``reset`` and ``step`` play the other seats with ``self.opponent`` until the seat is to move (or its game
    ended); the reward is the seat's own, summed over the other seats' moves in between. The seat alternates per
    episode over the game's agents. ``opponent`` has ``new_episode() -> handle``, ``act(handle, agent, obs)`` and
    ``result(handle, episode_return)``; the sampler installs a policy one (``PolicyOpponents``), ``random`` and
    ``heuristic`` are built in (what evaluation plays against).
    """

    def __init__(self, env_id: str, module: ModuleType, env_kwargs: dict | None = None, opponent: str = "random",
                 max_episode_steps: int | None = None, seed: int | None = None):
        self.game = module.env(**(env_kwargs or {}))
        self.game.reset(seed=seed)
        self.agents = list(self.game.possible_agents)
        _check_shared_spaces(env_id, self.agents, self.game.observation_space, self.game.action_space)
        self.observation_space = self.game.observation_space(self.agents[0])
        self.action_space = self.game.action_space(self.agents[0])
        self.metadata = dict(self.game.metadata)
        self.max_episode_steps = max_episode_steps
        if opponent == "heuristic":
            move = heuristic_for(env_id, self.game)
            if move is None:
                raise MultiAgentError(f"multiagent.opponent: 'heuristic', and there is no heuristic player for "
                                      f"{env_id!r} (there is for: {', '.join(HEURISTICS)}); allowed: latest, random")
            self.opponent = HeuristicOpponent(self.action_space, move, seed)
        else:  # latest: random until the sampler installs the policy (what make_env alone can offer)
            self.opponent = RandomOpponent(self.action_space, seed)
        self.episodes = 0
        self.seat = self.agents[0]
        self._handle = None
        self._return = 0.0
        self._moves = 0

    # Each move of the other seats is a request ``(handle, agent, observation)`` that the generators below yield and
    # get the action for; ``reset`` and ``step`` answer them one by one, ``SeatVectorEnv`` for all its games at once
    # (one policy forward per snapshot in play, not one per move).
    def reset_moves(self, seed: int | None = None):
        super().reset(seed=seed)
        self.game.reset(seed=seed)
        if seed is not None:  # the built-in players' draws are as reproducible as the game's
            self.opponent.rng = np.random.default_rng(seed)
        self.seat = self.agents[self.episodes % len(self.agents)]
        self.episodes += 1
        self._handle = self.opponent.new_episode()
        self._return, self._moves = 0.0, 0
        obs, _, term, trunc, info = yield from self._others()
        if term or trunc:
            raise MultiAgentError(f"env.id: the game ended before seat {self.seat!r} had a move")
        return obs, info

    def step_moves(self, action):
        self.game.step(action)
        self._moves += 1
        obs, reward, term, trunc, info = yield from self._others()
        if self.max_episode_steps is not None and self._moves >= self.max_episode_steps and not term:
            trunc = True
        self._return += reward
        if term or trunc:
            self.opponent.result(self._handle, self._return)
        return obs, reward, term, trunc, info

    def _others(self):
        """Play the other seats until the learning seat is to move or its game is over; -> its ``last()``."""
        game = self.game
        while game.agents and game.agent_selection != self.seat:
            agent = game.agent_selection
            obs, _, term, trunc, _ = game.last()
            game.step(None if term or trunc else (yield self._handle, agent, obs))
        obs, reward, term, trunc, info = game.last()
        return obs, float(reward), bool(term), bool(trunc), {"seat": self.seat}

    def _answer_each(self, moves):
        try:
            request = next(moves)
            while True:
                request = moves.send(self.opponent.act(*request))
        except StopIteration as done:
            return done.value

    def reset(self, *, seed: int | None = None, options=None):
        return self._answer_each(self.reset_moves(seed))

    def step(self, action):
        return self._answer_each(self.step_moves(action))

    def close(self) -> None:
        self.game.close()


def seat_vector_env(base: type, env_id: str, module: ModuleType, num_envs: int, max_episode_steps: int | None,
                    env_kwargs: dict | None, opponent: str):
    """``base`` (``actors.envs.VectorEnv``, which calls this) over ``num_envs`` SeatEnvs whose other seats move
    together (``answer_together``). The class comes from the caller so that this module never imports
    ``actors.envs``: the two import in one direction (tests/test_imports.py)."""

    class SeatVectorEnv(base):
        def __init__(self):
            self.envs = [SeatEnv(env_id, module, env_kwargs, opponent, max_episode_steps) for _ in range(num_envs)]
            self._setup()

        def _step_envs(self, actions) -> list[tuple]:
            done = answer_together(self.envs, {i: e.step_moves(actions[i]) for i, e in enumerate(self.envs)})
            return [done[i][:4] for i in range(len(self.envs))]

        def _reset_envs(self, indices, seed: int | None = None) -> dict:
            done = answer_together(self.envs, {i: self.envs[i].reset_moves(None if seed is None else seed + i)
                                               for i in indices})
            return {i: obs for i, (obs, _) in done.items()}

    return SeatVectorEnv()


def answer_together(envs: Sequence[SeatEnv], moves: dict) -> dict:
    """Run ``moves`` ({env index: a SeatEnv move generator}) to their ends, answering the other seats' moves of all
    of them together where the envs share a batching opponent (``act_batch``), else one by one. -> {index: what
    each generator returned}."""
    results, requests = {}, {}

    def advance(i, action=None, first=False):
        try:
            requests[i] = next(moves[i]) if first else moves[i].send(action)
        except StopIteration as done:
            results[i] = done.value
            requests.pop(i, None)

    for i in list(moves):
        advance(i, first=True)
    while requests:
        batch = dict(requests)
        opponent = envs[next(iter(batch))].opponent
        if hasattr(opponent, "act_batch") and all(envs[i].opponent is opponent for i in batch):
            actions = opponent.act_batch(list(batch.values()))
        else:
            actions = [envs[i].opponent.act(*request) for i, request in batch.items()]
        for i, action in zip(batch, actions):
            advance(i, action)
    return results


def make_multiagent_env(env_id: str, module: ModuleType, api: str, env_kwargs: dict | None,
                        max_episode_steps: int | None, opponent: str) -> gym.Env:
    """One turn-based game as ``actors.envs.make_env`` returns envs (the parallel API is a vector env only)."""
    if api == "parallel":
        raise MultiAgentError(f"env.id: {env_id!r} with multiagent.api: parallel is played as games of agent slots, "
                              f"not as one single-agent env; allowed: multiagent.api: aec for a single-agent view")
    return SeatEnv(env_id, module, env_kwargs, opponent=opponent, max_episode_steps=max_episode_steps)


def describe_agents(env_id: str, module: ModuleType, api: str, env_kwargs: dict | None,
                    policies: Sequence[str] = (), mapping: Mapping | None = None) -> dict:
    """Plain data about the game's agents (``--dry-run`` prints it): api, agents, their spaces, the slots a game
    takes (K for parallel games, 1 for a turn-based game's learning seat), and with ``policies`` each agent's
    policy (``policies``: agent -> name; an unmapped agent is an error)."""
    if api == "parallel":
        env = module.parallel_env(**(env_kwargs or {}))
        env.reset(seed=0)
    else:
        env = module.env(**(env_kwargs or {}))
        env.reset(seed=0)
    try:
        agents = list(env.possible_agents)
        mapped = ({a: policies[p] for a, p in zip(agents, map_agents(env_id, agents, policies, mapping or {}))}
                  if policies and api == "parallel" else None)
        return {"api": api, "agents": agents, "slots_per_game": len(agents) if api == "parallel" else 1,
                "policies": mapped,
                "spaces": {a: (str(env.observation_space(a)), str(env.action_space(a))) for a in agents},
                "heuristic": api == "aec" and heuristic_for(env_id, env) is not None}
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------- policy opponents
class Snapshot:
    """One frozen policy of the self-play pool, with how the learning seat did against it."""

    def __init__(self, version: int, module):
        self.version, self.module = version, module
        self.games = 0
        self.wins = 0.0  # a draw counts half

    @property
    def win_rate(self) -> float:
        return self.wins / self.games if self.games else 0.5


class PolicyOpponents:
    """The opponents a turn-based game's other seats are played by: the current policy (``latest``) or, under
    ``multiagent.self_play``, snapshots of it taken every ``snapshot_every`` policy versions and kept in a pool of
    the last ``pool_size``, one drawn per episode (``uniform``, or ``prioritized``: weighted toward the ones the
    learning seat wins least against, as prioritized fictitious self-play does).

    In a run the pool is learner rank 0's (``learner.actor.LearnerActor._publish``): every snapshot is the
    weights object that version was published as, its list rides with every weights version through the object
    store, and ``sync_pool`` brings an actor's pool to it, so every actor, a replaced one at once, plays the same
    snapshots, and the pool is in the checkpoint (a resumed run keeps it). Without ``sync_pool`` (a sampler on its
    own) the pool is taken here from the weights it loads. Each actor keeps its own win counts for
    ``prioritized`` drawing. ``inputs(raw_obs) -> {modality: tensor batch of one}`` and ``to_env(actions)`` come
    from the sampler, which knows the observation pipeline and the action codec.
    """

    def __init__(self, policy, policy_factory, inputs, to_env, *, self_play: bool, snapshot_every: int = 10,
                 pool_size: int = 8, sampling: str = "uniform", seed: int = 0, random_share: float = 0.0,
                 action_space: gym.Space | None = None):
        """``random_share``: under self-play, the share of episodes whose other seats play uniformly at random
        instead of a snapshot (``multiagent.random_opponent_share``; ``action_space`` samples where an observation
        has no action mask)."""
        import torch

        self.policy, self.factory = policy, policy_factory
        self.random_share = random_share
        self.random = Snapshot(-2, None)  # the handle of an episode against uniform random play
        self.random_player = RandomOpponent(action_space, seed)  # legal moves from the mask, else the space
        self.inputs, self.to_env = inputs, to_env
        self.self_play = self_play
        self.snapshot_every, self.pool_size, self.sampling = snapshot_every, pool_size, sampling
        self.pool: list[Snapshot] = []
        self.central = False  # the pool comes from sync_pool (learner rank 0's) instead of on_weights
        self.latest = Snapshot(-1, policy)
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)

    def on_weights(self, version: int, state: Mapping[str, np.ndarray]) -> None:
        """Called after the sampler loads ``version``: a snapshot when one is due."""
        self.latest.version = version
        if self.central or not self.self_play or (
                self.pool and version < self.pool[-1].version + self.snapshot_every):
            return
        self.pool.append(Snapshot(version, self._module(state)))
        del self.pool[:-self.pool_size]

    def _module(self, state: Mapping[str, np.ndarray]):
        import torch

        module = self.factory()
        module.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
        module.eval()
        return module

    def versions(self) -> set[int]:
        return {s.version for s in self.pool}

    def sync_pool(self, versions: Sequence[int], new_states: Mapping[int, Mapping[str, np.ndarray]]) -> None:
        """The pool becomes learner rank 0's: snapshots of ``versions`` (oldest first), those not held yet made from
        ``new_states``; a snapshot still in it keeps its win counts."""
        self.central = True
        held = {s.version: s for s in self.pool}
        self.pool = [held[v] if v in held else Snapshot(v, self._module(new_states[v])) for v in versions]

    def new_episode(self) -> Snapshot:
        if self.self_play and self.random_share > 0 and self.rng.random() < self.random_share:
            return self.random
        if not self.self_play or not self.pool:
            return self.latest
        if self.sampling == "prioritized":
            weights = np.array([1.0 - s.win_rate for s in self.pool]) + 0.05
            return self.pool[int(self.rng.choice(len(self.pool), p=weights / weights.sum()))]
        return self.pool[int(self.rng.integers(len(self.pool)))]

    def act(self, handle: Snapshot, agent: str, obs):
        return self.act_batch([(handle, agent, obs)])[0]

    def act_batch(self, requests: Sequence[tuple]) -> list:
        """Actions for ``(handle, agent, observation)`` requests: one forward per snapshot among them."""
        import torch

        actions: list = [None] * len(requests)
        by_player: dict[int, list[int]] = {}
        for j, (handle, _, _) in enumerate(requests):
            by_player.setdefault(id(handle), []).append(j)
        for rows in by_player.values():
            if requests[rows[0]][0] is self.random:
                for j in rows:
                    actions[j] = self.random_player.act(None, requests[j][1], requests[j][2])
                continue
            inputs = [self.inputs(requests[j][2]) for j in rows]
            batch = {k: torch.cat([x[k] for x in inputs]) for k in inputs[0]}
            a, _, _ = requests[rows[0]][0].module.act(batch, generator=self.generator)
            for j, action in zip(rows, self.to_env(a.numpy())):
                actions[j] = action
        return actions

    def result(self, handle: Snapshot, episode_return: float) -> None:
        handle.games += 1
        handle.wins += 1.0 if episode_return > 0 else 0.5 if episode_return == 0 else 0.0
