"""The ways an allreduce can go, as one ordered table: each way says whether it takes a request
(`applies`) and moves its bytes (`run`), and the transport runs the first that applies, as
Horovod's OperationManager runs the first enabled op and NCCL picks from its transport list. A
new data path is one more class (on way.py's interface: host_ways.py, gpu_ways.py) and one line
in `allreduce_ways`.

A set's table holds only the ways its topology allows (built once), so `applies` looks at the
request alone. In order:

    Adasum          op=Adasum: Horovod's Adasum over the set's ranks (adasum.py)
    GPU node        a CUDA tensor, where the set's nodes hold several members each: the
                    node's device memory shared through CUDA IPC, reduced by our kernels;
                    between nodes, each rank's slice by the next two ways' means
                    (peer_node.py); where IPC fails, the next one
    CUDA-aware      a CUDA tensor, MPI reading device memory (or a set of one): our ring on
                    device memory (gpu/device_kernels.py)
    staged GPU      a CUDA tensor otherwise: pieces through pinned host memory, each piece
                    reduced by the host ways below
    alone           a set of one rank: copy and scale
    between nodes   several nodes, small: the node's slots, then recursive doubling between the
                    nodes, the signature in the same messages (crossnode.py; a power-of-two
                    number of nodes with as many members each)
    node slots      members share nodes, small: one shared-memory slot per rank, in C (shm.py,
                    native/node.c); on one node its exchange carries the signature; across
                    nodes, then our ring between nodes
    node blocks     members share nodes: cache-sized shared-memory blocks; across nodes, our
                    ring between nodes on each reduced chunk
    MPI gather      no shared memory, small: MPI gather and reduce in rank order (ring.py)
    MPI ring        no shared memory: our segmented ring reduce-scatter + allgather (ring.py)

The GPU way comes before the host ways, so those see CPU tensors only. A way whose one exchange
carries the signature with the data (`carries_signature`, way.py) also serves the small way's
fast path (small_way.py).
"""
from __future__ import annotations

from .gpu_ways import CudaAware, StagedGpu
from .peer_node import PeerMemory
from .host_ways import (Adasum, Alone, BetweenNodesSmall, MpiGather, MpiRing, NodeBlocks,
                        NodeSlots, NodeSlotsOnOneNode)
from .way import Pieces, SetParts, Way


def allreduce_ways(parts: SetParts, pieces: Pieces) -> list[Way]:
    """A set's table, in order, with the ways its topology allows. `pieces(spec)`: how the
    staged GPU way reduces each piece (by this table's host ways)."""
    ways: list[Way] = [Adasum(parts)]
    gpu = (CudaAware(parts) if parts.settings.cuda_aware or parts.size == 1
           else StagedGpu(parts, pieces))
    if (parts.local.size > 1 and parts.homogeneous
            and parts.settings.gpu_node_way != "staging"):
        gpu = PeerMemory(parts, gpu)
    ways.append(gpu)
    if parts.size == 1:
        return ways + [Alone(parts)]
    if parts.between is not None:
        ways.append(BetweenNodesSmall(parts))
    if parts.node is not None:
        slots = NodeSlotsOnOneNode(parts) if parts.one_node else NodeSlots(parts)
        return ways + [slots, NodeBlocks(parts)]
    return ways + [MpiGather(parts), MpiRing(parts)]
