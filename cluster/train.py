"""Entry point: ``python -m cluster.train --config configs/cartpole.yaml``.

The same command runs locally (embedded Ray), in this one process without Ray
(``--address inprocess``), and on a cluster under ``ray job submit``, where
RAY_ADDRESS points it at the cluster. The config is
validated before Ray is imported, so a bad config costs milliseconds and
prints one line, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

from cluster import exits

# The exit codes, one table (cluster/exits.py): --help prints it, docs/failures.md copies it.
EXIT_OK, EXIT_TARGET_MISSED, EXIT_CONFIG = exits.OK.code, exits.TARGET_MISSED.code, exits.BAD_INPUT.code
EXIT_DIVERGED, EXIT_WRITE_FAILED, EXIT_RUN_FAILED = exits.DIVERGED.code, exits.WRITE_FAILED.code, exits.RUN_FAILED.code
EXIT_INTERRUPTED, EXIT_TERMINATED = exits.INTERRUPTED.code, exits.TERMINATED.code
#: Threads still running at exit are the trackers' (wandb, MLflow) flushing what they hold: seconds. Past this one is
#: stuck (an unreachable server), and the command must still end: the run's own files are written before this.
EXIT_JOIN_DEADLINE_S = 60.0


class GracefulStop:
    """SIGTERM (a scheduler, ``ray job stop``) takes the Ctrl-C path: the first SIGTERM or SIGINT raises
    KeyboardInterrupt in the driver loop, which stops, writes final.pt and the report, and shuts down. That must end
    within ``grace_s``, or this process exits at once; so does a second signal. Either way nothing of Ray is left:
    an embedded Ray's processes are killed before the exit.

    Installed after ``ray.init``, so it replaces the handler Ray's core worker installs (which prints a C stack
    and exits 15 with nothing saved)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None
        self.owns_ray = False  # this process started an embedded Ray: its processes go with it
        # The driver, once made: while it writes the final checkpoint and the report (``trainer.finishing``), a first
        # signal arms the grace timer but raises nothing, so final.pt is never cut short; while it counts a finished
        # iteration (``trainer.critical``) it asks the loop to stop once that is counted (``stop_requested``).
        self.trainer = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    @property
    def exit_code(self) -> int:
        return EXIT_TERMINATED if self.signum == signal.SIGTERM else EXIT_INTERRUPTED

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signum is not None:
            self._exit_now(f"{name} again: exiting now, without the final checkpoint")
        self.signum = signum
        print(f"\n{name}: stopping (final checkpoint, report, shutdown) within run.shutdown_grace_s = "
              f"{self.grace_s:g} s; send it again to exit at once", file=sys.stderr, flush=True)
        timer = threading.Timer(self.grace_s, self._exit_now,
                                args=(f"run.shutdown_grace_s = {self.grace_s:g} s passed: exiting now",))
        timer.daemon = True
        timer.start()
        if getattr(self.trainer, "critical", False):  # counting an iteration: it stops once that is done
            self.trainer.stop_requested = True
        elif not getattr(self.trainer, "finishing", False):
            raise KeyboardInterrupt

    def _exit_now(self, why: str) -> None:
        print(why, file=sys.stderr, flush=True)
        if self.owns_ray:
            from cluster import placement

            placement.kill_ray()
        os._exit(self.exit_code)


def parse_args(argv=None):
    from cluster import config as config_mod  # the standard library and yaml only

    p = config_mod.ArgumentParser(prog="python -m cluster.train", description=__doc__.splitlines()[0],
                                  epilog=exits.help_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config file (defaults apply to every key it leaves out)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override one setting, e.g. --set learner.lr=1e-3 (repeatable)")
    p.add_argument("--address", help="Ray cluster address; default: ray.address, RAY_ADDRESS, else an embedded local "
                                     "Ray; 'inprocess': the whole job in this process, without Ray (one learner)")
    p.add_argument("--run-dir", help="exact output directory (overrides run.output_dir / run.run_name)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a stopped run from its newest checkpoint (its config.yaml unless --config is given;"
                        " --set still applies, e.g. a larger run.total_env_steps)")
    p.add_argument("--trust-code", action="store_true",
                   help="with --resume: let the run directory's config.yaml import what it names to make the env (a "
                        "module:Id env id, env.wrappers) and reach the addresses it names (ray.address, a "
                        "ray.listen_address other than 127.0.0.1); refused without it, since a run directory may come "
                        "from anyone")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="write a torch profiler trace of N learner iterations (after 3 warm-up ones) to RUN_DIR/profile")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, start nothing")
    return p.parse_args(argv)


def _checkpoint_to_resume(run_dir: str) -> tuple[Path, dict]:
    """The run directory's newest checkpoint and its payload, read and checked before anything starts: a damaged,
    foreign or counter-less one is the one-line CheckpointError here, not an error after Ray has started."""
    from cluster import checkpoint
    from cluster.config import ConfigError

    newest = checkpoint.RunFiles(run_dir).latest_loaded()
    if newest is None:
        raise ConfigError(f"--resume: {run_dir!r} has no checkpoint (looked for checkpoints/final.pt and "
                          f"checkpoints/ckpt-*.pt)")
    found, payload = newest
    if not isinstance(payload.get("run_state"), dict):
        raise checkpoint.CheckpointError(f"{found}: holds weights but no run state (counters, schedules); allowed: "
                                         f"--resume of a run directory cluster.train wrote")
    from cluster.records import RunState  # the standard library only

    problem = RunState.problem_in(payload["run_state"])
    if problem is not None:
        raise checkpoint.CheckpointError(f"{found}: cannot be resumed: {problem}; allowed: --resume of a run "
                                         f"directory cluster.train wrote, as it wrote it")
    return found, payload


class _BackgroundImport:
    """Import modules in a daemon thread; ``join`` re-raises whatever the import raised."""

    def __init__(self, *modules: str):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=modules, name="import", daemon=True)
        self._thread.start()

    def _run(self, *modules: str) -> None:
        try:
            for name in modules:
                importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self._error = e

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def refusal(e: BaseException) -> tuple[str, exits.ExitCode] | None:
    """How the command reports ``e`` when it ends the run before training (a refused config, flag, checkpoint or run
    directory; resources the cluster lacks; a run directory that takes no file): the label of its one stderr line
    (``<label>: <e>``) and its exit code. None for anything else, which is not a refusal."""
    from cluster import checkpoint
    from cluster.config import ConfigError

    if isinstance(e, ConfigError):  # CheckpointError too
        return "config error", exits.BAD_INPUT
    if isinstance(e, checkpoint.WriteFailed):
        return "write failed", exits.WRITE_FAILED
    # cluster.placement imports Ray, which nothing before Ray's start may wait for; a ResourceError comes after it.
    placement = sys.modules.get("cluster.placement")
    if placement is not None and isinstance(e, placement.ResourceError):
        return "resource error", exits.BAD_INPUT
    return None


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    from cluster.config import ConfigError

    # Every refusal, before Ray starts or after, ends here: one line and its exit code (``refusal``).
    try:
        cfg, files, resume_from = _load(args)
        if args.profile < 0:
            raise ConfigError(f"--profile: {args.profile} is out of range; allowed: >= 0")
        if args.dry_run:
            return _dry_run(cfg, resume_from)
        return _start(cfg, args, files, resume_from, t_start)
    except Exception as e:
        refused = refusal(e)
        if refused is None:
            raise
        label, code = refused
        print(f"{label}: {e}", file=sys.stderr)
        return code.code


def _load(args) -> tuple:
    """(config, the run's ``RunFiles``, (checkpoint path, payload) to resume or None): the config loaded and every
    check of it, the run directory and the checkpoint that needs no env, before anything starts."""
    from cluster import checkpoint, trust
    from cluster import config as config_mod

    resume_from = None
    config_path = args.config
    if args.resume:
        resume_from = _checkpoint_to_resume(args.resume)
        config_path = config_path or str(checkpoint.RunFiles(args.resume).config)
    cfg = config_mod.load(config_path, args.overrides)
    if args.resume and not args.config and not args.trust_code:
        # The run directory's own config: refused if it would import code (cluster/trust.py), before --dry-run
        # or anything else makes its env.
        stored = f"{config_path}: the config stored in this run directory"
        trust.refuse_untrusted(cfg, stored,
                               f"--trust-code if you trust {args.resume}, or your own config (--config)")
        # ... and reaches no address it names (ray.address, ray.listen_address) that the user did not give.
        trust.refuse_unnamed_addresses(
            cfg, stored, f"--trust-code if you trust {args.resume}, your own config (--config), --address (for the "
                         f"ray keys), or the key set with --set",
            overrides=args.overrides, address=args.address)
    files = checkpoint.RunFiles.resolve(cfg, args.run_dir or args.resume)  # the one place it is decided
    files.refuse_unwritable()
    if args.run_dir or args.resume or cfg.run.run_name:
        # One directory, one run: a named directory holding another run is refused here, before Ray starts (the
        # driver's claim checks it again; a default name is new by construction). A resume into another
        # --run-dir may only continue there the run it resumes.
        resumed = resume_from[1] if resume_from else None
        files.refuse_foreign(resumed.get("run_id") if resumed else None,
                             continues_legacy=resumed is not None and resumed.get("run_id") is None)
    return cfg, files, resume_from


def _dry_run(cfg, resume_from) -> int:
    """--dry-run: the resolved config on stdout, once one throwaway env in this process passed as Trainer.build
    checks it (an env that cannot be made or that does not match env.modalities is a config error too)."""
    import yaml

    from actors.envs import describe_env  # gymnasium only (cv2 too with env.modalities); no Ray, no torch
    from cluster import checkpoint
    from cluster import config as config_mod

    # The resolved config prints only if the env passes.
    data = cfg.to_dict()
    env = describe_env(cfg.env.id, data["env"]["modalities"], normalize_obs=cfg.env.normalize_obs,
                       action_mask_key=cfg.env.action_mask_key, isolation=cfg.env.isolation_args(),
                       make_timeout_s=cfg.run.startup_timeout_s, **cfg.env_args())
    config_mod.check_agents(cfg, env["multiagent"])
    cfg = config_mod.with_class_defaults(cfg, env["action_kind"])  # as the Trainer picks them
    if resume_from is not None:  # the checkpoint's weights against the model the config builds (torch)
        from learner.spec import spec_from_description

        spec = spec_from_description(env, cfg.learner.hidden_sizes, cfg.learner.rnn,
                                     cfg.learner.rnn_hidden_size, cfg.multiagent.policy_entries())
        checkpoint.refuse_unfit(resume_from[1], spec)
    data = cfg.to_dict()

    def box(shape) -> str:
        return f"Box({', '.join(str(int(d)) for d in shape)})"

    # A Box env is one modality (vector, or image for H x W x C uint8): what the model will see.
    observation = ", ".join(f"{m['name']}: {m['kind']} {box(m['shape'])} {m['dtype']}" for m in env["modalities"])
    action = env["action_space"]
    if env["action_kind"] == "composite":
        action += f" (parts: {', '.join(f'{kind} {size}' for kind, size in env['action_parts'])})"
    if env["action_mask"]:
        action += f", masked by observation key {env['action_mask']!r}"
    print(yaml.safe_dump(data, sort_keys=False), end="")
    # A YAML comment, so stdout stays the resolved config, loadable as it is.
    if cfg.class_defaults:
        print(f"# env.defaults: {cfg.env.defaults}: continuous actions, so the settings the config leaves unset "
              f"took the continuous defaults: " + ", ".join(f"{k}={v}" for k, v in cfg.class_defaults.items()))
    print(f"# env.id {cfg.env.id!r}: observation {observation}, action {action}")
    agents = env["multiagent"]
    if agents:  # each agent's own spaces, and what plays it
        ma = cfg.multiagent
        if agents["api"] == "parallel":
            role = "policy 'shared' (every agent learns, one env slot each)"
        else:
            others = (f"self-play pool of the last {ma.pool_size} snapshots" if ma.self_play else ma.opponent)
            role = f"policy 'shared' as the learning seat (alternating per episode; other seats: {others})"
        for agent, (obs_space, act_space) in agents["spaces"].items():
            if agents.get("policies"):
                role = f"policy {agents['policies'][agent]!r} (one env slot each)"
            print(f"# agent {agent!r} ({agents['api']}): observation {obs_space}, action {act_space} -> {role}")
    return EXIT_OK


def _start(cfg, args, files, resume_from, t_start: float) -> int:
    """Ray started (or joined) and the run trained; a refused start (a bad --address or RAY_ADDRESS) raises."""
    import ray

    from cluster import placement  # ray and the config only; torch loads in the thread below

    # Ray's start-up (~2 s, mostly waiting for its own processes) and importing torch, gymnasium and the driver
    # (~1.5 s) overlap: the imports run in a thread while ray.init runs here. (The other way round, ray.init in a
    # thread, hung connecting to the GCS when tried.)
    importer = _BackgroundImport("cluster.checkpoint", "cluster.driver")
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ and not files.root.is_absolute():
        # Under `ray job submit` the working directory is Ray's temporary copy of the repository.
        print(f"warning: run directory {files.root} is relative, so it lands in this job's temporary working "
              f"directory, which Ray deletes with the session; pass --run-dir /absolute/path to keep the outputs",
              file=sys.stderr)
    # Ctrl-C and SIGTERM reach the driver loop as KeyboardInterrupt (GracefulStop); a second one exits at once.
    stopper = GracefulStop(cfg.run.shutdown_grace_s)
    try:
        stopper.install()  # from here on; installed again below, over the handler ray.init puts in
        started = placement.start_ray(cfg, args.address)
        stopper.owns_ray = started
        stopper.install()
        importer.join()
        return _train(cfg, args, files, resume_from, t_start, started, stopper)
    except KeyboardInterrupt:  # before the driver loop, or while it shut down
        print("interrupted; shutting down", file=sys.stderr)
        return stopper.exit_code


def _train(cfg, args, files, resume_from, t_start: float, started: bool, stopper: GracefulStop) -> int:
    import ray

    from cluster import checkpoint, placement
    from cluster import config as config_mod
    from cluster.driver import Trainer

    # A refusal (``refusal``) goes up to main, which says it in one line once Ray is stopped here.
    try:
        resume_path, resume = resume_from or (None, None)
        if resume is not None:
            print(f"resuming from {resume_path} (iteration {resume['run_state']['iteration']}, "
                  f"{resume['run_state']['env_steps']:,} env steps)", file=sys.stderr)
        trainer = Trainer(cfg, files, t_start=t_start, profile_iterations=args.profile, resume=resume)
        stopper.trainer = trainer
    # The env-class defaults against the config's layout, or the env itself; run.json: the run directory took no file.
    except (config_mod.ConfigError, checkpoint.WriteFailed):
        if started:
            placement.stop_ray()
        raise
    try:
        try:
            # A ResourceError, or a ConfigError of a setting only checkable against the cluster (batch_size: auto).
            trainer.build()
        except KeyboardInterrupt:
            print("interrupted during start-up; shutting down", file=sys.stderr)
            return stopper.exit_code
        except ray.exceptions.RayActorError as e:  # killed (or its node lost) before training began
            print(f"run failed: an actor died during start-up ({type(e).__name__}: "
                  f"{' '.join(str(e).split())[:300]}); nothing was trained, start the run again", file=sys.stderr)
            return EXIT_RUN_FAILED
        try:
            result = trainer.run()
        except checkpoint.WriteFailed as e:  # config.yaml or the first metrics file, before any training
            raise checkpoint.WriteFailed(f"{e}; nothing was trained") from e
    finally:
        trainer.shutdown()
        if started:
            placement.stop_ray()
    print(
        f"done: {result.reason} | env steps {result.env_steps:,} | iterations {result.iterations} | "
        f"{result.wall_s:.1f} s from start | {result.env_steps / max(result.wall_s, 1e-9):,.0f} env steps/s overall | "
        f"return mean {result.episode_return_mean:.1f} | run dir {result.run_dir}"
        + (f" | checkpoint {result.checkpoint_path}" if result.checkpoint_path else ""),
        file=sys.stderr,
    )
    if result.reason == "interrupted" or stopper.signum is not None:  # a signal during the final save: still one
        return stopper.exit_code
    if result.reason == "failed":
        print(f"run failed: {trainer.failure}", file=sys.stderr)
        return EXIT_RUN_FAILED
    if result.reason == "write_failed" or trainer.report_failure:
        last = (f"the last good checkpoint is {result.checkpoint_path}: --resume {result.run_dir} continues from it"
                if result.checkpoint_path else "no checkpoint was written")
        print(f"write failed: {trainer.failure or trainer.report_failure}; {last}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    if result.reason == "diverged":
        last = (f"the last finite checkpoint is {result.checkpoint_path}" if result.checkpoint_path else
                "no finite checkpoint was written")
        print(f"run stopped: {trainer.failure}; {last}", file=sys.stderr)
        return EXIT_DIVERGED
    if cfg.run.require_target and not result.reached_target:
        targets = {"run.target_return": cfg.run.target_return, "run.target_success_rate": cfg.run.target_success_rate}
        print("target not reached: " + ", ".join(f"{k} = {v}" for k, v in targets.items() if v is not None),
              file=sys.stderr)
        return EXIT_TARGET_MISSED
    return EXIT_OK


def exit_without_finalization(code: int) -> None:
    """End the command once everything is written: as at a normal exit, the threads that are not daemons are
    waited for and the atexit handlers run (trackers' and Ray's, if any are left); the streams are flushed, and the
    process exits without the interpreter's finalization, which spends ~1.1 s here destroying torch's and Ray's
    modules after the last line is out (measured from the last atexit handler to the exit). The run's own files
    are closed before this: the sinks in ``Trainer.run``, the report thread joined in ``Trainer.shutdown``."""
    import atexit

    deadline = time.monotonic() + EXIT_JOIN_DEADLINE_S
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                print(f"exit: thread {thread.name!r} still running after {EXIT_JOIN_DEADLINE_S:g} s; exiting without "
                      f"it", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_finalization(main())
