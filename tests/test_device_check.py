"""bench/device_check.sh, as an accelerator host runs it, here on the CPU.

``test_the_table_on_cpu`` (``long``: ``make test-long``, which CI runs) runs the one command in --quick mode through the shell wrapper: the
doctor, a two-learner run over gloo, graphs against eager, the CPU-only head loading the run's checkpoint, the
resume, the collective's share, with the replay step given a real bad input (no producers) so that a failed step
is seen as its row, and the exit status saying a required check missed. Every row is there, each verdict is one of
ok / miss / n/a, the table is the one printed and written beside the results and into $OUT. About 40 s on 2 cores:
each step is a process of its own (the run and the resume each start an embedded Ray), none larger than it must
be to measure (the collective's share is the two-learner run's own record, not a step of its own).

``test_sections_call_the_benches`` runs in ``make test`` without starting anything: every section of
``--sections`` (bench/device_check.py) and every checklist step calls a bench's function with options that bench
still has, and its config overrides load (a renamed flag or key fails there, not on an accelerator host).

``test_device_check_quick_on_cpu`` runs ``--sections --quick`` and is marked ``long`` (``make test-long`` /
``pytest -m long``; ``make test`` leaves it out): it starts an embedded Ray (one, shared by every section but the
update, which runs in a process of its own), runs a first torch.compile and trains five small runs, one to two
minutes on a quiet 2-core machine and two to three times that on a loaded one. Its section limits are wide for the
same reason (bench/device_check.py's quick budgets): a limit a loaded machine can miss would make it fail at random,
and when a section does run out, the failure names it, its seconds and its limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "bench" / "device_check.sh"
VARIANTS = ("fp32", "no_graphs", "autograd", "bf16", "fp16", "compile")
#: The table's rows, in order: the issue's steps, then the seed's checklist.
ROWS = ["doctor", "two-learner run", "graphs vs eager", "host-bound fraction", "checkpoint on a CPU-only head",
        "resume", "device busy share", "collective share of update", "replay samples/s"]


@pytest.mark.long  # about 40 s of the 8-minute make test for a command only a device host runs
def test_the_table_on_cpu(tmp_path):
    from bench._device_checklist import VERDICTS

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OUT"] = str(tmp_path / "out")  # as a device host's harness sets it: the table is copied there
    t = time.monotonic()
    # --replay-producers 0: a real bad input to a real step (bench/replay_throughput.py refuses it).
    proc = subprocess.run([str(SCRIPT), "--device", "cpu", "--quick", "--out", "results.json",
                           "--replay-producers", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=400,
                          env=env)
    elapsed = time.monotonic() - t
    log = f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    r = json.loads((tmp_path / "results.json").read_text())
    rows = {row["check"]: row for row in r["rows"]}
    assert [row["check"] for row in r["rows"]] == ROWS, log
    for row in r["rows"]:
        assert row["verdict"].split()[0] in VERDICTS, row
        assert row["figure"] and row["target"], row
    # The failed step is its row, with the bench's own words; it is the only required check missed, and exit 1 says so.
    replay = rows["replay samples/s"]
    assert replay["verdict"] == "miss" and replay["figure"].startswith("failed:") and "--producers" in replay[
        "figure"], replay
    assert r["required_missed"] == ["replay samples/s"], log
    assert proc.returncode == 1, log
    # Every other step ran and says so, with figures measured here and labelled as the CPU's.
    for check in ("doctor", "two-learner run", "checkpoint on a CPU-only head", "resume"):
        assert rows[check]["verdict"] == "ok", (rows[check], log)
    assert "2 learners (gloo on the CPU)" in rows["two-learner run"]["figure"]
    assert rows["graphs vs eager"]["verdict"] == "n/a (no graphs on cpu)", rows["graphs vs eager"]
    for check in ("host-bound fraction", "device busy share", "collective share of update"):
        assert "(cpu)" in rows[check]["figure"] and rows[check]["required"] is False, rows[check]
    assert "largest rollout stage:" in rows["host-bound fraction"]["figure"]
    assert "2 ranks, gloo" in rows["collective share of update"]["figure"]
    # One table: printed, beside the results, and in $OUT.
    assert r["table"] in proc.stdout, log
    for md in (tmp_path / "results.md", tmp_path / "out" / "device_check.md"):
        assert r["table"] in md.read_text(), md
    assert r["wall_s"] <= r["budget_s"] and elapsed < r["budget_s"] + 30, (elapsed, log)


def test_sections_call_the_benches():
    from bench import device_check as dc
    from bench import rollout_scaling
    from bench._common import options
    from cluster import config as config_mod

    keys = [s.key for s in dc.SECTIONS]
    assert keys == ["update", "feed", "training.cartpole", "training.multirate", "rollout_breakdown", "end_to_end",
                    "rollout_scaling", "inference"]
    # The update in a process of its own, every other section in one process on one Ray.
    assert [[s.key for s in step] for step in dc.plan_steps(list(dc.SECTIONS))] == [keys[:1], keys[1:]]
    assert all(k.startswith("training.") or k in dc.RUN for k in keys)
    for mode in ("quick", "full"):  # the caps and the shared Ray's start-up fit the whole run's budget
        assert sum(s.cap_s[mode] for s in dc.SECTIONS) + dc.RAY_START_S[mode] <= dc.TOTAL_BUDGET_S[mode]
        assert all(s.min_s[mode] <= s.cap_s[mode] for s in dc.SECTIONS)
    for quick in (True, False):
        for cores in (2, 16, 192):
            args = options(rollout_scaling.make_parser, **dc.rollout_options(quick, cores))
            assert max(args.actors) <= max(1, cores - 2), args
            args = options(rollout_scaling.make_parser, **dc.inference_options(quick, cores))
            assert args.inference == ["local", "remote"] and args.config.endswith("configs/multirate.yaml"), args
        for name, spec in dc.TRAIN.items():  # the overrides are valid keys of the config, the target where expected
            cfg = config_mod.load(str(ROOT / spec["config"]), dc.training_overrides(name, "cpu", quick, 60.0))
            assert cfg.run.time_budget_s == 60 and cfg.learner.device == "cpu"
            assert getattr(cfg.run, "target_return" if spec["key"] == "episode_return_mean"
                           else "target_success_rate") is not None
    for cores in (1, 2, 16, 192):  # the fixed-time runs' overrides are valid configs of the layout they name
        for run in dc.BREAKDOWN["runs"]:
            cfg = config_mod.load(str(ROOT / dc.BREAKDOWN["config"]),
                                  dc.breakdown_overrides(run, "cpu", False, 50.0, cores))
            assert cfg.run.target_success_rate is None and cfg.run.time_budget_s == 50
            if run == "auto":
                assert cfg.autoscale_rollouts and 1 == cfg.rollout.min_actors < cfg.rollout.max_actors
                assert cfg.rollout.max_actors == max(2, cores - 2)
            else:  # the config's own count: the figure the H200 host's 54.3% host-bound was measured at
                assert cfg.rollout.num_actors == config_mod.load(str(ROOT / dc.BREAKDOWN["config"])).rollout.num_actors
        lay = dc.end_to_end_layout(cores)
        cfg = config_mod.load(str(ROOT / "configs" / "cartpole.yaml"),
                              dc.end_to_end_overrides("cpu", True, 30.0, cores))
        assert cfg.rollout.num_actors == lay["actors"] == cores and cfg.run.target_return is None
        assert 1 <= cfg.replay.num_shards <= cores and cores <= dc.ACTORS_PER_SHARD * cfg.replay.num_shards
        # One fragment from each actor an update, so at max_policy_lag 1 every actor holds a ticket.
        assert cfg.learner.batch_size == cores * cfg.fragment_samples and cfg.run.total_env_steps > 0
        args = options(rollout_scaling.make_parser, **dc.alone_options(True, lay))
        assert args.actors == [cores] and args.envs == [cfg.rollout.envs_per_actor]
        assert args.fragment_length == cfg.rollout.fragment_length
    for mode in ("quick", "full"):  # --time-budget scales the limits and keeps each minimum within its limit
        for budget in (dc.MIN_BUDGET_S, dc.TOTAL_BUDGET_S[mode], 900.0):
            secs = [dc.scaled(s, mode, budget) for s in dc.SECTIONS]
            assert sum(s.cap_s[mode] for s in secs) + dc.RAY_START_S[mode] <= budget + 1
            assert all(s.min_s[mode] <= s.cap_s[mode] for s in secs)
    with pytest.raises(TypeError, match="no such option"):  # what options() says when a bench drops a flag
        options(rollout_scaling.make_parser, no_such_flag=1)
    # The checklist: the run's overrides load for one and two learners on any host, each learner updating
    # configs/cartpole.yaml's own shape; the replay step's options are bench/replay_throughput.py's.
    from bench import _device_checklist as cl
    from bench import replay_throughput

    cartpole = config_mod.load(str(ROOT / "configs" / "cartpole.yaml"))
    for learners in (1, 2):
        for cores in (1, 2, 16, 192):
            for quick in (True, False):
                cfg = config_mod.load(str(ROOT / "configs" / "cartpole.yaml"),
                                      cl.run_overrides("cpu", learners, quick, cores, 60.0))
                assert cfg.learner.num_learners == learners and cfg.run.target_return is None
                assert cfg.learner.batch_size // learners == cartpole.learner.batch_size
                assert cfg.learner.minibatch_size // learners == cartpole.learner.minibatch_size
                assert 1 <= cfg.rollout.num_actors <= max(1, cores - 2)
            for quick in (True, False):
                args = options(replay_throughput.make_parser, **cl.replay_options(quick, cores))
                assert args.payloads == ["cartpole"] and 1 <= args.producers <= 8
    for mode in ("quick", "full"):  # a step's minimum fits its cap; full mode's caps fit the whole budget
        assert all(s.min_s[mode] <= s.cap_s[mode] for s in cl.STEPS)
    assert sum(s.cap_s["full"] + 5.0 for s in cl.STEPS) <= cl.TOTAL_BUDGET_S["full"]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def not_ok_sections(results_file) -> str:
    """One line per section that did not finish ok: its status, seconds against its limit and why; a timeout or skip
    says it was the machine being slow (the load average) rather than a wrong number."""
    try:
        r = json.loads(results_file.read_text())
    except (OSError, ValueError) as e:
        return f"no readable results file ({e})"
    sections = dict(r.get("sections", {}))
    sections.update({f"training.{k}": v for k, v in sections.pop("training", {}).items() if isinstance(v, dict)})
    lines = []
    for key, rec in sections.items():
        if rec.get("status") == "ok":
            continue
        status, line = rec.get("status"), f"  {key}: {rec.get('status')}"
        if rec.get("wall_s") is not None:
            line += f" after {rec['wall_s']} s (limit {rec.get('timeout_s', '?')} s)"
        if status == "timeout":
            line += ", too slow for its limit on this machine"
        elif status == "skipped":
            line += ", the sections before it took the time it needed"
        lines.append(f"{line}: {str(rec.get('error')).splitlines()[0][:300]}")
    host = r.get("host", {})
    load = f"load average {host.get('load_average_start')} at the start, {host.get('load_average_end')} at the end"
    return ("sections not ok:\n" + "\n".join(lines) + f"\n  ({load})") if lines else f"every section ok ({load})"


def assert_sane_run(key: str, run: dict, summary: str) -> None:
    """A fixed-time run's figures: it trained, its host-bound fraction is a fraction, its rollout stage shares are
    fractions of the actors' time that add up to all of it (``other`` is the rest), and the summary shows them."""
    from pipeline import metric_keys as M

    assert run["stop_reason"] in ("total_env_steps", "time_budget"), (key, run)
    assert _positive(run["iterations"]) and _positive(run["env_steps"]), (key, run)
    # The second half of a quick run is two or three records; the actors' step counts reach the driver with their
    # stats, so on a loaded machine two records can carry the same count: the half's rate may be 0, never missing.
    assert _positive(run["env_steps_per_s"]) and run["env_steps_per_s_second_half"] >= 0.0, (key, run)
    assert _positive(run["learner_samples_per_s"]) and _positive(run["rollout_actors_end"]), (key, run)
    assert 0.0 <= run["host_bound_fraction"] <= 1.0, (key, run)
    shares = run["rollout_share"]
    stages = [stage for stage, _, _ in M.ROLLOUT_STAGES]
    assert list(shares) == stages and all(0.0 <= v <= 1.0 for v in shares.values()), (key, shares)
    assert abs(sum(shares.values()) - 1.0) < 1e-3, (key, shares)
    assert _positive(run["rollout_wall_s"]) and run["records_in_second_half"] >= 1, (key, run)
    assert set(run["rollout_us_per_env_step"]) == set(stages), (key, run)
    assert all(v >= 0 for v in run["rollout_us_per_env_step"].values()), (key, run)
    assert run["largest_stage"] in stages and run["largest_stage"] != "other", (key, run)
    assert run["verdict"] and run["verdict"] in summary, (key, run["verdict"])


@pytest.mark.long
def test_device_check_quick_on_cpu(tmp_path):
    out = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t = time.monotonic()
    # The wrapper's own hard limit is 560 s (and 20 s to die); this only guards against the wrapper itself hanging.
    proc = subprocess.run([str(SCRIPT), "--sections", "--device", "cpu", "--quick", "--out", "results.json"],
                          cwd=tmp_path,
                          capture_output=True, text=True, timeout=620, env=env)
    elapsed = time.monotonic() - t
    log = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    # rc 0: every section ok; 1: some section failed, timed out or was skipped (named first in the message).
    assert proc.returncode == 0, f"device_check.sh --quick exit {proc.returncode}\n{not_ok_sections(out)}\n{log}"
    assert out.is_file(), log  # a relative --out is taken from the caller's directory
    assert f"device check results: {out}" in proc.stdout, log
    r = json.loads(out.read_text())
    assert r["quick"] is True and r["targets_expected"] is False
    assert r["device"]["kind"] == "cpu" and r["host"]["cpus"] == os.cpu_count()
    assert "[update]" in r["summary"] and r["summary"] in proc.stdout

    sections = r["sections"]
    assert set(sections) >= {"update", "feed", "training", "rollout_breakdown", "end_to_end", "rollout_scaling",
                             "inference"}, list(sections)

    # 1. The update: every variant of the CartPole batch measured, fp16 possibly refused in words.
    update = sections["update"]
    assert update["status"] == "ok", update
    results = update["batches"]["cartpole"]["results"]
    assert update["batches"]["cartpole"]["samples"] == 1024
    assert update["batches"]["cartpole"]["update_epochs"] == 8
    from cluster import config as config_mod

    cartpole = config_mod.load(str(ROOT / "configs" / "cartpole.yaml"))
    assert update["batches"]["cartpole"]["minibatch_size"] == cartpole.learner.minibatch_size
    for v in VARIANTS:
        res = results[v]
        if v == "fp16" and "ms" not in res:
            assert res["supported"] is False and res["error"].strip(), res
            continue
        assert _positive(res["ms"]) and _positive(res["first_update_ms"]) and res["reps"] >= 3, (v, res)
        assert res["stats_finite"] is True, (v, res)
    assert results["fp32"]["compile_note"] == "off"
    # The default for CartPole's state-only model, over static buffers; on CPU nothing is captured, and it says so.
    assert results["fp32"]["update_path"] == "fused (graphs: no capture on cpu)"
    assert results["no_graphs"]["update_path"] == "fused"
    ratio = update["batches"]["cartpole"]["graphs_speedup"]  # with / without graphs, measured in this run
    assert _positive(ratio) and f"cartpole graphs: x{ratio:.2f}" in r["summary"], r["summary"]
    assert results["autograd"]["update_path"] == "autograd (learner.fused_update is off)"
    assert results["compile"]["compile_requested"] is True and results["compile"]["compile_note"], results["compile"]

    # 2. Host-bound fraction, inline against the pipelined feed.
    # On this CPU every section must come back with numbers: a section that fails here has rotted.
    feed = sections["feed"]
    assert feed["status"] == "ok", feed
    vec = feed["kinds"]["vector"]
    assert 0.0 <= vec["host_bound_inline"] <= 1.0 and 0.0 <= vec["host_bound_pipelined"] <= 1.0, vec
    assert _positive(vec["samples_per_s_ratio"]), vec

    # 3. Training: a few iterations each in quick mode, the target not expected.
    for name in ("cartpole", "multirate"):
        run = sections["training"][name]
        assert run["status"] == "ok", run
        assert run["target_expected"] is False and isinstance(run["reached"], bool), run
        assert _positive(run["env_steps"]) and _positive(run["iterations"]), run
        assert "learner.device=cpu" in run["overrides"], run
        assert run["target"]["value"] == {"cartpole": 475, "multirate": 0.9}[name], run

    # 4. Rollout scaling: env steps/s per actor count.
    rollout = sections["rollout_scaling"]
    assert rollout["status"] == "ok", rollout
    rates = [v for row in rollout["env_steps_per_s"].values() for v in row.values()]
    assert rates and all(_positive(v) for v in rates), rollout["env_steps_per_s"]

    # The multi-rate config's rollouts with local and with remote inference, side by side.
    inference = sections["inference"]
    assert inference["status"] == "ok", inference
    assert {c["inference"] for c in inference["cells"]} == {"local", "remote"}, inference["cells"]
    assert _positive(inference["remote_over_local"]["16"]["1"]), inference

    # 5. The multi-rate config's rollout breakdown, at its own actor count and under rollout.num_actors: auto.
    breakdown = sections["rollout_breakdown"]
    assert breakdown["status"] == "ok", breakdown
    assert breakdown["config"] == "configs/multirate.yaml" and breakdown["cores"] == os.cpu_count()
    assert set(breakdown["runs"]) == {"fixed", "auto"}, breakdown["runs"]
    assert breakdown["runs"]["fixed"]["actors"] == 1  # the config's own count
    assert breakdown["runs"]["auto"]["actors"] == f"auto 1-{max(2, os.cpu_count() - 2)}"
    for name, run in breakdown["runs"].items():
        assert "rollout.num_actors=auto" in run["overrides"] or name == "fixed", run
        assert "learner.device=cpu" in run["overrides"], run
        assert_sane_run(f"rollout_breakdown.{name}", run, r["summary"])

    # 6. CartPole end to end with a rollout actor per core, and the same actors alone.
    e2e = sections["end_to_end"]
    assert e2e["status"] == "ok", e2e
    lay = e2e["layout"]
    assert lay["actors"] == os.cpu_count() == e2e["rollout_actors_end"], lay
    assert 1 <= lay["shards"] <= lay["actors"] and lay["batch_size"] == lay["actors"] * 32 * 32, lay
    assert f"rollout.num_actors={lay['actors']}" in e2e["overrides"], e2e["overrides"]
    assert_sane_run("end_to_end", e2e, r["summary"])
    alone = e2e["rollouts_alone"]
    assert _positive(alone["env_steps_per_s"]) and alone["options"]["actors"] == [lay["actors"]], alone
    # The second half's rate may be 0 in quick mode (see assert_sane_run), so the ratio may be too; never missing.
    assert e2e["training_over_alone"] >= 0.0, e2e
    assert e2e["rollout_ceiling_env_steps_per_s"] is None or e2e["rollout_ceiling_env_steps_per_s"] > 0, e2e
    assert "the same actors alone:" in r["summary"], r["summary"]

    # 7. The targets the next accelerator run is judged by, each with this run's figure (not expected to be met).
    targets = r["targets"]
    assert set(targets) == {"update_ms_with_graphs", "multirate_host_bound_auto", "end_to_end_env_steps_per_s"}
    assert targets["update_ms_with_graphs"]["measured"] == results["fp32"]["ms"]
    assert targets["multirate_host_bound_auto"]["measured"] == breakdown["runs"]["auto"]["host_bound_fraction"]
    assert targets["end_to_end_env_steps_per_s"]["measured"] == e2e["env_steps_per_s_second_half"]
    for name, t in targets.items():
        assert isinstance(t["met"], bool) and t["baseline"] > 0 and t["what"], (name, t)
        assert f"  {name}: " in r["summary"], r["summary"]

    # The script kept its own budget: it stops every section at its limit (and a section process within its kill
    # grace), so past its budget is a limit not enforced, whatever the machine's load.
    budget = r["budget_s"]
    assert r["wall_s"] <= budget, f"device_check.py --quick ran {r['wall_s']:.0f} s of a {budget:.0f} s budget"
    assert elapsed < budget + 60, f"device_check.sh --quick took {elapsed:.0f} s (budget {budget:.0f} s)\n{log}"


def test_a_section_whose_alarm_surfaces_as_another_error_is_recorded_as_timed_out(monkeypatch):
    """Raised inside a C call, the section's alarm can come out as a SystemError ("returned a result with an
    exception set"): the section ran out of time, and its record says so, not that it failed."""
    from bench import device_check as dc

    def section(args, out, budget):
        out["measured"] = 1
        try:
            time.sleep(5)
        except dc.SectionTimeout:
            raise SystemError("<built-in method __new__> returned a result with an exception set") from None

    def failing(args, out, budget):
        raise ValueError("a real failure")

    monkeypatch.setitem(dc.RUN, "feed", section)
    rec: dict = {}
    dc._run_member("feed", 0.3, None, rec)
    assert rec["status"] == "timeout" and "SystemError" in rec["error"] and rec["measured"] == 1, rec
    monkeypatch.setitem(dc.RUN, "feed", failing)
    rec = {}
    dc._run_member("feed", 5.0, None, rec)
    assert rec["status"] == "error" and "a real failure" in rec["error"], rec
