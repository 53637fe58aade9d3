#!/usr/bin/env bash
# The suite behind `make test`: each stage in order, its time, and a summary.
# Every stage runs even when an earlier one fails, so one run shows everything.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

names=() seconds=() budgets=() results=()
# stage NAME BUDGET COMMAND...: BUDGET is the stage's seconds on a quiet 2-core machine, with margin
# (the README gives the measured times); a stage over it is reported, and fails the suite only when
# BUDGETS=strict, since a loaded machine is slower and its verdict would be about the load.
stage() {
    local name=$1 budget=$2; shift 2
    echo
    echo "=== stage: $name (budget $budget s)"
    local start=$(date +%s%N)
    "$@"
    local rc=$?
    local ms=$(( ($(date +%s%N) - start) / 1000000 ))
    names+=("$name") budgets+=("$budget") seconds+=("$(printf '%d.%01d' $((ms / 1000)) $((ms % 1000 / 100)))")
    local result=$([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)")
    if [ $rc -eq 0 ] && [ $((ms / 1000)) -ge "$budget" ]; then
        result="ok, over its budget"
        [ "${BUDGETS:-}" = strict ] && result="FAILED (over its budget of $budget s)"
    fi
    results+=("$result")
    echo "=== $name: ${seconds[-1]} s of $budget, ${results[-1]}"
}

# Each pytest run lists its 10 costliest tests or cells (docs/benchmarks.md keeps a table of them).
# The numerically sensitive tests and notebooks run a second time as a CPU without native bf16 computes
# them (most laptops): torch's AVX2 kernels, and the Newton-Schulz dtype such a CPU's dtype="auto" takes.
# The CPU's flags ignore the kernel variables, hence DMUON_EDU_NS_DTYPE. Those notebooks run only so
# (4a runs Newton-Schulz only in the float32 or float64 its cells name: it runs natively).
EMULATED_AVX2=(env ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 DMUON_EDU_NS_DTYPE=float32)
EMULATED_TESTS=(tests/test_newton_schulz.py tests/test_muon.py tests/test_capstone.py tests/test_accumulation.py)
EMULATED_NOTEBOOKS=(solutions/04b_muon_optimizer.ipynb solutions/07_capstone.ipynb)
# Modules 5 to 7 launch ranks with torchrun: their notebooks run one at a time (the ranks take both
# cores). Modules 1 to 4 run in one process, mostly Python, on two workers.
IN_PROCESS_NOTEBOOKS=() LAUNCHING_NOTEBOOKS=()
for notebook in solutions/*.ipynb; do
    [[ " ${EMULATED_NOTEBOOKS[*]} " == *" $notebook "* ]] && continue
    case $notebook in solutions/0[5-7]*) LAUNCHING_NOTEBOOKS+=("$notebook") ;; *) IN_PROCESS_NOTEBOOKS+=("$notebook") ;; esac
done
NBVAL=(-m pytest -q -p no:cacheprovider --durations=10 --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg)

# chromium's apt-get and pip's install wait on disk and network, not on each other: run them side by side.
install() {
    local chromium_log rc
    chromium_log=$(mktemp)
    bash tests/install_chromium.sh >"$chromium_log" 2>&1 &
    local chromium=$!
    make --no-print-directory install
    rc=$?
    wait $chromium
    echo "chromium for the browser test: $(tail -n 1 "$chromium_log")"
    rm -f "$chromium_log"
    return $rc
}
# Unit tests are mostly single-threaded Python: two xdist workers, one per core, a file per worker at a time
# (module fixtures are built once). Hang guards (marked serial) run after them, alone, so that the time
# they assert is not the time of a test beside them.
unit() {
    local rc=0
    $PY -m pytest -q -p no:cacheprovider --durations=10 -n 2 --dist loadfile -m "not torchrun and not serial" tests || rc=1
    $PY -m pytest -q -p no:cacheprovider -m "serial and not torchrun" tests || rc=1
    return $rc
}

stage "install, and chromium for the browser test" 150 install
stage "unit tests" 120 unit
stage "torchrun scripts and distributed tests" 200 $PY -m pytest -q -p no:cacheprovider --durations=10 -m torchrun tests
nbval() {
    local rc=0
    $PY "${NBVAL[@]}" -n 2 --dist loadfile "${IN_PROCESS_NOTEBOOKS[@]}" || rc=1
    $PY "${NBVAL[@]}" "${LAUNCHING_NOTEBOOKS[@]}" || rc=1
    return $rc
}
stage "solution notebooks (nbval)" 180 nbval
emulated() {  # the machine as emulated (its bf16 matmul rate falls ~40x), then the tests, then the notebooks
    local rc=0
    "${EMULATED_AVX2[@]}" $PY -c 'import sys; sys.path.insert(0, "benchmarks"); import machine; print(machine.describe())' || rc=1
    "${EMULATED_AVX2[@]}" $PY -m pytest -q -p no:cacheprovider -m "not torchrun" "${EMULATED_TESTS[@]}" || rc=1
    "${EMULATED_AVX2[@]}" $PY "${NBVAL[@]}" "${EMULATED_NOTEBOOKS[@]}" || rc=1
    return $rc
}
stage "emulated AVX2 CPU: numerics and their notebooks" 100 emulated

echo
echo "stage                                                  seconds  budget  result"
failed=0
for i in "${!names[@]}"; do
    printf '%-52s %8s %7s  %s\n' "${names[$i]}" "${seconds[$i]}" "${budgets[$i]}" "${results[$i]}"
    [[ "${results[$i]}" == ok* ]] || failed=1
done
exit $failed
