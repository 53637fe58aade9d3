#!/usr/bin/env bash
# The suite behind `make test`: each stage in order, its time, and a summary.
# Every stage runs even when an earlier one fails, so one run shows everything.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

names=() seconds=() results=()
stage() {
    local name=$1; shift
    echo
    echo "=== stage: $name"
    local start=$(date +%s%N)
    "$@"
    local rc=$?
    local ms=$(( ($(date +%s%N) - start) / 1000000 ))
    names+=("$name") seconds+=("$(printf '%d.%01d' $((ms / 1000)) $((ms % 1000 / 100)))")
    results+=("$([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)")")
    echo "=== $name: ${seconds[-1]} s, ${results[-1]}"
}

stage "install" make --no-print-directory install
stage "chromium for the browser test" bash tests/install_chromium.sh
stage "unit tests" $PY -m pytest -q -m "not torchrun" tests
stage "torchrun scripts and distributed tests" $PY -m pytest -q -m torchrun tests
stage "solution notebooks (nbval)" $PY -m pytest -q -p no:cacheprovider --nbval --nbval-current-env \
    --nbval-sanitize-with tests/nbval_sanitize.cfg solutions

echo
echo "stage                               seconds  result"
failed=0
for i in "${!names[@]}"; do
    printf '%-35s %7s  %s\n' "${names[$i]}" "${seconds[$i]}" "${results[$i]}"
    [ "${results[$i]}" = ok ] || failed=1
done
exit $failed
