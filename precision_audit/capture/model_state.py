"""Everything a capture session changes on the user's model, kept to put it back exactly (docs/memory.md)."""

from __future__ import annotations

import itertools
from typing import Any

import torch


def concrete_device(device: str | torch.device) -> torch.device:
    """``device`` with its index: plain ``"cuda"`` is the current CUDA device (what ``Tensor.to("cuda")`` uses),
    so that it compares equal with the device of a tensor already there."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def model_cuda_index(model: torch.nn.Module) -> int | None:
    """The CUDA device index every parameter and buffer of ``model`` is on; ``None`` when the model is not on
    CUDA, or spread over several devices (docs/gpu.md, "Devices")."""
    devices = {t.device for t in itertools.chain(model.parameters(), model.buffers())}
    if len(devices) != 1:
        return None
    (d,) = devices
    return concrete_device(d).index if d.type == "cuda" else None


#: Module attributes holding hook dictionaries: their *contents* are put back (no hook left behind, the user's
#: own hooks kept in their order), whatever the passes or the model's forward added or removed.
def _is_hook_dict(name: str, value: Any) -> bool:
    return "hooks" in name and isinstance(value, dict)


class ModelState:
    """Everything a capture session changes on the user's model, kept to put it back exactly (docs/memory.md).

    The audit runs on the user's model in place, not on a copy. What is kept is only what the passes change:

    - a clone of every buffer (BatchNorm's running statistics move in train mode; buffers are small next to
      the parameters), copied back before every pass and at the end;
    - parameters are never copied: the passes do not write them (the reference pass refuses an in-place write to
      a parameter before it happens, see capture/op_tracker.py). When the model must move to the audit's device, the
      original ``.data`` of each parameter and the original buffer objects are held and put back, storage and all;
    - references to the existing ``.grad`` tensors (not copies; ``None`` stays ``None``), ``requires_grad`` per
      parameter, ``.training`` per module, each module's attributes (rebound ones are put back, added ones
      removed) and the contents of its hook dictionaries;
    - the RNG states are forked by the session itself (CPU and every CUDA device, Python's and NumPy's global
      generators: precision_audit/host_rng.py).
    """

    def __init__(self, model: torch.nn.Module, device: str) -> None:
        self.model = model
        self.device = concrete_device(device)
        self.modules = list(model.modules())
        self._dicts: list[tuple[torch.nn.Module, dict[str, Any], dict[str, dict]]] = []
        for m in self.modules:
            attrs = dict(m.__dict__)
            # plain dicts only: a TorchScript module's _parameters/_buffers/_modules are read-only views of its
            # C++ state (OrderedDictWrapper), which no pass changes and which cannot be refilled
            inner = {k: dict(v) for k, v in attrs.items()
                     if isinstance(v, dict) and (k in ("_parameters", "_buffers", "_modules") or _is_hook_dict(k, v))}
            self._dicts.append((m, attrs, inner))
        seen: set[int] = set()
        self._params: list[tuple[torch.nn.Parameter, torch.Tensor, bool, torch.Tensor | None]] = []
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                self._params.append((p, p.data, p.requires_grad, p.grad))
        self._buffers: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        seen.clear()
        for m in self.modules:
            for name, b in m._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    self._buffers.append((m, name, b))
        self.moved = any(t.device != self.device for t in model.parameters()) or \
            any(b.device != self.device for _, _, b in self._buffers)
        # buffers: owner, name, the tensor the passes use, and the value to reset it to
        self._live: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = []

    def prepare(self) -> None:
        """Detach the user's gradients, move to the audit's device if needed, and snapshot the buffers."""
        for p, _, _, _ in self._params:
            p.grad = None
        if self.moved:
            # the originals stay untouched where they are: they are the snapshot (no clone on their device)
            with torch.no_grad():
                self.model.to(self.device)
        with torch.no_grad():
            for m, name, orig in self._buffers:
                live = m._buffers.get(name)
                if live is None:
                    continue
                snap = orig if live is not orig else orig.detach().clone()
                self._live.append((m, name, live, snap))

    def reset_buffers(self) -> None:
        """Put every buffer back to its value when the audit started. Every buffer is copied: a kernel may
        write one without bumping its version (CPU batch_norm's running statistics), so versions cannot tell. A
        buffer the forward rebound (``self.count = self.count + 1``) is put back as the object it was."""
        with torch.no_grad():
            for m, name, live, snap in self._live:
                if m._buffers.get(name) is not live:
                    m._buffers[name] = live
                live.copy_(snap)

    def restore(self) -> None:
        """Put the model back as it was given; safe to call after a failure at any point, and more than once."""
        with torch.no_grad():
            if not self.moved:  # moved: the original buffers were never touched and are put back below
                self.reset_buffers()
            put_attributes_back([(m, attrs) for m, attrs, _ in self._dicts])
            for m, _, inner in self._dicts:
                d = m.__dict__
                for k, saved in inner.items():
                    live = d[k]
                    live.clear()
                    live.update(saved)
            for p, data, requires_grad, grad in self._params:
                if self.moved:
                    p.data = data
                p.grad = grad
                if p.requires_grad != requires_grad:
                    p.requires_grad_(requires_grad)


_MISSING = object()


def module_attributes(module: torch.nn.Module) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """A shallow copy of the attributes of ``module`` and every module inside it (references, not copies)."""
    return [(m, dict(m.__dict__)) for m in module.modules()]


def put_attributes_back(saved: list[tuple[torch.nn.Module, dict[str, Any]]]) -> None:
    """Rebind every attribute a forward rebound and remove every one it added (``module_attributes``); the
    contents of mutable attributes (a list it appended to, the hook dictionaries) are left as they are."""
    for m, attrs in saved:
        d = m.__dict__
        for k in [k for k in d if k not in attrs]:
            del d[k]
        for k, v in attrs.items():
            if d.get(k, _MISSING) is not v:
                d[k] = v
