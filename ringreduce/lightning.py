"""`RingReduceStrategy`: ringreduce under PyTorch Lightning 2.x, `Trainer(strategy="ringreduce")`.

Lightning 2 dropped its Horovod strategy; this is its successor on our collectives. Launch with
`mpiexec -n N python train.py`, one process per device; started as `python train.py` with
`devices=N`, the script runs itself again on N ranks under mpiexec (lightning_launch.py). Importing this module registers the
strategy name with each Lightning package that is installed: `lightning` (`lightning.pytorch`)
and the standalone `pytorch_lightning`. Each has its own Trainer, registry and base classes, so
the classes are built once per package from the one definition in `strategy_classes`:
`RingReduceStrategy`, `RingReduceEnvironment` and `RingReduceSyncBatchNorm` here are
`lightning.pytorch`'s (`pytorch_lightning`'s when only that one is installed), and
`pl.RingReduceStrategy` (and `pl.RingReduceEnvironment`, `pl.RingReduceSyncBatchNorm`) are
`pytorch_lightning`'s (`pl` is None without it). The core package never imports this module
(Lightning is the optional extra `ringreduce[lightning]`).

What the strategy does, in Lightning's terms:
- ranks: from ringreduce (`RingReduceEnvironment`), so Lightning's rank-zero logging,
  samplers and checkpoints agree with our collectives;
- setup: parameters and buffers broadcast from rank 0 (before Lightning restores the optimizer
  state from a checkpoint, which every rank reads), every optimizer wrapped in
  `DistributedOptimizer` (accumulate_grad_batches -> backward_passes_per_step; LR
  schedulers keep working, see DistributedOptimizer) and any state it already has broadcast;
- each optimizer step: the closure's backward feeds the buckets, `synchronize()` waits for
  them before Lightning's hooks read the gradients (`on_after_backward`, clipping, AMP's
  unscale), then the wrapped optimizer steps inside `skip_synchronize()`. Manual
  optimization: a `manual_backward` that completes an optimizer's gradients synchronizes it
  (as DDP's gradients are final after backward), so clipping before `opt.step()` reads
  averages; `opt.step()` then steps as above;
- reduce / all_gather / broadcast / barrier for metrics (`self.log(..., sync_dist=True)`) and
  callbacks; checkpoints are written by rank 0 only;
- torch.distributed's default group, on the "ringreduce" backend (ringreduce.distributed),
  started at setup unless one runs already, so that torchmetrics' `Metric` objects sync over
  our transport too;
- `Trainer(sync_batchnorm=True)` swaps BatchNorm layers for our `SyncBatchNorm` while fitting.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
from types import SimpleNamespace
from typing import Any, Callable, Optional, Union

import torch

from . import distributed
from .api.collectives import Average, Max, Min, Product, Sum, allgather, allreduce, barrier
from .api.compression import Compression, Compressor
from .api.objects import broadcast_object, broadcast_parameters
from .api.sync_batch_norm import SyncBatchNorm
from .core.errors import UsageError
from .lightning_launch import launcher_class, needs_launching
from .distributed.group import RingReduceGroup
from .optim.adasum_optimizer import AdasumOptimizer
from .optim.optimizer import DistributedOptimizer
from .optim.optimizer_state import broadcast_optimizer_state
from .optim.wrapped_optimizer import WrappedOptimizer
from .sets import world
from .sets.process_set import ProcessSet, global_process_set

# Each Lightning package that can be installed, with the fabric package it builds on.
PACKAGES = {"lightning.pytorch": "lightning.fabric", "pytorch_lightning": "lightning_fabric"}

_OPS = {"mean": Average, "avg": Average, "sum": Sum, "max": Max, "min": Min,
        "product": Product, "prod": Product}


def strategy_classes(package: str) -> SimpleNamespace:
    """RingReduceEnvironment, RingReduceSyncBatchNorm and RingReduceStrategy built on
    `package` ("lightning.pytorch" or "pytorch_lightning", one of PACKAGES), which must be
    installed: the same classes for each, on that package's base classes."""
    fabric = PACKAGES[package]
    MPIEnvironment = importlib.import_module(f"{fabric}.plugins.environments").MPIEnvironment
    TorchReduceOp = importlib.import_module(f"{fabric}.utilities.distributed").ReduceOp
    reset_seed = importlib.import_module(f"{fabric}.utilities.seed").reset_seed
    layer_sync = importlib.import_module(f"{package}.plugins.layer_sync")
    LayerSync, TorchSyncBatchNorm = layer_sync.LayerSync, layer_sync.TorchSyncBatchNorm
    ParallelStrategy = importlib.import_module(f"{package}.strategies").ParallelStrategy
    TrainerFn = importlib.import_module(f"{package}.trainer.states").TrainerFn
    rank_zero_only = importlib.import_module(f"{package}.utilities.rank_zero").rank_zero_only
    LightningModule = importlib.import_module(package).LightningModule
    rank_zero_info = importlib.import_module(f"{package}.utilities.rank_zero").rank_zero_info
    MpiScriptLauncher = launcher_class(
        importlib.import_module(f"{package}.strategies.launchers.launcher")._Launcher)

    class RingReduceEnvironment(MPIEnvironment):
        """Lightning's MPI environment with ranks and nodes as ringreduce sees them (its node
        split, which `RINGREDUCE_SIMULATED_NODES` can change, rather than host names)."""

        def world_size(self) -> int:
            return world.size()

        def global_rank(self) -> int:
            return world.rank()

        def local_rank(self) -> int:
            return world.local_rank()

        def node_rank(self) -> int:
            return world.cross_rank()

    class RingReduceSyncBatchNorm(LayerSync):
        """`Trainer(sync_batchnorm=True)` under this strategy: ringreduce's SyncBatchNorm."""

        def apply(self, model: torch.nn.Module) -> torch.nn.Module:
            return SyncBatchNorm.convert_sync_batchnorm(model)

        def revert(self, model: torch.nn.Module) -> torch.nn.Module:
            return SyncBatchNorm.revert_sync_batchnorm(model)

    class RingReduceStrategy(ParallelStrategy):
        """Data-parallel training with ringreduce's DistributedOptimizer, one process per
        device.

        The keyword arguments are DistributedOptimizer's, applied to every optimizer (all
        ranks train: the samplers shard the data over the whole job).
        `backward_passes_per_step` defaults to the Trainer's `accumulate_grad_batches`; set it
        for manual optimization that accumulates over several `manual_backward` calls.
        """

        strategy_name = "ringreduce"
        num_nodes = 1       # (the Trainer's num_nodes, set by its connector)

        def __init__(self, accelerator=None, parallel_devices=None, checkpoint_io=None,
                     precision_plugin=None, compression: type[Compressor] = Compression.none,
                     op: Any = Average, gradient_predivide_factor: float = 1.0,
                     backward_passes_per_step: Optional[int] = None,
                     sparse_as_dense: bool = False, gradient_as_bucket_view: bool = False) -> None:
            world.init()
            super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                             cluster_environment=RingReduceEnvironment(),
                             checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
            self._optimizer_options = dict(
                compression=compression, op=op, gradient_predivide_factor=gradient_predivide_factor,
                sparse_as_dense=sparse_as_dense, gradient_as_bucket_view=gradient_as_bucket_view)
            self._backward_passes = backward_passes_per_step
            self._stepping: Optional[torch.optim.Optimizer] = None   # inside optimizer_step
            self._reduced: set[int] = set()     # optimizers synchronized by backward, unstepped

        # ------------------------------------------------------------ where this rank runs

        def _configure_launcher(self) -> None:
            """Never one process alone where devices/num_nodes ask for more (lightning_launch)."""
            processes = len(self.parallel_devices or ()) or 1
            if needs_launching(processes, self.num_nodes):
                self._launcher = MpiScriptLauncher(processes, rank_zero_info)

        @property
        def root_device(self) -> torch.device:
            """CPU, or this rank's GPU: the only one it sees (a launcher that sets
            CUDA_VISIBLE_DEVICES per rank), else the one at its local rank."""
            devices = self.parallel_devices or [torch.device("cpu")]
            if devices[0].type == "cpu" or len(devices) == 1:
                return devices[0]
            if world.local_rank() >= len(devices):
                raise UsageError(
                    f"ringreduce: rank {world.rank()} has local rank {world.local_rank()} but "
                    f"the Trainer was given {len(devices)} devices on this node; launch at "
                    "most one process per device, or pass devices= with one per process")
            return devices[world.local_rank()]

        @property
        def is_distributed(self) -> bool:
            """True: the Trainer then adds distributed samplers and honours sync_dist."""
            return True

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return {"num_replicas": world.size(), "rank": world.rank()}

        def set_world_ranks(self) -> None:
            """Called by the Trainer as it is built: rank-zero-only logging from here on."""
            rank_zero_only.rank = world.rank()

        def setup_environment(self) -> None:
            reset_seed()          # the seed seed_everything() chose, as the DDP strategy does
            self.set_world_ranks()
            if not torch.distributed.is_initialized():
                # torchmetrics' Metric objects (and libraries like it) sync through
                # torch.distributed's default group: ours, on the ringreduce backend.
                distributed.init_process_group()
            super().setup_environment()

        def model_to_device(self) -> None:
            assert self.model is not None
            self.model.to(self.root_device)

        # ------------------------------------------------------------ setup and teardown

        def setup(self, trainer: Any) -> None:
            if isinstance(self._layer_sync, TorchSyncBatchNorm):   # sync_batchnorm=True
                self._layer_sync = RingReduceSyncBatchNorm()
            fitting = trainer.state.fn == TrainerFn.FITTING
            if fitting and self._layer_sync is not None:
                assert self.model is not None
                self.model = self._layer_sync.apply(self.model)
            super().setup(trainer)
            assert self.model is not None
            broadcast_parameters(self.model.state_dict(), root_rank=0)
            if fitting:
                for optimizer in self.optimizers:
                    # Only state the optimizer already has (one configure_optimizers filled
                    # in): before the first step there is none, and broadcast_optimizer_state
                    # then follows Horovod, zeroing every gradient and stepping once to
                    # create it, which moves parameters under weight decay; training must
                    # match one process. Every rank agrees: the optimizers are built alike,
                    # and a checkpoint's state is restored after setup, on every rank.
                    if optimizer.state:
                        broadcast_optimizer_state(optimizer, root_rank=0)

        def setup_optimizers(self, trainer: Any) -> None:
            super().setup_optimizers(trainer)
            passes = self._backward_passes or trainer.accumulate_grad_batches
            self.optimizers = [self._wrap(optimizer, passes) for optimizer in self.optimizers]

        def _wrap(self, optimizer: torch.optim.Optimizer, passes: int) -> torch.optim.Optimizer:
            if isinstance(optimizer, WrappedOptimizer):
                return optimizer
            assert self.lightning_module is not None
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            params = [p for group in optimizer.param_groups for p in group["params"]]
            named = [(names.get(id(p), f"unnamed.{i}"), p) for i, p in enumerate(params)]
            return DistributedOptimizer(optimizer, named_parameters=named,
                                        backward_passes_per_step=passes, **self._optimizer_options)

        def teardown(self) -> None:
            """The optimizers' gradient hooks go (the model may train on without them), and
            BatchNorm layers are given back."""
            for optimizer in self.optimizers:
                release = getattr(optimizer, "release", None)
                if release is not None:
                    release()
            module = self.lightning_module
            if (module is not None and module._trainer is not None
                    and module.trainer.state.fn == TrainerFn.FITTING and self._layer_sync):
                assert self.model is not None
                self.model = self._layer_sync.revert(self.model)
            super().teardown()

        # ------------------------------------------------------------ the optimizer step

        def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                           model: Optional[Union[LightningModule, torch.nn.Module]] = None,
                           **kwargs: Any) -> Any:
            """The closure's backward (the step's last pass) is followed by `synchronize()`, in
            `backward` below, so that everything after it reads averaged gradients; the wrapped
            optimizer then steps without synchronizing again."""
            if not hasattr(optimizer, "synchronize") or isinstance(optimizer, AdasumOptimizer):
                # Adasum combines parameter deltas at step() (no synchronize, as in Horovod).
                return super().optimizer_step(optimizer, closure, model, **kwargs)

            def closure_then_synchronize() -> Any:
                result = closure()
                if id(optimizer) not in self._reduced:   # backward did not (none ran): meet
                    optimizer.synchronize()             # the other ranks' step all the same
                return result

            self._stepping = optimizer
            try:
                with optimizer.skip_synchronize():
                    return super().optimizer_step(optimizer, closure_then_synchronize, model,
                                                  **kwargs)
            finally:
                self._stepping = None
                self._reduced.discard(id(optimizer))

        def backward(self, closure_loss: torch.Tensor, optimizer: Optional[torch.optim.Optimizer],
                     *args: Any, **kwargs: Any) -> torch.Tensor:
            """Lightning's backward, with `synchronize()` right after the last pass before a step:
            before `on_after_backward`, gradient clipping and AMP's unscale read the gradients
            (as after DDP's backward). In manual optimization, every optimizer whose gradients
            of the step have all gone to their reductions (its last pass before a step) is
            synchronized there, so that `clip_gradients` before `opt.step()` reads averages."""
            module = self.lightning_module
            assert module is not None
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
            if self._stepping is not None:
                complete = [self._stepping]
            elif module.automatic_optimization:
                complete = []       # (a pass that accumulates: the step's last one reduces)
            else:
                complete = [o for o in self.optimizers if isinstance(o, WrappedOptimizer)
                            and not isinstance(o, AdasumOptimizer) and o.gradients_sent()]
            for done in complete:
                done.synchronize()
                self._reduced.add(id(done))
            closure_loss = self.precision_plugin.post_backward(closure_loss, module)
            self.post_backward(closure_loss)
            return closure_loss

        # ------------------------------------------------------------ collectives for Lightning

        def reduce(self, tensor: Any, group: Optional[Any] = None,
                   reduce_op: Optional[Union[TorchReduceOp, str]] = "mean") -> Any:
            """`tensor` reduced over the ranks (a new tensor; a non-tensor comes back as is).
            `group`: None or a ringreduce ProcessSet. An integer tensor's average comes in torch's
            default float dtype (DDP truncates it to an integer). Lightning's DDP takes tensors
            that are not contiguous: they are copied (the collectives refuse them)."""
            if not isinstance(tensor, torch.Tensor):
                return tensor
            tensor = tensor.contiguous()
            op = _reduce_op(reduce_op, TorchReduceOp)
            if op is Average and not (tensor.is_floating_point() or tensor.is_complex()):
                average = allreduce(tensor.double(), op=op, process_set=_process_set(group))
                return average.to(torch.get_default_dtype())
            return allreduce(tensor, op=op, process_set=_process_set(group))

        def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None,
                       sync_grads: bool = False) -> torch.Tensor:
            """Every rank's `tensor`, stacked: shape (ranks, *tensor.shape). With `sync_grads`,
            each rank's input gets the gradients of its slice summed over the ranks, as
            torch.distributed.nn's all_gather (which Lightning uses under DDP) gives."""
            ps = _process_set(group)
            if not sync_grads or not tensor.requires_grad:
                return allgather(tensor.detach().unsqueeze(0).contiguous(), process_set=ps)
            source = tensor.unsqueeze(0).contiguous()
            ranks = ps.size()
            source.register_hook(lambda grad: grad * ranks)   # ours averages; torch's sums
            return allgather(source, process_set=ps)

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            return broadcast_object(obj, root_rank=src)

        def barrier(self, name: Optional[str] = None) -> None:
            barrier()

        @contextlib.contextmanager
        def block_backward_sync(self):
            """Nothing to block: DistributedOptimizer counts backward passes itself and reduces
            only on the last one before a step."""
            yield None

        @classmethod
        def register_strategies(cls, strategy_registry) -> None:
            strategy_registry.register(
                cls.strategy_name, cls,
                description="Data parallel over MPI with ringreduce's ring allreduce")

    return SimpleNamespace(RingReduceEnvironment=RingReduceEnvironment,
                           RingReduceSyncBatchNorm=RingReduceSyncBatchNorm,
                           RingReduceStrategy=RingReduceStrategy)


def _reduce_op(reduce_op: Any, torch_reduce_op: Any):
    if reduce_op is None:
        return Average
    if isinstance(reduce_op, str):
        if reduce_op.lower() not in _OPS:
            raise ValueError(f"ringreduce: reduce_op {reduce_op!r} is not one of "
                             f"{sorted(_OPS)}")
        return _OPS[reduce_op.lower()]
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        if reduce_op == getattr(torch_reduce_op, name, None):
            return _OPS[name.lower()]
    raise ValueError(f"ringreduce: unsupported reduce_op {reduce_op!r}")


def _process_set(group: Any) -> ProcessSet:
    """A collective's `group` as a process set: None, a ProcessSet, or a torch.distributed group
    on the "ringreduce" backend (LightningModule.all_gather passes torch's WORLD, which the
    strategy started on it)."""
    if group is None:
        return global_process_set
    if isinstance(group, ProcessSet):
        return group
    if isinstance(group, RingReduceGroup):
        return group.process_set
    raise UsageError(f"ringreduce: group={group!r} is not a ringreduce ProcessSet; the "
                     "RingReduceStrategy reduces over ringreduce process sets (hvd."
                     "add_process_set) and torch.distributed groups on the \"ringreduce\" "
                     "backend")


def _register(package: str, qualified: str) -> SimpleNamespace:
    """The classes for `package`, registered with its StrategyRegistry as "ringreduce", and
    named `qualified`.<class> in this module (so that pickle finds them)."""
    classes = strategy_classes(package)
    for name, cls in vars(classes).items():
        cls.__module__, cls.__qualname__ = __name__, f"{qualified}{name}"
    registry = importlib.import_module(f"{package}.strategies").StrategyRegistry
    classes.RingReduceStrategy.register_strategies(registry)
    return classes


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package.split(".")[0]) is not None


if not any(_installed(package) for package in PACKAGES):
    raise ImportError("ringreduce.lightning needs PyTorch Lightning 2.2 or later: "
                      "pip install 'ringreduce[lightning]' (or pytorch_lightning)")
# pytorch_lightning's classes; None when it is not installed.
pl = _register("pytorch_lightning", "pl.") if _installed("pytorch_lightning") else None
# lightning.pytorch's classes, or pytorch_lightning's when only that one is installed.
_main = _register("lightning.pytorch", "") if _installed("lightning") else pl
assert _main is not None
RingReduceEnvironment = _main.RingReduceEnvironment
RingReduceSyncBatchNorm = _main.RingReduceSyncBatchNorm
RingReduceStrategy = _main.RingReduceStrategy
