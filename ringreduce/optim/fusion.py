"""The bucket plan: which gradients travel together, and packing them into flat buffers.

Parameters are taken in reverse registration order (roughly the order backward produces their
gradients), one dtype per bucket, each bucket capped by a byte threshold, the first one
smaller so that communication starts early. A gradient of `ALONE_BYTES` or more that can be
reduced where it lies (on the CPU, uncompressed) has a bucket of its own, without a buffer:
fused, it would cost two copies of itself a step (packed, unpacked) and as much memory again,
to save one call whose fixed cost (tens of microseconds) is a small part of moving a MiB.
Every buffer and every per-parameter view into it is made once here; steps reuse them, so the
hot path allocates nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..kernels.buffers import dtype_name
from ..transport.signature import with_device

ALONE_BYTES = 1 << 20   # a gradient this large is reduced alone, in place (see above)


@dataclass
class Bucket:
    index: int
    names: list[str]
    params: list[torch.Tensor]
    buffer: torch.Tensor                 # flat, in the wire dtype
    views: list[torch.Tensor]            # buffer slices shaped (and laid out) like each parameter
    signature: dict = field(default_factory=dict)   # how ranks recognise its allreduce
    direct: bool = False                 # see `gradient`: no buffer, no pack and unpack

    @property
    def name(self) -> str:
        """'<prefix>bucket.<index>', the prefix telling one optimizer's buckets from
        another's: the name in the signature."""
        return self.signature["name"]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.params) * self.buffer.element_size()

    def gradient(self) -> torch.Tensor:
        """A direct bucket (one CPU parameter, no compression) is reduced in place in its
        parameter's gradient, made present (zeros) and contiguous: a buffer would cost copies
        in and out and as much memory again as the gradient, which for a large layer is most
        of a step's communication cost."""
        p = self.params[0]
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
        return p.grad

    def pack(self) -> None:
        """Copy each parameter's gradient into the buffer (zeros where there is none, or where
        it is sparse: those travel on their own)."""
        for p, view in zip(self.params, self.views):
            if p.grad is None or p.grad.layout != torch.strided:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)

    def unpack(self) -> None:
        """Copy the reduced buffer back into each (dense) parameter gradient."""
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            elif p.grad.layout == torch.strided and p.grad.data_ptr() != view.data_ptr():
                p.grad.copy_(view)


def plan(named: Sequence[tuple[str, torch.Tensor]], threshold: int, first_bucket: int,
         wire_dtype=None, explicit_groups: Optional[Sequence[Sequence[torch.Tensor]]] = None,
         prefix: str = "", direct: bool = True) -> list[Bucket]:
    """Buckets over the given parameters, in reverse registration order (none given: one
    empty bucket, see _empty_bucket).

    `wire_dtype(dtype)` gives the buffer dtype for a parameter dtype (for compression);
    `explicit_groups` (lists of parameters) each become one bucket per dtype on the wire,
    before the rest; bucket names start with `prefix`; `direct=False` gives every bucket a
    buffer (and no gradient a bucket of its own for its size, ALONE_BYTES).
    """
    wire = wire_dtype or (lambda dtype: dtype)
    trainable = list(named)
    groups: list[list[tuple[str, torch.Tensor]]] = []
    if explicit_groups:
        name_of = {id(p): n for n, p in trainable}
        grouped_ids = set()
        for group in explicit_groups:
            members = [(name_of[id(p)], p) for p in group if id(p) in name_of]
            grouped_ids.update(id(p) for _, p in members)
            groups.extend(_by_wire_dtype(members, wire))
        trainable = [(n, p) for n, p in trainable if id(p) not in grouped_ids]
    current: list[tuple[str, torch.Tensor]] = []
    current_bytes = 0
    for n, p in reversed(trainable):
        nbytes = p.numel() * wire(p.dtype).itemsize
        cap = first_bucket if not groups else threshold
        alone = (direct and nbytes >= ALONE_BYTES and p.is_contiguous()
                 and _reduced_in_place(p, wire))
        if current and (alone or wire(p.dtype) != wire(current[0][1].dtype)
                        or current_bytes + nbytes > cap
                        or p.device != current[0][1].device):   # one device per bucket
            groups.append(current)
            current, current_bytes = [], 0
        if alone:
            groups.append([(n, p)])
            continue
        current.append((n, p))
        current_bytes += nbytes
    if current:
        groups.append(current)
    if not groups:
        return [_empty_bucket(prefix)]
    return [_make_bucket(i, group, wire, prefix, direct) for i, group in enumerate(groups)]


def _by_wire_dtype(members: list[tuple[str, torch.Tensor]], wire
                   ) -> list[list[tuple[str, torch.Tensor]]]:
    """A group's parameters split by their dtype on the wire, in order of first appearance: a
    bucket has one dtype, and each gradient is reduced in its own, as Horovod's grouped
    allreduce reduces each tensor (a float64 gradient in a float32 buffer would lose its low
    bits; a float32 one in a float64 buffer would be summed and scaled with other rounding)."""
    split: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, p in members:
        split.setdefault(wire(p.dtype), []).append((name, p))
    return list(split.values())


def _reduced_in_place(p: torch.Tensor, wire) -> bool:
    """Whether a parameter alone in its bucket is reduced in its gradient (Bucket.gradient):
    on the CPU, its dtype on the wire. (A large one is given a bucket of its own only where it
    is contiguous too: its gradient made contiguous every step would cost the copy saved.)"""
    return p.device.type == "cpu" and wire(p.dtype) == p.dtype


def _empty_bucket(prefix: str) -> Bucket:
    """The first bucket of a plan without parameters (all frozen, or all with sparse
    gradients): a plan always has one, which every rank reduces at each step, so that a rank
    whose plan has parameters (one unfrozen there alone) meets the others' first bucket."""
    signature = {"collective": "allreduce", "name": f"{prefix}bucket.0", "parameters": (),
                 "dtype": "float32", "shape": (0,)}
    return Bucket(0, [], [], torch.zeros(0), [], signature)


def _make_bucket(index: int, members: list[tuple[str, torch.Tensor]], wire, prefix: str,
                 direct: bool) -> Bucket:
    dtype = wire(members[0][1].dtype)
    total = sum(p.numel() for _, p in members)
    device = members[0][1].device   # the bucket lives where its parameters do
    if any(p.device != device for _, p in members):
        raise ValueError(f"ringreduce: bucket {index} (parameters {[n for n, _ in members]}) "
                         "spans several devices; each group must hold parameters of one device")
    names = [n for n, _ in members]
    signature = with_device({"collective": "allreduce", "name": f"{prefix}bucket.{index}",
                             "parameters": tuple(names),    # before shape: a mismatch names
                             "dtype": dtype_name(dtype),    # the parameters
                             "shape": (total,)}, device.type == "cuda")
    params = [p for _, p in members]
    if direct and len(members) == 1 and _reduced_in_place(params[0], wire):
        return Bucket(index, names, params, torch.empty(0, dtype=dtype), [], signature,
                      direct=True)
    buffer = torch.zeros(total, dtype=dtype, device=device)
    views, offset = [], 0
    for p in params:
        views.append(_laid_out_like(buffer[offset:offset + p.numel()], p))
        offset += p.numel()
    strides = tuple((n, tuple(v.stride())) for n, v in zip(names, views) if not v.is_contiguous())
    if strides:     # the buffer holds those in their memory order: every rank must have it
        signature["strides"] = strides
    return Bucket(index, names, params, buffer, views, signature)


def _laid_out_like(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`flat` (p.numel() elements) shaped like `p`, and in p's memory layout where p is dense
    but not row-major (channels_last): a gradient made a view of it keeps autograd's layout
    contract, and packing a gradient is a straight copy rather than a transposing one."""
    if not p.is_contiguous() and torch.empty_like(p, device="meta").stride() == p.stride():
        return flat.as_strided(p.shape, p.stride())
    return flat.view(p.shape)
