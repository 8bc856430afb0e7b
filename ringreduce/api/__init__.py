"""The collectives layer: Horovod's tensor collectives (`collectives`), the one allreduce
dispatch (`small_path`), each collective's work (`arguments`, `work`, `reductions`,
`movements`), their autograd (`differentiable`), objects and model state (`objects`),
`SyncBatchNorm` and compression. May import every layer below: `core`, `kernels`, `gpu`,
`transport`, `sets`."""
