#!/usr/bin/env bash
# The device check: stages C0-C5 on a machine with a CUDA GPU, in under 7 minutes on a bare H200.
#
#   OUT=/some/dir tests/gpu/run_on_device.sh        (default OUT: ./gpu-results; PYTHON: python3)
#   BUDGET=300 STAGES="C1 C5" tests/gpu/run_on_device.sh   (a shorter rerun of some stages)
#
# Installs nothing from the network: ringcomm goes in with pip --no-deps --no-index (cupy, numba-cuda, torch,
# pytest, numpy, numba and ml_dtypes must already be there). Each stage has its own timeout (cut to what is
# left of the 400 s budget) and writes its result file under $OUT as soon as it ends (8 files in all):
#   env.txt   machine, versions, install            C0.txt  raw CUDA IPC + stream memory ops, no ringcomm
#   C1.txt    slot protocol under lag (500 ms), cuda_ipc and staged over tcp by the proxy thread
#                                                    C2.txt  kernels bit-exact on the GPU (sm_90 on an H200)
#   C3.txt    host us per slice vs GPU time; busbw against a device-to-device copy, 1 MiB .. 1 GiB;
#             where the host's time per slice goes (a cProfile, and each CUDA primitive's cost)
#   C4.txt    a rank killed mid-collective           C5.txt  a subset of the collective matrix, cupy/torch/numba
#   summary.txt  one line per stage
# Kernels are compiled once per process (numba keeps them in memory; closures cannot use its disk cache).
# Where there is no GPU every stage is skipped, the reason written, and the script exits 0 within seconds.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-results}"
PY="${PYTHON:-python3}"
BUDGET="${BUDGET:-400}"
STAGES="${STAGES:-C0 C1 C2 C3 C4 C5}"          # a rerun can leave out the stages that passed
mkdir -p "$OUT"
export PIP_NO_INDEX=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
start=$(date +%s)
: > "$OUT/summary.txt"

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

why=$("$PY" -c "import sys; sys.path.insert(0, 'tests/gpu'); from gpu_common import unavailable; print(unavailable() or '')" 2>&1)
if [ -n "$why" ]; then
    echo "no GPU here: $why" > "$OUT/env.txt"
    for s in C0 C1 C2 C3 C4 C5; do note "$s skipped: $why"; done
    exit 0
fi

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
    # ringcomm, editable and offline; else run from a copy laid out as installed.
    if ! "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3; then
        copy="$(mktemp -d)"
        cp -r ringcomm tests pyproject.toml "$copy/"
        cp -r kernels "$copy/ringcomm/kernels"; cp -r transport "$copy/ringcomm/transport"
        echo "pip install failed: running from an installed-layout copy in $copy"
        echo "$copy" > /tmp/ringcomm-copy
    fi
} > "$OUT/env.txt" 2>&1
[ -f /tmp/ringcomm-copy ] && cd "$(cat /tmp/ringcomm-copy)"
"$PY" -c "import ringcomm.transport.cuda_ipc; print('ringcomm from', ringcomm.__file__)" >> "$OUT/env.txt" 2>&1
# GPUDirect RDMA: reported, never used (device slices to other hosts are staged through host memory).
"$PY" -c "from ringcomm.transport import cuda_rt; from ringcomm.transport.cuda_staged import gpudirect
rt = cuda_rt.get(); print(gpudirect(rt, rt.get_device()))" 2>&1 | tee -a "$OUT/env.txt" | sed 's/^/env: /' >> "$OUT/summary.txt"

# stage NAME SECONDS COMMAND...: run with a timeout (cut to the budget left), output to $OUT/NAME.txt.
stage() {
    local name=$1 limit=$2; shift 2
    case " $STAGES " in *" $name "*) ;; *) note "$name not asked for (STAGES=$STAGES)"; return ;; esac
    local left=$(( BUDGET - ($(date +%s) - start) ))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 10 ]; then note "$name skipped: the ${BUDGET} s budget is spent"; return; fi
    local t0=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    local verdict=passed
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT after ${limit} s"
    [ $rc -ne 0 ] && [ "$verdict" = passed ] && verdict="FAILED (exit $rc)"
    note "$name $verdict in $(( $(date +%s) - t0 )) s"
}

PYTEST=("$PY" -m pytest -p no:cacheprovider -m gpu -rs -q)
# The issue's order (C0 .. C5); a stage cut short by the budget is a later one.
stage C0 40  "$PY" tests/gpu/stage_c0_ipc.py
stage C1 80  "${PYTEST[@]}" tests/gpu/test_gpu_stages.py -k c1 -s
stage C2 90  "${PYTEST[@]}" -n 4 tests/gpu/test_gpu_kernels.py
stage C3 100 bash -c "rc=0
    '$PY' tests/gpu/bench_device.py --ranks 2 4 --sizes 1MiB 16MiB 64MiB 256MiB 1GiB || rc=1
    '$PY' tests/gpu/bench_device.py --ranks 2 --sizes 16MiB --profile || rc=1
    '$PY' tests/gpu/host_costs.py || rc=1
    NUMBA_ENABLE_CUDASIM=1 '$PY' tests/gpu/host_overhead.py || rc=1
    exit \$rc"
stage C4 60  "${PYTEST[@]}" tests/gpu/test_gpu_stages.py -k c4 -s
stage C5 100 "${PYTEST[@]}" -n 3 tests/gpu/test_gpu_collectives.py tests/gpu/test_gpu_torch.py -k "n2-small or buffer_on_another or stream_rule or torch_cuda or batch_isend"

note "total $(( $(date +%s) - start )) s"
! grep -q "FAILED\|TIMED OUT" "$OUT/summary.txt"
