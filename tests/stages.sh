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

# The numerically sensitive tests and notebooks run a second time as a CPU without native bf16 computes
# them (most laptops): torch's AVX2 kernels, and the Newton-Schulz dtype such a CPU's dtype="auto" takes.
# The CPU's flags ignore the kernel variables, hence DMUON_EDU_NS_DTYPE. Those notebooks run only so
# (4a runs Newton-Schulz only in the float32 or float64 its cells name: it runs natively).
EMULATED_AVX2=(env ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 DMUON_EDU_NS_DTYPE=float32)
EMULATED_TESTS=(tests/test_newton_schulz.py tests/test_muon.py tests/test_capstone.py tests/test_accumulation.py)
EMULATED_NOTEBOOKS=(solutions/04b_muon_optimizer.ipynb solutions/07_capstone.ipynb)
NATIVE_NOTEBOOKS=()
for notebook in solutions/*.ipynb; do
    [[ " ${EMULATED_NOTEBOOKS[*]} " == *" $notebook "* ]] || NATIVE_NOTEBOOKS+=("$notebook")
done
NBVAL=(-m pytest -q -p no:cacheprovider --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg)

stage "install" make --no-print-directory install
stage "chromium for the browser test" bash tests/install_chromium.sh
stage "unit tests" $PY -m pytest -q -m "not torchrun" tests
stage "torchrun scripts and distributed tests" $PY -m pytest -q -m torchrun tests
stage "solution notebooks (nbval)" $PY "${NBVAL[@]}" "${NATIVE_NOTEBOOKS[@]}"
emulated() {  # the machine as emulated (its bf16 matmul rate falls ~40x), then the tests, then the notebooks
    local rc=0
    "${EMULATED_AVX2[@]}" $PY -c 'import sys; sys.path.insert(0, "benchmarks"); import machine; print(machine.describe())' || rc=1
    "${EMULATED_AVX2[@]}" $PY -m pytest -q -p no:cacheprovider -m "not torchrun" "${EMULATED_TESTS[@]}" || rc=1
    "${EMULATED_AVX2[@]}" $PY "${NBVAL[@]}" "${EMULATED_NOTEBOOKS[@]}" || rc=1
    return $rc
}
stage "emulated AVX2 CPU: numerics, notebooks 04b and 07" emulated

echo
echo "stage                               seconds  result"
failed=0
for i in "${!names[@]}"; do
    printf '%-35s %7s  %s\n' "${names[$i]}" "${seconds[$i]}" "${results[$i]}"
    [ "${results[$i]}" = ok ] || failed=1
done
exit $failed
