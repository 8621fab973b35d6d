#!/usr/bin/env bash
# Device check on an accelerator host (CUDA GPU or Ascend NPU): at most 8 minutes, one JSON results file.
# The logic is bench/device_check.py; this wrapper picks the interpreter, runs from the repository root under
# a hard 480 s limit and says where the results are.
#
#   bench/device_check.sh [--device auto|cuda|npu|cpu] [--quick] [--out FILE]
#
# --out defaults to device_check_results.json in the directory you run it from (a relative path is taken
# from there too). Exit status: the script's (0 all sections ok, 1 some failed, 2 device unusable),
# 124 if the 480 s limit stopped it.
set -u

OUT="device_check_results.json"
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out)
      if [ $# -lt 2 ]; then echo "device_check.sh: --out needs a path" >&2; exit 2; fi
      OUT="$2"; shift 2 ;;
    --out=*) OUT="${1#--out=}"; shift ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
case "$OUT" in
  /*) ;;
  *) OUT="$PWD/$OUT" ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || exit 2
cd "$ROOT" || exit 2
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi

# -k: if the script does not stop within 20 s of the SIGTERM (it stops its running section and keeps the
# file), it is killed.
timeout -k 20 480 "$PY" bench/device_check.py --out "$OUT" ${ARGS[@]+"${ARGS[@]}"}
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "device_check.sh: stopped at the 480 s limit (rc $rc); the results file has what finished" >&2
fi
if [ -f "$OUT" ]; then
  echo "device check results: $OUT"
else
  echo "device_check.sh: no results file at $OUT" >&2
fi
exit "$rc"
