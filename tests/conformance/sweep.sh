#!/usr/bin/env bash
# One run of torch's distributed suite (run_torch_distributed_tests.py) for one backend and
# world size, with its log, junit XML and wall time under OUTDIR.
#
#   tests/conformance/sweep.sh OUTDIR BACKEND WORLD_SIZE [NAME] [pytest args, e.g. -k EXPR]
#
# NAME (default BACKEND_wsWORLD_SIZE) names the files: OUTDIR/NAME.log, OUTDIR/NAME.xml;
# OUTDIR/walltimes.txt gets one line per run. The environment passes through
# (TPCORE_CONFORMANCE_START_METHOD, TPCORE_CONFORMANCE_TPCORE_PATH,
# DISTRIBUTED_TESTS_DEFAULT_TIMEOUT, INIT_METHOD). Compare runs with compare_results.py.
set -u
out=$1 backend=$2 world=$3
shift 3
name=${backend}_ws${world}
if [ $# -gt 0 ] && [[ $1 != -* ]]; then name=$1; shift; fi
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
start=$(date +%s)
BACKEND=$backend WORLD_SIZE=$world python -m pytest "$here/run_torch_distributed_tests.py" \
  -p no:cacheprovider --noconftest --timeout "${PYTEST_TIMEOUT:-600}" -v -rA --durations=0 \
  --junitxml="$out/$name.xml" "$@" > "$out/$name.log" 2>&1
rc=$?
echo "$name: rc=$rc wall=$(( $(date +%s) - start )) s start=$(date -d @"$start" +%T)" \
  "method=${TPCORE_CONFORMANCE_START_METHOD:-spawn} tpcore=${TPCORE_CONFORMANCE_TPCORE_PATH:-installed}" \
  "timeout=${DISTRIBUTED_TESTS_DEFAULT_TIMEOUT:-300} args=$*" >> "$out/walltimes.txt"
tail -1 "$out/$name.log"
