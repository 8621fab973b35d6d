#!/usr/bin/env bash
# Device check on an accelerator host (CUDA GPU or Ascend NPU): under 10 minutes, one JSON results file.
# The logic is bench/device_check.py (its sections: docs/cluster.md); this wrapper picks the interpreter, runs from
# the repository root under a hard limit 30 s above the script's own budget (530 s, or --time-budget; with the 20 s
# kill grace one default call ends within 580 s) and says where the results are.
#
#   bench/device_check.sh [--device auto|cuda|npu|cpu] [--quick] [--time-budget SECONDS] [--out FILE]
#
# --out defaults to device_check_results.json in the directory you run it from (a relative path is taken from there
# too). Exit status: the script's (0 all sections ok, 1 some failed, 2 device unusable), 124 if the hard limit
# stopped it.
set -u

OUT="device_check_results.json"
LIMIT_S=560
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out|--time-budget)
      if [ $# -lt 2 ]; then echo "device_check.sh: $1 needs a value" >&2; exit 2; fi
      set -- "$1=$2" "${@:3}" ;;
    --out=*) OUT="${1#--out=}"; shift ;;
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
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || exit 2
cd "$ROOT" || exit 2
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi

# -k: if the script does not stop within 20 s of the SIGTERM (it stops its running section and keeps the file),
# it is killed.
timeout -k 20 "$LIMIT_S" "$PY" bench/device_check.py --out "$OUT" ${ARGS[@]+"${ARGS[@]}"}
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "device_check.sh: stopped at the $LIMIT_S s limit (rc $rc); the results file has what finished" >&2
fi
if [ -f "$OUT" ]; then
  echo "device check results: $OUT"
else
  echo "device_check.sh: no results file at $OUT" >&2
fi
exit "$rc"
