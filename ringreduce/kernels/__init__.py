"""The kernels layer, host side: the reduction ops and the C kernels that apply them
(`ops`, over ringreduce._native), zero-copy NumPy views of tensors and the dtype table
(`buffers`), reusable host memory (`scratch`). May import `core`."""
