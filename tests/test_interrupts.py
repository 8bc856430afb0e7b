"""An interrupt stays an interrupt (issue 56): a real SIGINT to rank 0 while it waits on an
asynchronous collective, and a KeyboardInterrupt in a compressor's decompress on the engine
thread, reach the caller as KeyboardInterrupt; every rank goes on after."""
import pytest

from conftest import shared_script


@shared_script("interrupts", "interrupt_check.py", timeout=lambda n: 120)
@pytest.mark.parametrize("n", [2, 3])
def test_an_interrupt_reaches_the_waiter_as_itself(n, shared_run):
    shared_run()
