"""Periodic evaluation during training: submit, collect, keep the best (driver side).

Every ``eval.interval_iterations`` iterations, when no evaluation is running, the newest published weights go to
the graph's evaluator actor (``actors/evaluator.py``, on a CPU host); the driver looks for the result without
waiting, once per iteration. The newest result's ``eval_*`` metrics go into every record after it; a result better
than every earlier one is written to ``checkpoints/best.pt`` (the weights and the config: what ``load_policy``
and ``cluster.evaluate`` read).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from ray.exceptions import GetTimeoutError, RayActorError

from cluster import checkpoint
from cluster.checkpoint import RunFiles
from pipeline import metric_keys as M
from pipeline import runtime


class PeriodicEvaluation:
    def __init__(self, cfg, graph, files: RunFiles, say: Callable[[str], None], run_id: str | None = None):
        self.cfg, self.graph, self.say = cfg, graph, say
        self.run_id = run_id
        self.files = files
        self.interval = cfg.eval.interval_iterations
        self.pending = None  # (version, result ref, weights ref, when it was sent)
        self.latest: dict | None = None
        self.best = self._saved_best()
        self.failures = 0
        self.restarts = 0

    def _saved_best(self) -> float:
        """The score of this run's best.pt, kept across a resume: a resumed run replaces it only when it beats it.
        A best.pt that is unreadable or another run's does not count (and is replaced by the first evaluation)."""
        if self.interval is None or not self.files.best.is_file():
            return -math.inf
        try:
            saved = checkpoint.load(self.files.best)
        except checkpoint.CheckpointError as e:
            self.say(f"evaluation: {e}; the first evaluation replaces it")
            return -math.inf
        if saved.get("run_id") not in (self.run_id, None):  # None: written before run ids, in this directory
            return -math.inf
        return float(saved.get("eval", {}).get("return_mean", -math.inf))

    @property
    def opponents(self) -> list[str]:
        """The fixed players a turn-based PettingZoo game is scored against (``actors.evaluator.Evaluator``); the
        graph knows the env's agents once built."""
        agents = self.graph.agents
        return list(self.cfg.multiagent.eval_opponents) if agents and agents["api"] == "aec" else []

    def step(self, iteration: int) -> None:
        """Collect a finished evaluation, then start the next one when it is due."""
        if self.graph.evaluator is None:
            return
        if self.pending is not None:
            version, ref, weights_ref, sent = self.pending
            ready, _ = runtime.wait([ref], timeout=0)
            if ready:
                self.pending = None
                try:
                    self._finished(runtime.get(ref, timeout=self.cfg.run.stall_timeout_s), weights_ref)
                except RayActorError as e:
                    self.failures += 1
                    self._replace(f"died during the evaluation of policy v{version} ({type(e).__name__})")
                except Exception as e:  # noqa: BLE001 - an evaluation failure is reported, training goes on
                    self.failures += 1
                    self.say(f"evaluation of policy v{version} failed: {type(e).__name__}: {e}")
            elif time.monotonic() - sent > self.cfg.run.stall_timeout_s:
                self.pending = None
                self.failures += 1
                self._replace(f"did not finish evaluating policy v{version} within run.stall_timeout_s = "
                              f"{self.cfg.run.stall_timeout_s:g} s (hung or stopped)")
        if self.pending is None and iteration % self.interval == 0:
            try:
                news = runtime.get(self.graph.board.latest.remote(-1), timeout=self.cfg.run.stall_timeout_s)
            except (RayActorError, GetTimeoutError):
                return  # the supply board is being replaced (the supervisor's business): evaluate next time
            if news is not None:
                version, (weights_ref, *_) = news  # the weights or their ref; (a self-play run also sends its pool)
                self.pending = (version, self.graph.evaluator.run.remote(version, weights_ref), weights_ref,
                                time.monotonic())

    def _replace(self, why: str) -> None:
        """A new evaluator (the same fixed seeds); training never waited for the old one."""
        try:
            runtime.kill(self.graph.evaluator)
        except Exception:  # noqa: BLE001 - already dead
            pass
        self.graph.evaluator = self.graph.make_evaluator()
        self.restarts += 1
        self.say(f"the evaluator {why}; replaced (restart {self.restarts})")

    def _finished(self, result: dict, weights_ref) -> None:
        self.latest = result
        if result["return_mean"] > self.best:
            self.best = result["return_mean"]
            weights = runtime.resolve(weights_ref, timeout=self.cfg.run.stall_timeout_s)
            state = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
            self.files.save_best({"learner": {"model": state, "version": result["version"]},
                                  "config": self.cfg.to_dict(), "eval": dict(result),
                                  "versions": checkpoint.package_versions(), "run_id": self.run_id})

    def metrics(self) -> dict:
        r = self.latest
        if self.graph.evaluator is None:
            return {}
        out = {M.EVAL_RETURN_MEAN: r and r["return_mean"], M.EVAL_RETURN_STD: r and r["return_std"],
               M.EVAL_SUCCESS_RATE: r and r["success_rate"], M.EVAL_POLICY_VERSION: r and r["version"]}
        for player in self.opponents:  # a turn-based game's scores against each fixed player
            for outcome in ("win", "draw", "loss"):
                out[f"eval_{outcome}_rate/{player}"] = r and r.get(f"{outcome}_rate/{player}")
            out[f"eval_elo/{player}"] = r and elo_against(r.get("win_rate/" + player), r.get("draw_rate/" + player))
        return out


def elo_against(win: float | None, draw: float | None) -> float | None:
    """The Elo-style rating difference to a fixed player that a score (win + draw / 2) against it implies,
    400 log10(s / (1 - s)), with s kept inside [0.5/100, 1 - 0.5/100] so a clean sweep is a finite +920."""
    if win is None or draw is None:
        return None
    score = min(max(win + draw / 2, 0.005), 0.995)
    return 400.0 * math.log10(score / (1 - score))
