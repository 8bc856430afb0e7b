"""What the benchmark scripts share: starting torch.distributed's gloo next to MPI."""
import datetime
import os
import socket

from mpi4py import MPI


def init_gloo(comm=MPI.COMM_WORLD) -> None:
    """torch.distributed with gloo over loopback, ranks as in `comm` (a free port from rank 0)."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size, timeout=datetime.timedelta(minutes=5))
