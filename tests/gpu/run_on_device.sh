#!/usr/bin/env bash
# The GPU tests and the device benchmark, on a machine with a CUDA GPU, in under 8 minutes.
#
#   OUT=/some/dir tests/gpu/run_on_device.sh        (default OUT: ./gpu-results; PYTHON: python3)
#
# Installs nothing from the network: ringcomm itself goes in with pip --no-deps --no-index (cupy, numba-cuda,
# torch, pytest, numpy, numba and ml_dtypes must already be there). Writes under $OUT: env.txt (machine and
# versions), install.log, gpu-tests.txt and .xml, gpu-tests-hostsync.txt (only when tests failed: the failed
# ones again with RINGCOMM_CUDA_IPC_SYNC=1, which tells a protocol fault from an IPC-event fault), bench.txt
# and .json, summary.txt. Where there is no GPU everything skips and it exits 0.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-results}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
start=$(date +%s)

{
    date -u; uname -a
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("numpy", "numba", "numba_cuda", "ml_dtypes", "cupy", "torch", "pytest", "pytest_timeout"):
    try:
        print(f"{name:15s}", getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:
        print(f"{name:15s} MISSING ({type(e).__name__}: {e})")
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for need in numpy numba ml_dtypes pytest; do
    "$PY" -c "import $need" 2>/dev/null || { echo "cannot run: $PY has no $need (see $OUT/env.txt)" | tee "$OUT/summary.txt"; exit 2; }
done

# ringcomm, editable and offline. If that fails (an old setuptools), run from a copy of the tree laid out as
# installed (kernels/ and transport/ inside ringcomm/), so that the checkout's own ringcomm/ cannot shadow it.
if ! "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1; then
    copy="$(mktemp -d)"
    echo "pip install failed (see $OUT/install.log); running from an installed-layout copy in $copy"
    cp -r ringcomm tests pyproject.toml "$copy/"
    cp -r kernels "$copy/ringcomm/kernels"; cp -r transport "$copy/ringcomm/transport"
    cd "$copy"
fi
"$PY" -c "import ringcomm, ringcomm.kernels.device, ringcomm.transport.cuda_ipc; print('ringcomm from', ringcomm.__file__)" \
    2>&1 | tee -a "$OUT/install.log"

# The GPU tests (the tests' own deadlines stop a hang; this timeout is the last resort).
timeout -k 10 270 "$PY" -m pytest -m gpu tests/gpu -v -rs -o cache_dir="$OUT/.pytest_cache" \
    --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.txt"
tests_rc=${PIPESTATUS[0]}
if [ "$tests_rc" -ne 0 ] && [ "$tests_rc" -ne 5 ]; then
    RINGCOMM_CUDA_IPC_SYNC=1 timeout -k 10 60 "$PY" -m pytest -m gpu tests/gpu -v -rs --lf \
        -o cache_dir="$OUT/.pytest_cache" 2>&1 | tee "$OUT/gpu-tests-hostsync.txt"
fi

# The benchmark: 1 MiB, 64 MiB, 1 GiB on 2 and 4 ranks sharing GPU 0, and the copy ceiling.
timeout -k 10 120 "$PY" tests/gpu/bench_device.py --ranks 2 4 --sizes 1MiB 64MiB 1GiB --out "$OUT/bench.json" \
    2>&1 | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}

echo "gpu tests exit $tests_rc (5: none collected), benchmark exit $bench_rc, $(( $(date +%s) - start )) s" \
    | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
