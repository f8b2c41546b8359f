#!/usr/bin/env bash
# Run (or resume) `otb-spec experiment` in the background on a shared machine: one torch thread, its own process
# group, whose id is written to /tmp/otb-experiment.pgid while it runs (other work pauses it with
# `kill -STOP -- -$(cat /tmp/otb-experiment.pgid)` and resumes it with -CONT while timing) and removed when it ends.
#
#   experiments/run_in_background.sh [OUT [LOG [extra otb-spec experiment arguments…]]]
#
# OUT defaults to experiments/issue26-output (the pre-registered run of docs/experiment.md, whose finished runs are
# committed as they come, so that a later session resumes where this one stopped), LOG to OUT.log (appended to). Run it from the repository root with the
# environment that has torch and matplotlib active. Killing the group stops the run after its last checkpoint;
# running this again resumes it.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-experiments/issue26-output}
log=${2:-$out.log}
shift $(( $# < 2 ? $# : 2 ))
if [[ -e /tmp/otb-experiment.pgid ]] && kill -0 -- "-$(cat /tmp/otb-experiment.pgid)" 2>/dev/null; then
    echo "an experiment is already running (process group $(cat /tmp/otb-experiment.pgid))" >&2
    exit 1
fi
export PYTHONPATH="$PWD:$PWD/adapters:$PWD/experiments" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
setsid nohup bash -c '
    echo $$ > /tmp/otb-experiment.pgid
    trap "rm -f /tmp/otb-experiment.pgid" EXIT
    trap "exit 143" TERM INT HUP
    echo "== $(date -Is) start: otb-spec experiment --out $0 ${*}"
    python -c "import sys; from otb_spec.cli import main; sys.exit(main())" experiment --out "$0" "$@"
    echo "== $(date -Is) end"
' "$out" "$@" >> "$log" 2>&1 < /dev/null &
sleep 1
echo "started: process group $(cat /tmp/otb-experiment.pgid 2>/dev/null || echo '?'), log $log, results $out/"
