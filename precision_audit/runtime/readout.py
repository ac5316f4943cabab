"""What a training step reads from the device: every per-step statistic the controller needs, in one transfer.

A clean step of :meth:`PrecisionController.step` synchronises with the device once, as the hand-written loop with
the same guarantee does (its ``found_inf`` or ``isfinite(norm)`` check before ``optimizer.step()``): the loss,
the total gradient norm, the GradScaler's found-inf flag and scale (when it is enabled) and, under
``torch.distributed``, the flags agreed across ranks are computed on the device, concatenated there and copied to
the host together. A statistic added later (a per-module amax, say) goes into the same readout and costs its
kernels, not another synchronisation.

Example::

    readout = Readout()
    readout.add("loss", loss.detach())
    readout.add("norm", total_norm)
    values = readout.read()          # one device sync
    values["loss"], values["norm"]   # floats (a list for a tensor of several elements)
"""

from __future__ import annotations

import torch


class Readout:
    """Named device values read with one device synchronisation (see the module docstring)."""

    __slots__ = ("_names", "_sizes", "_tensors")

    def __init__(self) -> None:
        self._names: list[str] = []
        self._sizes: list[int] = []
        self._tensors: list[torch.Tensor] = []

    def add(self, name: str, value: torch.Tensor) -> None:
        """Queue ``value`` (any shape; read as float32) under ``name``; nothing is read yet."""
        flat = value.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        self._names.append(name)
        self._sizes.append(flat.numel())
        self._tensors.append(flat)

    def read(self) -> dict[str, float | list[float]]:
        """Every queued value, copied to the host in one transfer: a float per one-element value, else a list."""
        if not self._tensors:
            return {}
        dev = self._tensors[0].device
        parts = [t if t.device == dev else t.to(dev) for t in self._tensors]
        flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        out: dict[str, float | list[float]] = {}
        at = 0
        for name, n in zip(self._names, self._sizes):
            out[name] = flat[at] if n == 1 else flat[at:at + n]
            at += n
        self._names.clear()
        self._sizes.clear()
        self._tensors.clear()
        return out
