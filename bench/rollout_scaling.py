"""Rollout scaling: CartPole-v1 env steps/s against rollout actors x envs per actor.

Runs the real ``RemoteRolloutActor`` (vector env + CPU policy copy + GAE, one ``board.poll`` for a ticket before
each fragment, one ``shard.add`` in flight) into a real ``ReplayShard``, drained by a driver thread as a learner's
feed does (``board.claim``, then ``take``). Tickets never run out (per_update 10**9, max_policy_lag 0), so
nothing waits on a learner: this is the rollout side's ceiling, the board round trip included ("ticket poll").
Steps/s comes from the actors' ``stats()["env_steps"]``, polled every 50 ms after warm-up, between the first
and last change of the counter in the window (so fragment-size steps do not quantise the rate). CPU% per
process group (from /proc; "other" = processes that are not this bench) shows whether the cores, not the code,
were the limit.

With ``--config`` the env and model are a config's (its env, modalities and preprocessing, its learner.hidden_sizes;
the grid's envs per actor and fragment length are still the bench's). With ``--inference local remote`` every cell is
measured twice, one row of fresh actors per setting, and the table gives env steps/s with remote inference over
local (``rollout.inference``: one ``actors.inference`` server batching every actor's policy heads, on this host's
accelerator if it has one, else its CPU).

    .venv/bin/python bench/rollout_scaling.py [--seconds 3] [--actors 1 2] [--envs 8 32 128] [--fragment-length 64]
        [--config configs/multirate.yaml] [--set key=value ...] [--inference local remote]
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402

from actors.envs import describe_env  # noqa: E402
from actors.inference import RemoteInferenceServer  # noqa: E402
from actors.rollout import RemoteRolloutActor  # noqa: E402
from actors.sampler import SamplerSettings  # noqa: E402
from bench._common import (CpuMeter, actor_pids, cli, local_ray, parser, ray_core_pids, require,  # noqa: E402
                           table, write_out)
from bench._supply import claim_take, supply  # noqa: E402
from learner import device as devices  # noqa: E402
from learner.model import ActorCritic, build_model, spec_from_description, state_dict_numpy  # noqa: E402

ENV_ID = "CartPole-v1"
POLL_S = 0.05
#: Seconds a measuring window may run past --seconds for every actor to report two env-step counts (its rate's two
#: points): several fragments at the slowest rate a loaded 2-core host gives (~1k env steps/s an actor).
WINDOW_EXTENSION_S = 20.0


def drain(board, stop: threading.Event, errors: list) -> None:
    """Driver-side consumer thread: claims every stored fragment from the board and takes it, so the shard stays
    empty and producers never see backpressure."""
    try:
        failed: list = []
        while not stop.is_set():
            # All tickets are for update 0; the fragments (zero-copy views into the object store) are dropped as
            # soon as they arrive.
            _, failed = claim_take(board, 0, 64, 0.1, failed)
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        if not stop.is_set():
            errors.append(e)


def check(stats: list[dict]) -> None:
    for st in stats:
        if st["error"]:
            raise RuntimeError(f"rollout actor {st['actor_id']} failed: {st['error']}")


def measure(actors: list, pids: list[int], support: dict[str, list[int]], drain_errors: list, warmup_s: float,
            seconds: float) -> dict:
    """Env steps/s of ``actors`` (already started) over a window, plus where their time went."""
    # Warm-up: every actor has loaded weights and sent a fragment, then warmup_s more.
    deadline = time.monotonic() + 120
    while True:
        st = ray.get([a.stats.remote() for a in actors])
        check(st)
        if all(s["fragments_sent"] > 0 for s in st):
            break
        if time.monotonic() > deadline:
            raise TimeoutError("rollout actors sent no fragment within 120 s")
        time.sleep(POLL_S)
    time.sleep(warmup_s)

    first: list[tuple[float, int] | None] = [None] * len(actors)  # first change of env_steps in the window
    last: list[tuple[float, int] | None] = [None] * len(actors)
    prev = [s["env_steps"] for s in ray.get([a.stats.remote() for a in actors])]
    st0 = ray.get([a.stats.remote() for a in actors])
    meter = CpuMeter({"actors": pids, **support})
    cpu0 = meter.snap()
    t0 = time.perf_counter()
    # The window is at least ``seconds`` and lasts until every actor's env steps moved twice (a rate needs two
    # points), up to WINDOW_EXTENSION_S more: a short window on a loaded host may otherwise see no fragment at all.
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and (elapsed >= seconds + WINDOW_EXTENSION_S
                                   or all(a is not None and b[0] > a[0] for a, b in zip(first, last))):
            break
        time.sleep(POLL_S)
        st = ray.get([a.stats.remote() for a in actors])
        now = time.perf_counter()
        check(st)
        for i, s in enumerate(st):
            if s["env_steps"] != prev[i]:
                if first[i] is None:
                    first[i] = (now, s["env_steps"])
                last[i] = (now, s["env_steps"])
                prev[i] = s["env_steps"]
    dt = time.perf_counter() - t0
    cpu1 = meter.snap()
    st1 = ray.get([a.stats.remote() for a in actors])
    if drain_errors:
        raise RuntimeError("drain thread failed") from drain_errors[0]

    per_actor = [(b[1] - a[1]) / (b[0] - a[0]) if a is not None and b[0] > a[0]
                 else (s1["env_steps"] - s0["env_steps"]) / dt  # under two fragments in the window: plain delta
                 for a, b, s0, s1 in zip(first, last, st0, st1)]
    cpu = {k: 100.0 * v / dt for k, v in CpuMeter.delta(cpu0, cpu1).items()}
    cpu["other"] = max(cpu["machine"] - sum(v for k, v in cpu.items() if k != "machine"), 0.0)  # not this bench
    return {
        "steps_per_s": sum(per_actor),
        "per_actor": per_actor,
        "sample_frac": sum(b["sample_s"] - a["sample_s"] for a, b in zip(st0, st1)) / dt / len(actors),
        "backpressure_s": sum(b["backpressure_s"] - a["backpressure_s"] for a, b in zip(st0, st1)),
        "rate_limited_s": sum(b["rate_limited_s"] - a["rate_limited_s"] for a, b in zip(st0, st1)),
        "cpu_pct": cpu,
        # Env steps per CPU-second the actor processes actually got: what a core buys, whatever else is running.
        "steps_per_actor_cpu_s": sum(per_actor) / max(cpu["actors"] / 100.0, 1e-9),
    }


def as_json(results: dict, cores: int) -> dict:
    """The cells measured so far: one record per (inference, actors, envs per actor), and env steps/s by envs then
    actors (of the first --inference setting); with both settings, remote over local by envs then actors."""
    cells = [{"inference": mode, "actors": a, "envs_per_actor": n, "env_steps_per_s": r["steps_per_s"],
              "per_actor": r["per_actor"], "sampling_pct_of_wall": round(100 * r["sample_frac"]),
              "cpu_pct": {k: round(v) for k, v in r["cpu_pct"].items() if k != "machine"},
              "machine_cpu_pct": round(r["cpu_pct"]["machine"]), "machine_cpu_pct_max": 100 * cores,
              "env_steps_per_actor_cpu_s": r["steps_per_actor_cpu_s"]} for (mode, a, n), r in results.items()]
    first = next(iter(results))[0] if results else "local"
    by_envs: dict = {}
    for c in cells:
        if c["inference"] == first:
            by_envs.setdefault(str(c["envs_per_actor"]), {})[str(c["actors"])] = c["env_steps_per_s"]
    out = {"cells": cells, "env_steps_per_s": by_envs, "cores": cores}
    ratios: dict = {}
    for (mode, a, n), r in results.items():
        if mode == "remote" and ("local", a, n) in results:
            ratios.setdefault(str(n), {})[str(a)] = r["steps_per_s"] / results[("local", a, n)]["steps_per_s"]
    if ratios:
        out["remote_over_local"] = ratios
    return out


def make_parser():
    p = parser(__doc__, out="write every cell measured so far as JSON here, after each cell", overrides=True)
    p.add_argument("--seconds", type=float, default=3.0, help="measuring window per cell")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds after every actor's first fragment")
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2], help="rollout actor counts")
    p.add_argument("--envs", type=int, nargs="+", default=[8, 32, 128], help="envs per actor")
    p.add_argument("--fragment-length", type=int, default=64, help="T (configs/cartpole.yaml uses 64)")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--config", default=None, help="a run config whose env and model to roll out (default: CartPole-v1 "
                                                  "with a 64x64 MLP)")
    p.add_argument("--inference", nargs="+", default=["local"], choices=["local", "remote"],
                   help="rollout.inference settings to measure, each cell once per setting")
    return p


def rollout_setup(args):
    """(what is rolled out, in words; the model's spec; the policy factory; (seed, envs per actor) -> the sampler's
    settings)."""
    if args.config is None:
        spec = spec_from_description(describe_env(ENV_ID), (64, 64))
        return ENV_ID, spec, functools.partial(ActorCritic, spec), lambda seed, n_envs: SamplerSettings(
            env_id=ENV_ID, num_envs=n_envs, fragment_length=args.fragment_length, gamma=0.99, gae_lambda=0.95,
            seed=seed)
    from cluster import config as config_mod
    from cluster.graph import ActorGraph, describe_env as config_spec

    cfg = config_mod.load(args.config, args.overrides)
    graph = ActorGraph(cfg, None, say=print)  # only its sampler settings and policy factory: no actor is made
    graph.spec = spec = config_spec(cfg)

    def sampler_settings(seed: int, n_envs: int) -> SamplerSettings:
        return dataclasses.replace(graph.sampler_settings(seed), num_envs=n_envs,
                                   fragment_length=args.fragment_length)

    return f"{args.config} ({cfg.env.id})", spec, graph.policy_factory(), sampler_settings


def run(args, on_cell=None) -> tuple[dict, None]:
    """Every cell; after each, the figures so far to --out and to ``on_cell(figures)`` (bench/device_check.py)."""
    require(args.seconds > 0 and args.warmup >= 0 and min(args.actors) >= 1 and min(args.envs) >= 1
            and args.fragment_length >= 1,
            "--seconds must be > 0, --warmup >= 0, and --actors / --envs / --fragment-length >= 1")
    actor_counts, env_counts = sorted(set(args.actors)), sorted(set(args.envs))
    modes = list(dict.fromkeys(args.inference))
    max_a = actor_counts[-1]
    cores = os.cpu_count() or 1
    what, spec, policy_factory, make_settings = rollout_setup(args)

    print(f"rollout scaling on {what}: inference {' then '.join(modes)}, actors {actor_counts} x envs per actor "
          f"{env_counts}, fragment length "
          f"{args.fragment_length}, torch threads {args.torch_threads}, {args.warmup:g} s warm-up + {args.seconds:g} s "
          f"window per cell; 1 replay shard drained by a driver thread (claim + take); supply board per_update "
          f"10**9, max_policy_lag 0 (tickets never run out; one board.poll per fragment).", flush=True)
    print(f"note: this machine has {cores} CPU cores; rollout actors are single-threaded, so more than {cores} "
          f"actors cannot scale (and the drain thread, shard and raylet share the same cores).", flush=True)

    results: dict[tuple[str, int, int], dict] = {}
    with local_ray(max_a + 1):
        weights = state_dict_numpy(build_model(spec))
        for mode, n_envs in [(m, n) for m in modes for n in env_counts]:
            board, (shard,) = supply(1, 8, 10**9, 0, weights=weights)  # fresh per row: its actors are new too
            settings = make_settings(0, n_envs)
            server = None
            if mode == "remote":  # one server for the row's actors, started before they are
                server = RemoteInferenceServer.remote(functools.partial(build_model, spec),
                                                      device_factory=functools.partial(devices.for_inference, "auto"),
                                                      max_versions=1, torch_threads=args.torch_threads)
                print(f"  inference server on {ray.get(server.stats.remote(), timeout=120)['device']}", flush=True)
            # Created together (start-up overlaps), started one more per cell: the cells share warm processes.
            actors = [
                RemoteRolloutActor.options(num_cpus=1).remote(
                    actor_id=i, shard=shard, shard_index=0, board=board, sampler_settings=settings,
                    policy_factory=policy_factory, inference=server, torch_threads=args.torch_threads)
                for i in range(max_a)
            ]
            stop, drain_errors = threading.Event(), []
            drainer = threading.Thread(target=drain, args=(board, stop, drain_errors), name="drain", daemon=True)
            drainer.start()
            try:
                pids = actor_pids(actors)
                support = {"driver": [os.getpid()],  # drain thread + stats polling
                           "shard": actor_pids([shard]), "board": actor_pids([board]), "raylet+gcs": ray_core_pids()}
                if server is not None:
                    support["inference"] = actor_pids([server])
                started = 0
                for n_actors in actor_counts:
                    ray.get([a.start.remote() for a in actors[started:n_actors]])
                    started = n_actors
                    r = measure(actors[:n_actors], pids[:n_actors], support, drain_errors, args.warmup,
                                args.seconds)
                    results[(mode, n_actors, n_envs)] = r
                    write_out(args.out, as_json(results, cores))
                    if on_cell is not None:
                        on_cell(as_json(results, cores))
                    print(f"  {mode:>6}: {n_actors} actor(s) x {n_envs:>4} envs: {r['steps_per_s']:>9,.0f} env steps/s "
                          f"({', '.join(f'{x:,.0f}' for x in r['per_actor'])} per actor) | sampling "
                          f"{100 * r['sample_frac']:.0f}% of wall per actor | add wait "
                          f"{r['backpressure_s']:.2f} s, ticket poll {r['rate_limited_s']:.2f} s", flush=True)
                    print(f"  {'':>24}  cpu: " + ", ".join(f"{k} {v:.0f}%" for k, v in r["cpu_pct"].items()
                                                          if k != "machine")
                          + f" (machine {r['cpu_pct']['machine']:.0f}% of {100 * cores}%) | "
                          f"{r['steps_per_actor_cpu_s']:,.0f} env steps per actor CPU-second", flush=True)
            finally:
                stop.set()
                drainer.join(timeout=5)
                try:
                    ray.get([a.stop.remote() for a in actors], timeout=10)
                except Exception:
                    pass  # killed below either way
                for a in actors + [shard, board] + ([server] if server is not None else []):
                    ray.kill(a)

    mode = modes[0]
    base_key = (mode, actor_counts[0], env_counts[0])
    print(f"\n{mode} inference: env steps/s (ratio to the {base_key[1]}-actor x {base_key[2]}-envs cell); "
          f"{cores} cores: more than {cores} actors cannot scale")

    def grid(key: str) -> None:
        base = results[base_key][key]
        table([("actors \\ envs/actor", "<20")] + [(str(n), ">24") for n in env_counts],
              [[a] + [f"{results[(mode, a, n)][key]:,.0f} ({results[(mode, a, n)][key] / base:.2f}x)"
                      for n in env_counts]
               for a in actor_counts], sep="", rule=True)

    grid("steps_per_s")
    print("\nenv steps per actor CPU-second (a load-independent cost; equal down a column = adding actors "
          "adds no per-step overhead)")
    grid("steps_per_actor_cpu_s")
    if len(modes) > 1:
        print("\nenv steps/s, remote inference over local (same cell, measured in this run)")
        table([("actors \\ envs/actor", "<20")] + [(str(n), ">24") for n in env_counts],
              [[a] + [f"{results[('remote', a, n)]['steps_per_s'] / results[('local', a, n)]['steps_per_s']:.2f}x"
                      for n in env_counts] for a in actor_counts], sep="", rule=True)
    if len(actor_counts) > 1:
        a0, a1 = actor_counts[0], actor_counts[-1]
        print(f"{a1} actors / {a0} actor(s) at the same envs/actor: "
              + ", ".join(f"{n} envs "
                          f"{results[(mode, a1, n)]['steps_per_s'] / results[(mode, a0, n)]['steps_per_s']:.2f}x"
                          for n in env_counts)
              + f" (ideal {a1 / a0:g}x needs {a1} free cores; this machine has {cores}, shared with the driver, "
                f"shard, raylet and any other work)")
    return as_json(results, cores), None


if __name__ == "__main__":
    cli(make_parser, run)
