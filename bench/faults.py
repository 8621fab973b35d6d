"""Each fault of the Failures table (docs/failures.md), injected once into a CartPole run to 475 (2 rollout actors, 2 shards):
whether the run reached its target or ended in one line, how long it took against a run with no fault, and what
it counted.

    .venv/bin/python bench/faults.py [--seed 0] [--only kill-board stop-learner ...]
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import ROOT, cli, parser, signal_actor  # noqa: E402
from tests.conftest import kill_all  # noqa: E402

#: name -> (env fault for tests/faulty_env.py or None, (role, signal) to send at iteration 4 or None)
SCENARIOS = {
    "none": (None, None),
    "env-raise": ("raise", None),
    "env-hang": ("hang", None),
    "kill-rollout": (None, ("rollouts", signal.SIGKILL)),
    "stop-rollout": (None, ("rollouts", signal.SIGSTOP)),
    "kill-shard": (None, ("shards", signal.SIGKILL)),
    "stop-shard": (None, ("shards", signal.SIGSTOP)),
    "kill-learner": (None, ("learners", signal.SIGKILL)),
    "stop-learner": (None, ("learners", signal.SIGSTOP)),
    "kill-board": (None, ("board", signal.SIGKILL)),
    "stop-board": (None, ("board", signal.SIGSTOP)),
    "kill-control": (None, ("control", signal.SIGKILL)),
}
COUNTERS = ("rollout_restarts", "env_failures", "rollout_hangs", "shard_restarts", "learner_restarts",
            "board_restarts", "control_restarts", "fragments_lost", "board_voided", "fragments_dropped_stale")


def make_parser():
    p = parser(__doc__)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="scenarios to run (default: all)")
    return p


def run(args):

    from bench._train import embedded_ray, read_records
    from cluster import config as config_mod
    from cluster.driver import Trainer
    from cluster.records import first_at
    from tests.faulty_env import FAULTY_ID

    rows = []
    base = ["rollout.num_actors=2", "replay.num_shards=2", "run.require_target=false", f"run.seed={args.seed}",
            "run.checkpoint_interval_s=2", "run.progress_interval_s=1000"]
    with embedded_ray(config_mod.load(str(ROOT / "configs/cartpole.yaml"), base)):
        for name in args.only or list(SCENARIOS):
            env_fault, strike = SCENARIOS[name]
            with tempfile.TemporaryDirectory() as tmp:
                extra = ([f"env.id=tests.faulty_env:{FAULTY_ID}", f"env.kwargs.fault={env_fault}",
                          "env.kwargs.at_step=300", f"env.kwargs.token={tmp}/token"] if env_fault else [])
                cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), base + extra)
                run_dir = Path(tmp) / "run"
                trainer = Trainer(cfg, run_dir, quiet=True)
                lines: list[str] = []
                trainer.supervisor.say = trainer.evaluation.say = lines.append
                stopped: list[int] = []

                def strike_at_4(role=strike[0] if strike else None, sig=strike[1] if strike else None):
                    path = run_dir / "metrics.jsonl"
                    while not (path.exists() and len(path.read_text().splitlines()) >= 4):
                        time.sleep(0.05)
                    handle = getattr(trainer.graph, role)
                    signal_actor(handle[0] if isinstance(handle, list) else handle, sig, stopped)

                t0 = time.perf_counter()
                try:
                    trainer.build()
                    if strike:
                        threading.Thread(target=strike_at_4, daemon=True).start()
                    result = trainer.run()
                finally:
                    trainer.shutdown()
                    kill_all(stopped)
                wall = time.perf_counter() - t0
                records = read_records(run_dir)
                hit = first_at(records, 100, cfg.run.target_return)
                last = records[-1]
                rows.append((name, result.reason, wall, hit["train_time_s"] if hit else None,
                             {k: last.get(k, 0) for k in COUNTERS}, trainer.failure, lines))
                print(f"{name}: {result.reason} in {wall:.1f} s" + (f"; {trainer.failure}" if trainer.failure else ""),
                      file=sys.stderr, flush=True)
    print(f"\n{'fault':<14} {'outcome':<16} {'wall s':>7} {'to 475 s':>9}  counted")
    for name, reason, wall, to_target, counted, failure, lines in rows:
        shown = ", ".join(f"{k} {v}" for k, v in counted.items() if v)
        print(f"{name:<14} {reason:<16} {wall:>7.1f} {to_target if to_target is None else round(to_target, 1)!s:>9}  "
              f"{shown or '-'}")
        for line in lines:
            print(f"{'':<14} > {line}")
    return ([dict(zip(("fault", "outcome", "wall_s", "to_target_s", "counted", "failure", "lines"), r)) for r in rows],
            all(reason == "target_reached" for _, reason, *_ in rows))


if __name__ == "__main__":
    cli(make_parser, run)
