"""The transport layer: how the bytes of one process set's collectives move. The ways (the
node's shared memory in slots and blocks, between nodes, the MPI gather, the ring, Adasum,
the GPU ways), one table per collective that picks the first that applies, the signature
check and matching by name, the stall watch. May import `core`, `kernels` and `gpu`."""
