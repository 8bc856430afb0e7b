"""What a non-editable install ships: a wheel built from the project, installed into a fresh
virtual environment outside the source tree, finds every CUDA kernel source the GPU path loads
(device_kernels.KERNEL_MODULES, through device_kernels.kernel_source, the text only: no GPU needed); the sdist
carries them too.

The build runs on a copy of what a build reads (pyproject.toml, README.md, ringreduce/,
native/), so it leaves the checkout untouched and concurrent runs do not share a build folder.
The fresh environment gets torch, NumPy and mpi4py from this one through a .pth file processed
after its own site-packages, so the wheel's ringreduce comes first (asserted), not the editable
install's source tree.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from ringreduce.gpu import device_kernels

ROOT = Path(__file__).resolve().parent.parent
BUILD_INPUTS = ("pyproject.toml", "README.md", "ringreduce", "native")
SHIPPED = {f"ringreduce/gpu/{device_kernels.KERNEL_DIR}/{name}.cu"
           for name in device_kernels.KERNEL_MODULES}

CHECK = """
import json, sys
from pathlib import Path
from importlib import resources
import ringreduce
from ringreduce.gpu import device_kernels
venv = Path(sys.prefix).resolve()
assert Path(ringreduce.__file__).resolve().is_relative_to(venv), ringreduce.__file__
found = {}
for name in device_kernels.KERNEL_MODULES:
    path = resources.files("ringreduce.gpu") / device_kernels.KERNEL_DIR / (name + ".cu")
    assert Path(str(path)).resolve().is_relative_to(venv), path
    found[name] = len(device_kernels.kernel_source(name).strip())
print(json.dumps({"file": ringreduce.__file__, "kernels": found}))
"""


def _run(*cmd, cwd=None, timeout=240):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={k: v for k, v in os.environ.items()
                                                if k not in ("PYTHONPATH", "PYTHONHOME")})
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The build's inputs, copied without build outputs (the editable install's _native)."""
    copy = tmp_path_factory.mktemp("build") / "ringreduce-src"
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, copy / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        else:
            copy.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    return copy


@pytest.mark.timeout(240)
def test_an_installed_wheel_finds_every_kernel_source(source, tmp_path):
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", wheels, source, cwd=tmp_path)
    [wheel] = wheels.glob("ringreduce-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert SHIPPED <= names, sorted(names)
    assert any(n.startswith("ringreduce/_native.") and n.endswith(".so") for n in names)
    assert not any(n.startswith("native/") or n.endswith((".c", ".h")) for n in names)

    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
         "--no-index", wheel, cwd=tmp_path)
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .strip())
    ours = sysconfig.get_paths()["purelib"]    # torch, NumPy, mpi4py: after the wheel's files
    (site / "zz_ringreduce_test_env.pth").write_text(f"import site; site.addsitedir({ours!r})\n")

    found = json.loads(_run(python, "-c", CHECK, cwd=tmp_path).strip().splitlines()[-1])
    assert Path(found["file"]).is_relative_to(venv), found
    assert set(found["kernels"]) == set(device_kernels.KERNEL_MODULES) and all(found["kernels"].values())


def test_the_sdist_carries_every_kernel_source(source, tmp_path):
    code = (f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))")
    name = _run(sys.executable, "-c", code, cwd=source).strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as archive:
        names = {member.split("/", 1)[1] for member in archive.getnames() if "/" in member}
    assert SHIPPED <= names and "native/constants.h" in names, sorted(names)
