#!/usr/bin/env bash
# The suite behind `make test`: each stage in order, its time, and a summary.
# Every stage runs even when an earlier one fails, so one run shows everything.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

names=() seconds=() budgets=() results=() whole_ms=0
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
    whole_ms=$(( whole_ms + ms ))
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
# The CPU's flags ignore the kernel variables, hence DMUON_EDU_NS_DTYPE. Those notebooks run only so, on the
# two workers (4a runs Newton-Schulz only in the float32 or float64 its cells name: it runs natively).
EMULATED_AVX2=(env ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 DMUON_EDU_NS_DTYPE=float32)
EMULATED_TESTS=(tests/test_newton_schulz.py tests/test_muon.py tests/test_capstone.py tests/test_accumulation.py)
# 7b runs natively, with the launching notebooks: its program runs Newton-Schulz in float32 on either kernel set,
# and the record it leaves is what tests/test_capstone.py reads in the torchrun stage.
EMULATED_NOTEBOOKS=(solutions/04b_muon_optimizer.ipynb solutions/07a_capstone_problem.ipynb)
# Modules 5 to 7 launch ranks with torchrun: their notebooks run one at a time (the ranks take both
# cores). Modules 1 to 4 run in one process, mostly Python, on two workers.
IN_PROCESS_NOTEBOOKS=() LAUNCHING_NOTEBOOKS=()
for notebook in solutions/*.ipynb; do
    [[ " ${EMULATED_NOTEBOOKS[*]} " == *" $notebook "* ]] && continue
    case $notebook in solutions/0[5-7]*) LAUNCHING_NOTEBOOKS+=("$notebook") ;; *) IN_PROCESS_NOTEBOOKS+=("$notebook") ;; esac
done
PYTEST=(-m pytest -q -p no:cacheprovider --durations=10)
# tests/nbval_record.py keeps each executed notebook's raw outputs where DMUON_EDU_NBVAL_OUTPUTS names (below).
NBVAL=(--nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg -p tests.nbval_record)
# Two workers, one per core, for work that is single-threaded Python (most tests, Jupyter kernels).
# loadfile: each test file and each notebook on one worker, in order; tests/conftest.py's scheduler spreads
# the tests of the few costly files it names one by one over both workers.
TWO_WORKERS=(-n 2 --dist loadfile)
# One thread per worker (and per kernel a worker starts): with torch's default of one per core, two workers ran
# four on two cores, whose waits spin against each other (the numerics tests: 61 s instead of 155 s under load).
ONE_THREAD_EACH=(env OMP_NUM_THREADS=1)

# A fresh folder for this run, removed at the end: what one process of the run leaves for a later one
# (e.g. the launching notebooks' script results, read again by the torchrun tests) is never a stale copy
# from an earlier run. Name subfolders of it in exported variables, before the stage that writes them.
RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/dmuon_edu-test.XXXXXX")
trap 'rm -rf "$RUN_DIR"' EXIT
# One execution serves two checks: the notebooks' exercise-script reports (dmuon_edu.course.checks.check_script),
# which the module 5 and 6 torchrun tests read instead of launching the scripts again, and nbval's raw outputs
# of each notebook, which the determinism test (marked after_nbval) reads instead of executing notebook 1 again.
# Without a record of this run, those tests launch or execute for themselves.
export DMUON_EDU_SCRIPT_RESULTS=$RUN_DIR/scripts DMUON_EDU_NBVAL_OUTPUTS=$RUN_DIR/nbval

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

# Budgets: a fresh clone's time of each stage on a quiet 2-core machine (README, docs/benchmarks.md), with about
# 15% margin. The whole has its own: the standard of 600 s, which quiet runs land either side of (585-621 s), and
# the ceiling of 780 s that it must never pass (docs/benchmarks.md gives each stage's floor and why).
WHOLE_STANDARD=600 WHOLE_CEILING=780
# The order: the install; the in-process lane (two xdist workers); the serial lane (one process at a time:
# the hang guards, whose time must not be a neighbour's, and everything that launches ranks, which take
# both cores); the emulated CPU (its in-process part on two workers, its launching notebook alone).
stage "install, and chromium for the browser test" 55 install

# Unit tests and notebooks 1 to 4 in one pytest session: one start-up, and no worker idles while the
# other finishes a second session's tail. Neither hang guards (serial) nor launches (torchrun) run here.
stage "in-process: unit tests, notebooks 1-4 (2 workers)" 110 \
    "${ONE_THREAD_EACH[@]}" $PY "${PYTEST[@]}" "${NBVAL[@]}" "${TWO_WORKERS[@]}" -m "not torchrun and not serial and not after_nbval" \
    tests "${IN_PROCESS_NOTEBOOKS[@]}"

# The notebooks of modules 5 to 7b launch their scripts with torchrun: one at a time, before the torchrun
# tests, which read the scripts' reports they leave in RUN_DIR.
stage "launching notebooks 5-7b (nbval, one at a time)" 155 \
    $PY "${PYTEST[@]}" "${NBVAL[@]}" "${LAUNCHING_NOTEBOOKS[@]}"

# Launches, and the hang guards (marked serial) in the same process: no xdist worker beside either, and
# one collection of the test files instead of two; with them the tests that read the notebooks' records.
stage "torchrun tests and hang guards (serial)" 320 \
    $PY "${PYTEST[@]}" -m "torchrun or serial or after_nbval" tests

emulated() {  # the machine as emulated (its bf16 matmul rate falls ~40x), then the tests and notebooks
    local rc=0
    # The variables are set on each process at its start; xdist's workers and the kernels inherit them.
    "${EMULATED_AVX2[@]}" $PY -c 'import sys; sys.path.insert(0, "benchmarks"); import machine; print(machine.describe())' || rc=1
    "${EMULATED_AVX2[@]}" "${ONE_THREAD_EACH[@]}" $PY "${PYTEST[@]}" "${NBVAL[@]}" "${TWO_WORKERS[@]}" -m "not torchrun" \
        "${EMULATED_TESTS[@]}" "${EMULATED_NOTEBOOKS[@]}" || rc=1
    return $rc
}
stage "emulated AVX2 CPU: numerics and their notebooks" 90 emulated

echo
echo "stage                                                  seconds  budget  result"
failed=0
for i in "${!names[@]}"; do
    printf '%-52s %8s %7s  %s\n' "${names[$i]}" "${seconds[$i]}" "${budgets[$i]}" "${results[$i]}"
    [[ "${results[$i]}" == ok* ]] || failed=1
done
whole=$(( whole_ms / 1000 ))
if [ $whole -le $WHOLE_STANDARD ]; then verdict="within the standard of $WHOLE_STANDARD s"
elif [ $whole -le $WHOLE_CEILING ]; then verdict="over the standard of $WHOLE_STANDARD s, within the ceiling of $WHOLE_CEILING s"
else
    verdict="over the ceiling of $WHOLE_CEILING s"
    [ "${BUDGETS:-}" = strict ] && verdict="FAILED (over the ceiling of $WHOLE_CEILING s)" && failed=1
fi
printf '%-52s %8s %7s  %s\n' "the whole" "$whole" "$WHOLE_CEILING" "$verdict"
exit $failed
