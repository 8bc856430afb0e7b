"""The collectives layer: Horovod's tensor collectives (`collectives`), each collective's work
(`collective_work`), their autograd (`differentiable`), objects and model state (`objects`),
`SyncBatchNorm` and compression. May import every layer below: `core`, `kernels`, `gpu`,
`transport`, `sets`."""
