"""What identifies a collective across ranks: its signature (kind, name, dtype, shape, op, scale
factors, root ...), the 64-bit digest that ranks compare, and the messages built from it.
"""
from __future__ import annotations

import zlib
from typing import Any, Mapping, Optional, Sequence

from .. import _native

Signature = Mapping[str, Any]
# The kinds that qualify the names callers give (Horovod's 'allreduce.w'); see `qualified`.
KINDS = frozenset(("allreduce", "grouped_allreduce", "sparse_allreduce", "allgather",
                   "grouped_allgather", "broadcast", "alltoall", "reducescatter",
                   "grouped_reducescatter", "barrier", "broadcast_object", "allgather_object",
                   "check_consistency"))
_SHOWN = 10     # names a mismatch of two lists of names shows (then how many differ)
_UNSAID = {"device": "cpu"}     # what a signature without the field stands for, in messages


def qualified(kind: str, name: Optional[str]) -> Optional[str]:
    """Horovod's name for a collective the caller named: its kind, then the name, so that
    collectives of different kinds may share a name (None, or an empty name: none given)."""
    return f"{kind}.{name}" if name else None


def given_name(name: str) -> Optional[tuple[str, str]]:
    """(kind, the caller's name) of a `qualified` name; None for automatic and internal
    names."""
    kind, _, given = name.partition(".")
    if kind in KINDS and given and not given.startswith("noname."):
        return kind, given
    return None


def with_device(signature: dict, cuda: bool) -> dict:
    """`signature`, with "device" set for a reduction of CUDA tensors (`cuda`). A CUDA tensor and a
    CPU one take different ways (where MPI cannot read device memory, the staged GPU way checks
    the signature first and then reduces pieces; the small CPU way sends its signature with its
    data), which must not pair: a rank passing a CPU tensor where the others pass CUDA ones
    gets MismatchError on every rank, as Horovod's "Mismatched CPU/GPU device selection". CPU
    signatures carry no device, as the small way's digest (made in C) has none."""
    if cuda:
        signature["device"] = "cuda"
    return signature


def digest(signature: Signature) -> int:
    """64 bits that equal across ranks exactly when the signatures do: two CRCs of the fields in
    sorted order (a real mismatch slips through only if both collide). (A one-tensor
    allreduce's: AllreduceSignature.digest.)"""
    text = repr(sorted(signature.items())).encode()
    value = (zlib.crc32(text) << 32) | zlib.adler32(text)
    return value - (1 << 64) if value >= 1 << 63 else value


class AllreduceSignature:
    """A one-tensor allreduce as the members compare it, the most frequent and most
    latency-bound collective: the one place its fields are listed. Its `digest()` hashes them
    in C field by field (`c_digest`, FNV-1a, native/node.c), which the small way calls with
    the same fields without making the object; a CUDA tensor's (`cuda`) or the
    torch.distributed backend's reduce (`root`, a global rank) by `digest` of `fields()`."""

    __slots__ = ("name", "op", "dtype", "shape", "prescale", "postscale", "cuda", "root")
    c_digest = staticmethod(_native.allreduce_digest)   # (name, op, dtype, shape, pre, post)

    def __init__(self, name: str, op: str, dtype: str, shape: Sequence[int],
                 prescale: float = 1.0, postscale: float = 1.0, cuda: bool = False,
                 root: Optional[int] = None) -> None:
        self.name, self.op, self.dtype, self.shape = name, op, dtype, tuple(shape)
        self.prescale, self.postscale = float(prescale), float(postscale)
        self.cuda, self.root = cuda, root

    def fields(self) -> dict:
        """As messages show it (and as the general digest takes it)."""
        fields = {"collective": "allreduce" if self.root is None else "reduce",
                  "name": self.name, "op": self.op, "prescale": self.prescale,
                  "postscale": self.postscale, "dtype": self.dtype, "shape": self.shape}
        if self.root is not None:
            fields["root_rank"] = self.root
        return with_device(fields, self.cuda)

    def digest(self) -> int:
        if self.cuda or self.root is not None:
            return digest(self.fields())
        return self.c_digest(self.name, self.op, self.dtype, self.shape, self.prescale,
                             self.postscale)


def label(signature: Signature) -> str:
    """How a stall report names a collective: kind, name, and a bucket's parameters."""
    text = f"{signature.get('collective')} '{signature.get('name')}'"
    params = signature.get("parameters")
    if params:
        shown = ", ".join(params[:8]) + (f", ... ({len(params)} in all)" if len(params) > 8 else "")
        text += f" (parameters: {shown})"
    return text


GROUPED_TENSORS = "tensors (dtype, shape)"     # a grouped allreduce's field


def describe_mismatch(signatures: Sequence[Signature], ranks: Sequence[int]) -> str:
    """Name the tensor, the first differing field, and what each rank (global rank `ranks[i]`
    for signature i) submitted; or, where a rank refused its part (a mistake in its arguments,
    its signature's "refused" field, or a failure before its data moved, "failed"), that rank's
    error."""
    for field, cause in (("refused", "a mistake in the arguments of"),
                         ("failed", "a failure before its data moved, on")):
        refused = [(r, s[field]) for r, s in zip(ranks, signatures) if field in s]
        if refused:
            name = str(signatures[0].get("name"))
            who = ", ".join(str(r) for r, _ in refused)
            errors = "; ".join(f"rank {r}: {error}" for r, error in refused)
            return (f"ringreduce: {name!r} cannot run: {cause} "
                    f"{'rank' if len(refused) == 1 else 'ranks'} {who} ({errors}). Every "
                    "rank's call fails; later collectives run as usual.")
    fields = list(signatures[0])
    fields += [k for s in signatures[1:] for k in s if k not in fields]
    grouped = [GROUPED_TENSORS in s for s in signatures]
    if any(grouped) and not all(grouped):   # (a grouped call of one tensor signs as one)
        field = "number of tensors"
        values = [len(s[GROUPED_TENSORS]) if GROUPED_TENSORS in s else 1 for s in signatures]
    else:
        for field in fields:
            values = [s.get(field, _UNSAID.get(field)) for s in signatures]
            if any(v != values[0] for v in values):
                break
    names = sorted({str(s.get("name")) for s in signatures})
    kinds = sorted({str(s.get("collective")) for s in signatures})
    by_rank = "; ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values))
    if all(isinstance(v, tuple) and all(isinstance(e, str) for e in v) for v in values):
        held: dict[str, list[int]] = {}     # lists of names (a bucket's parameters)
        for r, v in zip(ranks, values):
            for entry in v:
                held.setdefault(entry, []).append(r)
        partial = [f"{entry!r} only on ranks {where}" for entry, where in held.items()
                   if len(where) < len(ranks)]
        if partial:
            by_rank = "; ".join(partial[:_SHOWN]) + (
                f"; ... ({len(partial)} names in all)" if len(partial) > _SHOWN else "")
            if field in ("parameters", "plan"):     # (a bucket's, an optimizer's)
                by_rank += (": a parameter frozen or unfrozen (requires_grad), or added "
                            "(add_param_group), on some ranks only")
        elif len({len(v) for v in values}) == 1:     # the same names, in another order
            at = next(i for i, names in enumerate(zip(*values)) if len(set(names)) > 1)
            by_rank = f"the same names in another order; at position {at}, " + "; ".join(
                f"rank {r}: {v[at]!r}" for r, v in zip(ranks, values))
    return (f"ringreduce: ranks disagree on {'/'.join(kinds)} of tensor "
            f"{' / '.join(repr(n) for n in names)}: '{field}' differs ({by_rank}). Collectives "
            "pair across ranks by name: every rank must submit a name with the same kind of "
            "collective, shape, dtype, op and root rank.")
