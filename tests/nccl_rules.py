"""NCCL's rules, enforced on a CPU gloo process group (a test harness).

Usage, inside a rank-pool worker (each rank enters it for itself)::

    from tests.nccl_rules import NcclRuleError, nccl_rules

    with nccl_rules() as rules:
        rules.host(model, optimizer, full_sd, batch)  # what is CPU (host) memory on a GPU run
        ...code under test...
    rules.counts["batch_isend_irecv"]  # collective calls of this rank, by kind

Rules checked on every collective this thread makes inside the block (``torch.distributed``
collectives, ``batch_isend_irecv``'s point-to-point ops, and the functional collectives
DTensor uses, e.g. ``full_tensor()``):

* no unbatched point-to-point: ``send``/``recv``/``isend``/``irecv`` outside
  ``dist.batch_isend_irecv`` (on NCCL each pair of ranks would get its own communicator);
* at most one ``batch_isend_irecv`` in flight per rank (from the call until all its works are
  waited), and no other collective started behind it: a rank never queues a second batch
  behind bytes that have not arrived, and every rank issues its collectives in one order;
  none is left in flight at the end of the block;
* no functional collective (``torch.distributed._functional_collectives``: a tensor that waits when first
  used) is left in flight at the end of the block: each is waited (``wait()``, ``wait_tensor``) or used by
  an op that is not a view (which waits for it);
* every tensor has a dtype NCCL supports (``NCCL_DTYPES``); others raise at once, as NCCL does;
* no tensor is host memory. On a CPU-only machine host memory and the transfer device are
  the same, so host memory is what the test says it is: the storages of the tensors given
  to :meth:`NcclRules.host` (modules: params, buffers and grads; optimizers: their state;
  dicts/lists: their tensors, e.g. a full state dict or a loader batch) and those allocated
  by ``shardtune.ranks.comm.host_empty``. While the block runs,
  ``comm.on_transfer_device(t, device)`` says False for them, so ``comm.to_transfer``
  makes a real copy, as ``.to("cuda")`` does on a GPU.

Host-memory and point-to-point violations are recorded and the collective still runs (so
no rank is left waiting); leaving the block raises :class:`NcclRuleError` listing them.
``rules.violations`` holds them as text. ``rules.ahead`` counts the tensor ops this rank ran
while one of its exchanges was in flight (rank 0 reading ahead); ``rules.overlapped`` the tensor ops, by
name, it ran while one of its functional collectives was in flight (compute overlapping communication). Blind spot: memory allocated fresh on the host's
device (``torch.empty(..., device=host_tensor.device)``) is indistinguishable from transfer
memory here; only a GPU run sees it.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor, _is_view_op
from torch.utils._python_dispatch import TorchDispatchMode

NCCL_DTYPES = frozenset(
    {
        torch.int8,
        torch.uint8,
        torch.bool,  # torch sends it as uint8
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    }
)

# c10d op name -> the torch.distributed call users know it by
_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce_coalesced",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather_into_tensor",
    "allgather_coalesced_": "all_gather_coalesced",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "broadcast_": "broadcast",
    "scatter_": "scatter",
    "gather_": "gather",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all_single",
    "reduce_": "reduce",
    "barrier": "barrier",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
}
_FUNCOL_SKIP = {"wait_tensor", "_wrap_tensor_autograd"}  # not collectives


class NcclRuleError(AssertionError):
    """Code under test broke one of NCCL's rules."""


class NcclRules:
    """The state of one :func:`nccl_rules` block: host registry, counts, violations."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.violations: list[str] = []
        self._host: dict[int, list[weakref.ref]] = {}
        self._batched = threading.local()
        self.ahead = 0  # tensor ops run while an exchange of this rank was in flight
        self._in_flight: set[int] = set()  # ids of the works of the exchange in flight
        self.overlapped: Counter[str] = Counter()  # tensor ops run while a functional collective was in flight
        self._pending: dict[int, str] = {}  # storage of a functional collective's result in flight -> its kind

    def started(self, works: list[Any]) -> list[Any]:
        """Record a ``batch_isend_irecv``'s works as in flight until each is waited."""
        self._in_flight = {id(work) for work in works}
        return [_Tracked(work, self) for work in works]

    def _behind(self, kind: str) -> None:
        if self._in_flight:
            self.violations.append(
                f"{kind} started while an exchange is in flight; wait for it first (comm.settle): "
                "a rank queues at most one batch"
            )

    def host(self, *objects: Any) -> None:
        """Register host (CPU) memory: tensors, modules, optimizers, or dicts/lists/tuples of them."""
        for obj in objects:
            for tensor in _tensors_in(obj):
                for plain in _plain_tensors(tensor):
                    ptr = plain.untyped_storage().data_ptr()
                    if ptr:
                        self._host.setdefault(ptr, []).append(weakref.ref(plain))

    def is_host(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` (or any inner tensor of a subclass) shares storage with registered host memory."""
        for plain in _plain_tensors(tensor):
            ptr = plain.untyped_storage().data_ptr()
            refs = self._host.get(ptr)
            if not refs:
                continue
            alive = [r for r in refs if (t := r()) is not None and t.untyped_storage().data_ptr() == ptr]
            self._host[ptr] = alive
            if alive:
                return True
        return False

    def _check(self, kind: str, args: Any) -> None:
        for tensor in _tensors_in(args):
            if tensor.dtype not in NCCL_DTYPES:
                raise NcclRuleError(f"{kind}: dtype {tensor.dtype} is not one NCCL supports; send raw bytes")
            if self.is_host(tensor):
                self.violations.append(
                    f"{kind}: a {tensor.dtype} tensor of shape {tuple(tensor.shape)} is host memory, not on the "
                    "transfer device; copy it with comm.to_transfer first"
                )

    def _on_op(self, func, args, kwargs) -> None:
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "_c10d_functional":
            if name in _FUNCOL_SKIP:
                return
            kind = f"funcol.{name}"
        else:
            kind = _KINDS.get(name, name)
        if not (kind in ("send", "recv") and getattr(self._batched, "depth", 0)):
            self._behind(kind)
        if kind in ("send", "recv"):
            if getattr(self._batched, "depth", 0):
                kind = f"batched_{kind}"
            else:
                self.violations.append(
                    f"unbatched {kind}: on NCCL each pair of ranks gets its own communicator; "
                    "use dist.batch_isend_irecv or a collective"
                )
        self.counts[kind] += 1
        self._check(kind, (args, kwargs))

    def _funcol_started(self, func: Any, out: Any) -> None:
        """A functional collective's result is in flight until waited or read."""
        name = func._schema.name.split("::")[-1]
        if name in _FUNCOL_SKIP:
            return
        for tensor in _tensors_in(out):
            self._pending[tensor.untyped_storage().data_ptr()] = f"funcol.{name}"

    def _waited(self, func: Any, args: Any) -> None:
        """Take what ``func`` waits for out of the functional collectives in flight: the tensor ``wait_tensor``
        waits, or every in-flight result an op that is not a view reads (a tensor subclass waits for it)."""
        if func is torch.ops._c10d_functional.wait_tensor.default:
            for tensor in _tensors_in(args):
                for plain in _plain_tensors(tensor):
                    self._pending.pop(plain.untyped_storage().data_ptr(), None)
            return
        if func.namespace == "_c10d_functional" or func is torch.ops.aten.view.default or _is_view_op(func):
            return  # wrapping, another collective queued behind it, or a view: none waits
        for tensor in _tensors_in(args):
            for inner in _async_in(tensor):
                self._pending.pop(inner.elem.untyped_storage().data_ptr(), None)


class _Tracked:
    """A work of a batch in flight: waiting it takes it out of the rules' in-flight set."""

    def __init__(self, work: Any, rules: NcclRules) -> None:
        self._work, self._rules = work, rules

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        self._rules._in_flight.discard(id(self._work))
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Mode(TorchDispatchMode):
    def __init__(self, rules: NcclRules) -> None:
        super().__init__()
        self.rules = rules

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        rules, kwargs = self.rules, kwargs or {}
        if rules._pending:
            rules._waited(func, (args, kwargs))
        if func.namespace in ("c10d", "_c10d_functional"):
            rules._on_op(func, args, kwargs)
        else:
            rules.ahead += bool(rules._in_flight)
            if rules._pending:
                rules.overlapped[func.__name__] += 1
        out = func(*args, **kwargs)
        if func.namespace == "_c10d_functional":
            rules._funcol_started(func, out)
        return out


@contextmanager
def nccl_rules() -> Iterator[NcclRules]:
    """Check NCCL's rules on this rank's collectives inside the block (see the module docstring).

    Raises :class:`NcclRuleError` on leaving the block when a rule was broken."""
    from shardtune.ranks import comm

    rules = NcclRules()
    original_batch = c10d.batch_isend_irecv
    original_on_device = comm.on_transfer_device
    original_host_empty = comm.host_empty

    def batch_isend_irecv(p2p_op_list):
        rules.counts["batch_isend_irecv"] += 1
        rules._behind("batch_isend_irecv")
        rules._batched.depth = getattr(rules._batched, "depth", 0) + 1
        try:
            return rules.started(original_batch(p2p_op_list))
        finally:
            rules._batched.depth -= 1

    def on_transfer_device(tensor: torch.Tensor, device: torch.device) -> bool:
        return not rules.is_host(tensor) and original_on_device(tensor, device)

    def host_empty(*args, **kwargs) -> torch.Tensor:
        tensor = original_host_empty(*args, **kwargs)
        rules.host(tensor)
        return tensor

    c10d.batch_isend_irecv = dist.batch_isend_irecv = batch_isend_irecv
    comm.on_transfer_device, comm.host_empty = on_transfer_device, host_empty
    try:
        with _Mode(rules):
            yield rules
    finally:
        c10d.batch_isend_irecv = dist.batch_isend_irecv = original_batch
        comm.on_transfer_device, comm.host_empty = original_on_device, original_host_empty
    if rules._in_flight:
        rules.violations.append("an exchange is still in flight at the end of the block; wait for it (comm.settle)")
    for kind in rules._pending.values():
        rules.violations.append(f"{kind} is still in flight at the end of the block; wait for its result")
    if rules.violations:
        shown = sorted(set(rules.violations))
        raise NcclRuleError(f"{len(rules.violations)} NCCL rule violations:\n  " + "\n  ".join(shown[:20]))


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        grad = obj.grad if isinstance(obj, nn.Parameter) else None
        if grad is not None:
            yield grad
    elif isinstance(obj, nn.Module):
        for tensor in (*obj.parameters(), *obj.buffers()):
            yield from _tensors_in(tensor)
    elif isinstance(obj, torch.optim.Optimizer):
        yield from _tensors_in(list(obj.state.values()))
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)


def _async_in(tensor: torch.Tensor) -> Iterator[AsyncCollectiveTensor]:
    """``tensor`` itself if it waits for a functional collective, else such tensors inside a subclass."""
    if isinstance(tensor, AsyncCollectiveTensor):
        yield tensor
    elif type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from _async_in(inner)


def _plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """``tensor`` itself, or the plain tensors inside a subclass (DTensor's local, NF4's data)."""
    if type(tensor) in (torch.Tensor, nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        if not tensor.is_meta:
            yield tensor
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            yield from _plain_tensors(inner)
