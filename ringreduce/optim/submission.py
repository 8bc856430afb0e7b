"""How a DistributedOptimizer's buckets go to the set's engine, in bucket order (the same on
every rank), as its life cycle submits them (gradient_reduction.py): packed into their buffers
(a parameter alone in its bucket reduced in place in its gradient), the engine's work of each,
unpacked after; a compressor of the user's own (compression.custom) called on each gradient,
as Horovod calls it (every parameter a bucket of its own, its gradient compressed when ready,
the compressed tensor reduced, and decompressed into `.grad` at synchronize()); and what the
timeline shows of them."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from ..api.work import run, submit
from ..core import timeline
from ..core.errors import MismatchError, UnsupportedError
from ..gpu import cuda, device_kernels
from ..kernels.buffers import CODES, dtype_name
from ..sets.handles import Finished, Handle
from ..transport.reduce_spec import ReduceSpec
from ..transport.signature import digest, with_device
from . import fusion


class Submission:
    """(A part of GradientReduction: the attributes it reads are set in its `_setup` and
    `_reset_step`.)"""

    def _submit_ready_buckets(self, force: bool = False) -> None:
        while self._next_bucket < len(self._buckets) and (
                force or self._waiting[self._next_bucket] == 0):
            bucket = self._buckets[self._next_bucket]
            short = self._waiting[bucket.index] > 0     # (forced: a group short of gradients)
            self._trace_waiting(bucket)
            if self._custom:
                self._submit_custom(bucket, short)
                self._next_bucket += 1
                continue
            ready = None   # GPU: an event on torch's stream, after which the bucket is packed
            gradient = None
            with timeline.span(bucket.name, "pack"):
                if bucket.direct:
                    gradient = self._direct_gradient(bucket)
                else:
                    ready = self._pack(bucket)
            self._sent.append((bucket, gradient if bucket.direct else
                               [p.grad for p in bucket.params]))
            self._submit_bucket(bucket, self._reduce_work(bucket, ready, gradient, short))
            self._next_bucket += 1

    def _submit_bucket(self, bucket: fusion.Bucket, work: Callable[[], Any]) -> Handle:
        """Queue a bucket's reduction (under the `inline` schedule, run it here). Where the
        step's first bucket failed its signature check (a MismatchError, which every rank gets
        for it), the later ones fail without meeting the others: the first bucket carries the
        whole plan, and plans that differ (a parameter unfrozen on one rank only) may differ in
        how many buckets they have, where a rank's extra ones would wait for ever."""
        def guarded() -> Any:
            if self._first_bucket_failed is not None:
                raise self._first_bucket_failed
            try:
                return work()
            except MismatchError as exc:
                if bucket.index == 0:
                    self._first_bucket_failed = exc
                raise

        if self._schedule.inline:       # (schedule.py): on this thread, now
            timeline.record(bucket.name, "submitted")
            try:
                handle: Handle = Finished(bucket.name, run((self._set, bucket.name, guarded)),
                                          None)
            except Exception as exc:    # (raised with the others' at synchronize())
                handle = Finished(bucket.name, None, exc)
        else:
            handle = submit((self._set, bucket.name, guarded))
        self._handles.append(handle)
        return handle

    def _submit_custom(self, bucket: fusion.Bucket, short: bool) -> None:
        """A bucket under a compressor of the user's own, as Horovod runs one: each gradient
        (made zeros where this rank has none; zeros stand in for a sparse one, which travels
        on its own) compressed here, each compressed tensor reduced in place, and
        decompressed at synchronize()."""
        wires, contexts = [], []
        for p, tensor in zip(bucket.params, self._to_compress(bucket)):
            wire, context = self._compression.compress(tensor)
            if wire.dtype not in CODES:
                raise UnsupportedError(f"ringreduce: the compressor {self._compression!r} "
                                       f"made {wire.dtype} from parameter "
                                       f"'{self._names[id(p)]}' on rank {self._rank}, which "
                                       "cannot be reduced")
            wires.append(wire.contiguous())
            contexts.append(context)
        op, prescale, postscale = self._reduction_of(short)
        specs = []
        for wire, name in zip(wires, bucket.names):
            signature = with_device({
                "collective": "allreduce", "name": bucket.name, "parameter": name,
                "compressed": True, "dtype": dtype_name(wire.dtype),
                "shape": tuple(wire.shape), "op": op.name, "prescale": prescale,
                "postscale": postscale}, wire.is_cuda)
            if bucket.index == 0 and not specs:     # the whole plan: see _submit_bucket
                signature.update(self._plan_signed)
            specs.append(ReduceSpec(wire.dtype, op, prescale, postscale, digest(signature),
                                    signature))
        transport = self._set.transport
        # on a GPU, the reduction waits for the compressions, queued on torch's current stream
        ready = next((torch.cuda.current_stream(w.device).record_event() for w in wires
                      if w.is_cuda), None)

        def work() -> list[torch.Tensor]:
            with cuda.after(ready):
                for wire, spec in zip(wires, specs):
                    transport.allreduce(wire, wire, spec)
            return wires

        handle = self._submit_bucket(bucket, work)
        self._compressed.append((bucket, handle, contexts))

    def _to_compress(self, bucket: fusion.Bucket) -> list[torch.Tensor]:
        """What a compressor of the user's own is given, per parameter of `bucket`: its
        gradient (zeros where this rank has none, or a sparse one)."""
        tensors = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            tensors.append(p.grad if p.grad.layout == torch.strided else torch.zeros_like(p))
        return tensors

    def _decompress(self) -> None:
        """synchronize()'s end under a compressor of the user's own: each reduced tensor
        decompressed into its dense gradient (`set_`, as Horovod's)."""
        for bucket, handle, contexts in self._compressed:
            for p, wire, context in zip(bucket.params, handle.wait(), contexts):
                if p.grad.layout == torch.strided:
                    p.grad.set_(self._compression.decompress(wire, context))
        self._compressed = []

    def _pack(self, bucket: fusion.Bucket) -> Any:
        """Gradients into the bucket's buffer; on a GPU, returns the event the reduction waits
        for."""
        if bucket.buffer.is_cuda:
            return device_kernels.pack(bucket)
        bucket.pack()
        return None

    def _unpack(self, bucket: fusion.Bucket) -> None:
        """The reduced buffer back into the gradients (on a GPU it waits: complete before
        synchronize() returns)."""
        with timeline.span(bucket.name, "unpack"):
            if bucket.buffer.is_cuda:
                device_kernels.unpack(bucket)
            else:
                bucket.unpack()

    def _direct_gradient(self, bucket: fusion.Bucket) -> torch.Tensor:
        """The tensor a direct bucket reduces in place: its parameter's gradient, or zeros
        standing in for a sparse one (which travels on its own)."""
        p = bucket.params[0]
        if p.grad is not None and p.grad.layout != torch.strided:
            return torch.zeros_like(p)
        return bucket.gradient()

    def _reduction_of(self, short: bool) -> tuple:
        """A bucket's (op, prescale, postscale): `short` of gradients at step(), a group's is
        reduced as Horovod reduces its members one by one (see GradientReduction._setup)."""
        return self._short_reduction if short and self._short_reduction else self._reduction

    def _reduce_work(self, bucket: fusion.Bucket, ready: Any = None,
                     gradient: Optional[torch.Tensor] = None, short: bool = False):
        """The engine's work for a bucket: reduce its buffer (or, for a direct bucket,
        `gradient` in place), then unpack. `short`: see `_reduction_of`."""
        specs = self._short_specs if short and self._short_specs else self._specs
        transport, spec = self._set.transport, specs[bucket.index]

        def work() -> None:
            timeline.record(bucket.name, "reduce start")
            tensor = bucket.buffer if gradient is None else gradient
            with timeline.span(bucket.name, "allreduce"), cuda.after(ready):
                transport.allreduce(tensor, tensor, spec)
            if not bucket.direct:
                self._unpack(bucket)
            timeline.record(bucket.name, "reduce done")

        return work

    def _trace_waiting(self, bucket: fusion.Bucket) -> None:
        """While a timeline runs: name the bucket's parameters for its events, and emit its
        "waiting for gradients" span, from its first gradient hook of the step until now (its
        submission), the part of backward that its communication can overlap."""
        if not timeline.running():
            return
        describe(bucket)
        start = self._first_gradient_at.get(bucket.index)
        if start is not None:
            timeline.add_span(bucket.name, "waiting for gradients", start, time.perf_counter())


def describe(bucket: fusion.Bucket) -> None:
    """Tell the timeline which parameters a bucket's events are about."""
    timeline.describe(bucket.name, parameters=bucket.names, bytes=bucket.nbytes,
                      in_place=bucket.direct)


def hand_to_replaced(sent: list[tuple]) -> None:
    """At the end of synchronize(), as Horovod's (which sets each parameter's gradient to its
    reduced value, `p.grad.set_(output)`): a gradient the program replaced after its bucket
    took it (`p.grad = f(p.grad)` between backward and step, while the reduction ran) is given
    the reduced value too, rather than stepping with this rank's own. `sent`: each bucket with
    what it reduced (a direct bucket's tensor, or the gradients it packed)."""
    for bucket, reduced in sent:
        if bucket.direct:
            p = bucket.params[0]
            if p.grad is not None and p.grad is not reduced and p.grad.layout == torch.strided:
                p.grad.set_(reduced)
            continue
        for p, packed, view in zip(bucket.params, reduced, bucket.views):
            if (p.grad is not None and p.grad is not packed and p.grad.layout == torch.strided
                    and p.grad.data_ptr() != view.data_ptr()):
                p.grad.copy_(view)
