"""torch.compile and ringreduce (ringreduce/core/compile_boundary.py): dynamo skips our files in
either import order, and compiled code that reaches them runs under a real mpiexec."""
import subprocess
import sys

from conftest import run_ok


def test_dynamo_imported_first_skips_ringreduce_too():
    """The other order than the launch below: dynamo's rules loaded before ringreduce."""
    code = ("import torch._dynamo.trace_rules as rules, ringreduce; "
            "print(rules.check_file(ringreduce.api.collectives.__file__).skipped)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "True", result.stdout + result.stderr[-3000:]


def test_compiled_code_reaching_ringreduce_runs_it_eagerly():
    """A compiled forward with SyncBatchNorm and an allreduce, and a compiled DDP on the
    "ringreduce" backend, also under compiled autograd, as is DistributedOptimizer, at 2
    ranks (ringreduce imported before dynamo)."""
    run_ok(2, "compile_check.py", timeout=300)
