"""The kernels layer, device side: CuPy views of CUDA tensors, streams and events, pinned
staging, each set's device scratch, our CUDA kernels (compiled at run time by CuPy), and
whether MPI reads device memory (`cuda_aware`). May import `core` and `kernels`."""
