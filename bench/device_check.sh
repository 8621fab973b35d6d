#!/usr/bin/env bash
# Device check on an accelerator host (Ascend NPU, CUDA GPU; a CPU runs it too): one command, one table, under 10 min.
# Steps, each under its own limit (bench/_device_checklist.py; rows and targets: docs/cluster.md, "Ascend NPU"):
# doctor, a two-learner run with the collective, graphs against eager, the host-bound fraction with its stage, the
# run's checkpoint on a CPU-only head, resume, the device's busy share, the collective's share, replay samples/s.
#
#   bench/device_check.sh [--device auto|cuda|npu|cpu] [--quick] [--time-budget SECONDS] [--out FILE]
#   bench/device_check.sh --sections [...]   bench/device_check.py's measurement sections instead (its own JSON)
#
# --out (default device_check_results.json in the directory you run it from): the JSON; the table is FILE.md beside
# it and $OUT/device_check.md where OUT is set. Hard limit: the budget (530 s, or --time-budget) plus 30 s, and 20 s
# to die. Exit status: 0 every required check ok, 1 some missed, 2 device unusable, 124 stopped at the hard limit.
set -u

RESULTS="device_check_results.json"
LIMIT_S=560
SCRIPT=bench/_device_checklist.py
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --sections) SCRIPT=bench/device_check.py; shift ;;
    --only) SCRIPT=bench/device_check.py; ARGS+=("$1"); shift ;;  # a section's name: the sections' own option
    --out|--time-budget)
      if [ $# -lt 2 ]; then echo "device_check.sh: $1 needs a value" >&2; exit 2; fi
      set -- "$1=$2" "${@:3}" ;;
    --out=*) RESULTS="${1#--out=}"; shift ;;
    --time-budget=*)
      BUDGET="${1#--time-budget=}"; shift
      case "$BUDGET" in
        ''|[!0-9]*|*[!0-9.]*|*.*.*) echo "device_check.sh: --time-budget: '$BUDGET' is not a number of seconds" >&2
                                    exit 2 ;;
      esac
      # The script's budget in whole seconds, rounded up, and the 30 s the default keeps between the two.
      LIMIT_S=$(( ${BUDGET%%.*} + 30 ))
      case "$BUDGET" in *.*[1-9]*) LIMIT_S=$(( LIMIT_S + 1 )) ;; esac
      ARGS+=(--time-budget "$BUDGET") ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
case "$RESULTS" in /*) ;; *) RESULTS="$PWD/$RESULTS" ;; esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || exit 2
cd "$ROOT" || exit 2
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi

# -k: if the script does not stop within 20 s of the SIGTERM (it stops its running step and writes what finished),
# it is killed.
timeout -k 20 "$LIMIT_S" "$PY" "$SCRIPT" --out "$RESULTS" ${ARGS[@]+"${ARGS[@]}"}
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "device_check.sh: stopped at the $LIMIT_S s limit (rc $rc); the results file has what finished" >&2
fi
if [ -f "$RESULTS" ]; then
  echo "device check results: $RESULTS"
else
  echo "device_check.sh: no results file at $RESULTS" >&2
fi
exit "$rc"
