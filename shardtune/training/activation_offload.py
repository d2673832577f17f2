"""Activation offloading: tensors autograd saves for backward wait in pinned CPU memory.

Rule: only activations move, and the compute stream never waits for a copy it does not need.
Inside :class:`OffloadActivations` every tensor autograd saves that is on an accelerator, is
not a parameter and holds at least ``min_bytes`` is copied to pinned host memory on a side
stream (the copy starts once the compute stream has produced the tensor; the accelerator copy
is kept alive until the copy is done, then freed), and copied back when backward unpacks it,
the compute stream waiting only for that copy. Parameters (FSDP2's gathered weights included)
stay where they are: FSDP2 gathers them again for backward. Combined with activation
checkpointing only each layer's input is saved, so that is what moves.

Tensors already in host memory are left alone, so on a CPU-only run the context changes nothing.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["OffloadActivations", "offload_layer_activations"]


class _Offloaded:
    """A saved tensor's host copy, the device it came from and the event its copy recorded."""

    __slots__ = ("device", "event", "host")

    def __init__(self, host: torch.Tensor, device: torch.device, event: torch.Event) -> None:
        self.host, self.device, self.event = host, device, event


class OffloadActivations(saved_tensors_hooks):
    """``with OffloadActivations(): loss = model(...)``; then ``loss.backward()`` outside or inside it."""

    def __init__(self, *, min_bytes: int = 1024) -> None:
        self.min_bytes = min_bytes
        self.streams: dict[torch.device, torch.Stream] = {}
        self.in_flight: list[tuple[torch.Tensor, torch.Event]] = []  # accelerator tensors still being copied
        self.offloaded_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _wanted(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.device.type not in ("cpu", "meta")
            and not isinstance(tensor, nn.Parameter)
            and type(tensor) is torch.Tensor  # not DTensor/NF4 subclasses
            and tensor.numel() * tensor.element_size() >= self.min_bytes
        )

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Offloaded:
        if not self._wanted(tensor):
            return tensor
        self.in_flight = [(t, e) for t, e in self.in_flight if not e.query()]
        device = tensor.device
        stream = self.streams.setdefault(device, torch.Stream(device=device))
        stream.wait_stream(torch.accelerator.current_stream(device))
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with stream:
            host.copy_(tensor, non_blocking=True)
            event = stream.record_event()
        self.in_flight.append((tensor, event))
        self.offloaded_bytes += host.numel() * host.element_size()
        return _Offloaded(host, device, event)

    def _unpack(self, packed: torch.Tensor | _Offloaded) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        stream = self.streams[packed.device]
        with stream:
            stream.wait_event(packed.event)
            back = packed.host.to(packed.device, non_blocking=True)
            event = stream.record_event()
        torch.accelerator.current_stream(packed.device).wait_event(event)
        back.record_stream(torch.accelerator.current_stream(packed.device))
        return back


def offload_layer_activations(layers: nn.ModuleList) -> None:
    """Offload what each of ``layers`` saves for backward (one :class:`OffloadActivations` per call,
    entered by a forward pre-hook and left by a forward hook). Wrap checkpointed layers after
    wrapping them, so the checkpoint's saved inputs are what moves."""
    for layer in layers:
        contexts: list[OffloadActivations] = []

        def enter(_module, _args, contexts=contexts) -> None:
            contexts.append(OffloadActivations())
            contexts[-1].__enter__()

        def leave(_module, _args, _output, contexts=contexts) -> None:
            contexts.pop().__exit__(None, None, None)

        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
