"""The torch.distributed backend "ringreduce": DDP, FSDP, torchmetrics and Lightning's `ddp`
strategy on ringreduce's process sets and transport.

Importing this module registers the backend with `torch.distributed.Backend.register_backend`
(the core package never imports it, so `import ringreduce` leaves torch.distributed alone).
Under `mpiexec`:

    import ringreduce.distributed
    ringreduce.distributed.init_process_group()     # ranks from MPI, no address or port to pick
    model = torch.nn.parallel.DistributedDataParallel(model)

`torch.distributed.init_process_group("ringreduce")` works too where the `env://` variables
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) are set, for instance by Lightning.

Groups: the default group is ringreduce's global set; `new_group(ranks)` opens a set of those
ranks by its members alone (`process_sets.open_group`: torch calls a backend on the members
only), labelled with torch's group name, which is unique and the same on every member;
`destroy_process_group` closes it. How each group runs torch's calls: group.py.
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..api.objects import allgather_object, broadcast_object
from ..core.errors import RingReduceError
from ..sets import world
from ..sets.process_set import global_process_set
from ..sets.process_sets import active, open_group
from .group import RingReduceGroup
from .group_base import BACKEND, DEVICES
from .point_to_point import Channel

_EXPORTED: dict[str, str] = {}  # the env:// variables init_process_group set, as it set them


# ---------------------------------------------------------------- creation

def _create(options: Any, backend_options: Any = None) -> RingReduceGroup:
    """torch's factory call (extended API): the default group on ringreduce's global set, a
    subgroup on a set of its members (collective over them only)."""
    world.init()
    ranks = list(options.global_ranks_in_group)
    rank, size = options.group_rank, options.group_size
    if not ranks:                               # the default group
        label, process_set = "the default group", global_process_set
        if size != world.size() or rank != world.rank():
            raise RingReduceError(
                f"ringreduce backend: torch.distributed was started as rank {rank} of {size}, "
                f"but MPI runs this process as rank {world.rank()} of {world.size()}; launch "
                "with mpiexec (one process per rank) and let "
                "ringreduce.distributed.init_process_group() set the ranks")
    else:
        if dist.get_world_size() != world.size() or dist.get_rank() != world.rank():
            raise RingReduceError(
                f"ringreduce backend: a group of ranks {ranks} needs torch.distributed's ranks "
                f"to be MPI's, but this process is torch rank {dist.get_rank()} of "
                f"{dist.get_world_size()} and MPI rank {world.rank()} of {world.size()}")
        label = f"torch group '{options.group_id}'"
        if ranks != sorted(ranks):      # (new_group(ranks, sort_ranks=False))
            raise RingReduceError(
                f"ringreduce backend: {label} lists its ranks out of order ({ranks}, "
                "new_group(..., sort_ranks=False)), which ranks them in that order; "
                "ringreduce's process sets rank their members in global order, as Horovod's, "
                "and would give every root, source and position the wrong rank: make the "
                "group with sort_ranks=True (the default)")
        process_set = open_group(ranks, label)
    ps = active(process_set, "the ringreduce backend")
    headers = ps.duplicate_comm(ps.call_order_name("dist.point_to_point"))
    data = ps.duplicate_comm(ps.call_order_name("dist.point_to_point"))
    return RingReduceGroup(rank, size, process_set,
                           Channel(headers, data, label, ps.transport.watch), label)


def _store(timeout: datetime.timedelta) -> dist.Store:
    """A TCPStore on rank 0 (a free port it picks), its address told to the others over MPI;
    MASTER_ADDR and MASTER_PORT are set to match, for libraries that read them. Every rank has
    connected before any returns: a rank whose init_process_group then fails (torch refusing
    an argument) drops its store, and rank 0's, the server, must outlive the others' connects,
    or they would wait in them until the timeout, and a retry with them."""
    hosts = allgather_object(socket.gethostname(), name="dist.init.hosts")
    host = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    rank, size = world.rank(), world.size()
    store = port = None
    if rank == 0:
        store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
        port = store.port
    port = broadcast_object(port, 0, name="dist.init.port")
    if rank != 0:
        store = dist.TCPStore(host, port, size, False, timeout=timeout)
    allgather_object(True, name="dist.init.connected")
    _EXPORTED.update(MASTER_ADDR=host, MASTER_PORT=str(port))
    os.environ.update(_EXPORTED)
    return store


def _tell_libraries() -> None:
    """The job as torchrun would describe it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    where the user set none), for the libraries that read it; and, on a machine without
    CUDA, ACCELERATE_USE_CPU, which makes Hugging Face Accelerate's default `Accelerator()`
    train on this group, every rank its part (without it, Accelerate takes a CPU job for one
    process and trains each rank alone)."""
    job = {"RANK": world.rank(), "WORLD_SIZE": world.size(), "LOCAL_RANK": world.local_rank(),
           "LOCAL_WORLD_SIZE": world.local_size()}
    if not torch.cuda.is_available():
        job["ACCELERATE_USE_CPU"] = "true"
    for name, value in job.items():
        if name not in os.environ or os.environ[name] == _EXPORTED.get(name):
            _EXPORTED[name] = os.environ[name] = str(value)


def init_process_group(timeout: Optional[datetime.timedelta] = None,
                       device_id: Optional[torch.device] = None, **settings: Any) -> None:
    """Start torch.distributed's default group on the ringreduce backend, with MPI's ranks:
    `ringreduce.init(**settings)` if it is not running, then
    `torch.distributed.init_process_group("ringreduce")`. Under mpiexec nothing else is needed:
    with MASTER_ADDR and MASTER_PORT set, torch's env:// rendezvous is used; otherwise rank 0
    opens torch's store on a free port and tells the others over MPI (and sets the env://
    variables to match; set again by a later call, they are not taken for the user's). Either
    way the job is then described to libraries as torchrun would (`_tell_libraries`), so that
    a default `accelerate.Accelerator()` trains on this group.
    `device_id`: torch's (this rank's accelerator, `torch.device("cuda", local_rank)`), passed
    on where given. Does nothing if torch.distributed is initialised already on this backend;
    another backend there is an error."""
    world.init(**settings)
    if dist.is_initialized():
        if dist.get_backend() != BACKEND:
            raise RingReduceError(f"ringreduce: torch.distributed is initialised already, on "
                                  f"{dist.get_backend()}; destroy_process_group() first")
        return
    timeout = timeout or datetime.timedelta(minutes=30)
    device = {} if device_id is None else {"device_id": device_id}
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT") and any(
            os.environ[name] != _EXPORTED.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")):
        dist.init_process_group(BACKEND, init_method="env://", rank=world.rank(),
                                world_size=world.size(), timeout=timeout, **device)
    else:
        dist.init_process_group(BACKEND, store=_store(timeout), rank=world.rank(),
                                world_size=world.size(), timeout=timeout, **device)
    _tell_libraries()


dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=list(DEVICES))
