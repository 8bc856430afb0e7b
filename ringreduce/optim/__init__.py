"""The optimizer layer: `DistributedOptimizer` and its life cycle (hooks, the bucket plan,
the step's agreement, sparse gradients, Adasum's deltas). May import every layer below, up to
`api`."""
