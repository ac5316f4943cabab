"""Re-runs that reuse their children's: a module's local re-run takes a child's output from the child's own re-run.

The reference pass re-runs every computing module alone in each format on its exact FP32 inputs
(capture/reference_pass.py). A module's re-run runs its children again, and a child that the module calls on
the module's *own inputs* (an attention block's q, k and v projections of its input; an MLP's first
projections; a ResNet block's first convolution and shortcut) sees exactly what it saw in its own re-run: the
same FP32 tensors, the same format, the same kernels, the same thread count, so it computes the same bits. Its
output from its own re-run is kept until the enclosing call ends and handed to the enclosing re-run instead of
computing it again (docs/performance.md, "Re-runs that reuse their children's").

It is handed over only when it is certain to be the same result, else the child runs as before:

- every argument of the child's call in the enclosing re-run is the very object of its reference call (tensors
  by identity, unchanged version and the same bits, which a write through ``.data`` would change; other values
  equal, floats by their bits; lists and dicts as they were at the call, not as the caller left them), and the
  enclosing module's inputs include all of the child's tensors (otherwise they are values the enclosing re-run
  computes anew, in low precision);
- the child's state is what it was at its reference call: the attributes, parameters and held objects of it and
  its submodules (an attribute or a tensor the parent sets before the call, a counter, a shared dict), and it
  holds no buffers (a re-run swaps them for copies);
- the child's call and re-run drew no random numbers (the CPU generator, Python's and NumPy's global generators
  and any generator it holds did not move), did not change its inputs or its own state, returned tensors (or
  tuples and lists of them) that share no memory with its inputs, its state or each other, each with the layout
  a copy has (not expanded, not offset), and ran in emulated mode; the child carries no forward hooks but the
  audit's own, is no TorchScript module, and no global module hooks are set (a hook could change the output
  after the forward, and would run again on the handed-over copy);
- autocast is on with the same dtype, grad mode is off, and the default dtype, thread count, oneDNN switch,
  fp32 matmul precision, attention fast path and fp32-fallback dispatch mode are as they were when the child
  re-ran.

What it cannot see, a child reading state it does not hold (a global variable, another module's attribute, a
generator it does not hold), is outside this guarantee.

The enclosing re-run gets a copy of the output (it may change it in place). Entries are dropped when the
outermost enclosing call that can use them ends, so at most the outputs of one block's first children per
format are held at a time.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..formats import Format


@dataclass
class _Frame:
    """One module call on the reference forward's stack: its arguments as given, with their tensors' versions."""

    module: int
    args: tuple
    kwargs: dict
    tensors: list[torch.Tensor]
    versions: tuple[int, ...]
    ids: frozenset[int] = field(default_factory=frozenset)
    # set only for a call an enclosing call could reuse (a holder): the call's module, its state, its inputs'
    # values and the host generators' states before the call
    owner: torch.nn.Module | None = None
    holder: int | None = None
    state: tuple | None = None
    values: list[torch.Tensor] | None = None
    host_rng: Any = None


@dataclass
class _Entry:
    fmt: Format
    args: tuple
    kwargs: dict
    versions: tuple[int, ...]
    output: Any
    context: tuple
    holder: int
    state: tuple
    values: list[torch.Tensor]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a tensor without a plain storage (sparse, nested, a subclass): never kept
        return None


def _dense(t: torch.Tensor) -> bool:
    """Whether a copy of ``t`` (``clone()``) has its very layout: strided, non-overlapping and dense, at the start
    of its memory."""
    if t.layout != torch.strided or t.storage_offset() != 0:
        return False
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _storable(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    if type(out) in (tuple, list):
        return all(v is None or _storable(v) for v in out)
    return False


def _copy(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if out is None:
        return None
    return type(out)(_copy(v) for v in out)


_SCALARS = (bool, int, str, bytes, type(None), torch.dtype, torch.device, torch.Size, slice, type(Ellipsis))


def _fingerprint(v: Any, storages: set, depth: int = 0) -> Any:
    """What ``v`` is, as far as a computation reading it could tell: tensors by identity, version, dtype, shape,
    strides and memory; plain values exactly (floats by their bits: -0.0 is not 0.0); containers and the
    attributes of other objects recursively (3 levels; deeper, by identity); a generator by its state."""
    if isinstance(v, torch.Tensor):
        storages.add(_storage(v))
        return ("t", id(v), v._version, v.dtype, tuple(v.shape), v.layout,
                tuple(v.stride()) if v.layout == torch.strided else None, _storage(v),
                v.storage_offset() if v.layout == torch.strided else None)
    if isinstance(v, float):
        return ("f", v.hex())
    if isinstance(v, complex):
        return ("c", v.real.hex(), v.imag.hex())
    if isinstance(v, _SCALARS):
        return (type(v), v)
    if isinstance(v, torch.Generator):
        return ("g", id(v), bytes(v.get_state().numpy()) if v.device.type == "cpu" else None)
    if isinstance(v, torch.nn.Module):
        return ("m", id(v))  # its own state is walked when it is a submodule; otherwise: by identity
    if depth >= 3:
        return ("o", id(v))
    if isinstance(v, (tuple, list, set, frozenset)):
        items = sorted(v, key=id) if isinstance(v, (set, frozenset)) else v
        return (type(v), tuple(_fingerprint(x, storages, depth + 1) for x in items))
    if isinstance(v, dict):
        return (type(v), tuple((_fingerprint(k, storages, depth + 1), _fingerprint(x, storages, depth + 1))
                               for k, x in v.items()))
    attrs = getattr(v, "__dict__", None)
    if isinstance(attrs, dict):
        return ("o", id(v), type(v), _fingerprint(attrs, storages, depth + 1))
    return ("o", id(v))


def module_state(m: torch.nn.Module) -> tuple[tuple, set] | None:
    """The state of ``m`` and its submodules that its forward may read besides its arguments (attributes,
    parameters, the objects they hold), and the memory of the tensors in it; None for a module with buffers
    (a re-run swaps them for copies, so their identity tells nothing: never kept)."""
    storages: set = set()
    parts = []
    try:
        for name, sub in m.named_modules(remove_duplicate=False):
            if any(b is not None for b in sub._buffers.values()):
                return None
            # which module sits where (a parent may swap its child's activation for another) and of what class
            parts.append((name, id(sub), type(sub),
                          tuple((k, _fingerprint(v, storages)) for k, v in sub.__dict__.items()
                                if k not in ("forward", "_modules", "_buffers") and "hook" not in k)))
    except Exception:  # an attribute that cannot be read so: never kept (the user's forward must not fail)
        return None
    return tuple(parts), storages


def _host_rng() -> tuple:
    """The states of Python's and NumPy's global generators (a child drawing from them is never kept)."""
    np = sys.modules.get("numpy")  # not imported: nothing drew from it
    numpy_state: Any = None
    if np is not None:
        try:
            kind, keys, pos, has_gauss, gauss = np.random.get_state()
            numpy_state = (kind, keys.tobytes(), pos, has_gauss, gauss)
        except Exception:  # a NumPy without its legacy generator: a new object, so never equal
            numpy_state = object()
    return (random.getstate(), numpy_state)


def _freeze(value: Any) -> Any:
    """A copy of the call's containers (lists and dicts the caller may change after the call), tensors and
    other values as they are; ``_UNFROZEN`` when a container is of a type it cannot copy faithfully."""
    if type(value) is list:
        items = [_freeze(v) for v in value]
        return _UNFROZEN if any(v is _UNFROZEN for v in items) else items
    if type(value) is tuple:
        items = [_freeze(v) for v in value]
        return _UNFROZEN if any(v is _UNFROZEN for v in items) else tuple(items)
    if type(value) is dict:
        d = {k: _freeze(v) for k, v in value.items()}
        return _UNFROZEN if any(v is _UNFROZEN for v in d.values()) else d
    if isinstance(value, (list, dict, set, bytearray)) or \
            (isinstance(value, tuple) and any(isinstance(v, (list, dict, set, tuple)) for v in value)):
        return _UNFROZEN
    return value


_UNFROZEN = object()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN equals the same NaN; -0.0 is not 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    try:
        if a.is_floating_point() or a.is_complex():
            as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
            if as_int is None:
                return False
            return torch.equal(a.view(as_int), b.view(as_int))
        return torch.equal(a, b)
    except Exception:  # a tensor that cannot be viewed or compared so: never the same
        return False


def _same(a: Any, b: Any) -> bool:
    """``a`` is ``b``'s very object (tensors), or an equal plain value (recursively for containers)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (float, complex)):  # by the bits: -0.0 is not 0.0
        return _fingerprint(a, set()) == _fingerprint(b, set())
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def plain_call(m: torch.nn.Module, own_hooks: set[int]) -> bool:
    """Whether calling ``m`` runs its forward and nothing else that could change the output: no forward hooks
    or pre-hooks on it but the audit's own (``own_hooks``: their handle ids), and no global module hooks."""
    from torch.nn.modules import module as _m

    if _m._global_forward_pre_hooks or _m._global_forward_hooks:
        return False
    return all(k in own_hooks for k in (*m._forward_pre_hooks, *m._forward_hooks))


def autocast_context() -> tuple:
    """What decides a CPU re-run's numerics besides its inputs: autocast's state and dtype, grad mode, the
    default dtype, the thread count, and the switches that pick other kernels (oneDNN, fp32 matmul precision,
    the attention fast path)."""
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_grad_enabled(),
            torch.get_default_dtype(), torch.get_num_threads(), torch.backends.mkldnn.enabled,
            _matmul_precision(), torch.backends.mha.get_fastpath_enabled())


def _matmul_precision() -> Any:
    """The fp32 matmul precision; a new object (equal to nothing) where the getter refuses to say (it raises when
    the user set the precision through both the legacy and the new API): the re-run must not fail for it."""
    try:
        return torch.get_float32_matmul_precision()
    except Exception:
        return object()


class RerunMemo:
    """The re-run outputs that an enclosing module's re-run can reuse, and the reference forward's call stack."""

    def __init__(self, enabled: bool, root: torch.nn.Module) -> None:
        self.enabled = enabled
        self._root = id(root)
        self._frames: list[_Frame] = []
        self._entries: dict[int, list[_Entry]] = {}
        self._values: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # inputs' values before a call
        self.reused = 0  # re-runs of children taken from here (tests read it)

    def clear(self) -> None:
        self._frames.clear()
        self._entries.clear()
        self._values.clear()

    def enter(self, m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A module call starts in the reference forward (its pre-hook)."""
        if not self.enabled:
            return
        ts = _tensors((args, kwargs))
        frame = _Frame(id(m), args, kwargs, ts, tuple(t._version for t in ts), frozenset(id(t) for t in ts))
        # the outermost enclosing call (not the model itself, which is never re-run) whose inputs hold all of
        # this call's tensors: every call between the two passes them on unchanged
        holder = next((f for f in self._frames if f.module != self._root and frame.ids <= f.ids), None) \
            if ts else None
        frozen = _freeze((args, kwargs)) if holder is not None else _UNFROZEN
        state = module_state(m) if frozen is not _UNFROZEN else None
        if holder is not None and isinstance(frozen, tuple) and state is not None:
            # the record of the call as it was made (the caller may change a list it passed afterwards), what
            # the module held, its inputs' values (a write through .data moves no version) and the host's
            # generators: all compared again after the call and before a reuse
            try:
                values = [self._value(t) for t in ts]
            except Exception:  # a tensor that cannot be copied: never kept (the user's forward must not fail)
                values = None
            if values is not None:
                frame.args, frame.kwargs = frozen
                frame.owner, frame.holder, frame.state = m, holder.module, state[0]
                frame.values = values
                frame.host_rng = _host_rng()
        self._frames.append(frame)

    def _value(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t``'s values now (shared by the calls that take the same tensor at the same version)."""
        hit = self._values.get(id(t))
        if hit is not None and hit[0] is t and hit[1] == t._version:
            return hit[2]
        c = t.detach().clone()
        self._values[id(t)] = (t, t._version, c)
        return c

    def leave(self, m: torch.nn.Module) -> _Frame | None:
        """The call ends (its post-hook): its frame, or None when it is not the innermost one."""
        if not self.enabled or not self._frames or self._frames[-1].module != id(m):
            return None
        return self._frames.pop()

    def offer(self, frame: _Frame | None, fmt: Format, out: Any, rng_moved: bool, context: tuple) -> None:
        """The child whose call ``frame`` was re-ran in ``fmt`` and returned ``out``: kept if an enclosing re-run
        can reuse it (see the module's docstring; the caller checks the hooks)."""
        if frame is None or frame.owner is None or frame.holder is None or frame.state is None \
                or frame.values is None or rng_moved or not _storable(out) \
                or isinstance(frame.owner, torch.jit.ScriptModule):
            return
        if tuple(t._version for t in frame.tensors) != frame.versions:  # the call changed its inputs in place
            return
        if not all(_bits_equal(t, v) for t, v in zip(frame.tensors, frame.values)):  # ... through .data
            return
        if _host_rng() != frame.host_rng:  # it drew from Python's or NumPy's generator
            return
        now = module_state(frame.owner)
        if now is None or now[0] != frame.state:  # it changed its own state (a counter, its generator)
            return
        inputs = {_storage(t) for t in frame.tensors} | now[1]
        outs = _tensors(out)
        # a view of an input, of a tensor the module holds or of another output: a copy in its place would not
        # alias it; and a layout a copy would not have (expanded, overlapping, offset): kernels may tell
        if any(_storage(t) in inputs or _storage(t) is None or not _dense(t) for t in outs) \
                or len({_storage(t) for t in outs}) != len(outs):
            return
        self._entries.setdefault(frame.module, []).append(
            _Entry(fmt, frame.args, frame.kwargs, frame.versions, out, context, frame.holder, frame.state,
                   frame.values))

    def release(self, m: torch.nn.Module) -> None:
        """``m``'s call has ended: the entries only it could use go."""
        if self._entries:
            for key in list(self._entries):
                kept = [e for e in self._entries[key] if e.holder != id(m)]
                if kept:
                    self._entries[key] = kept
                else:
                    del self._entries[key]
        if self._values:  # the copies of inputs that no open call or kept output refers to any more
            live = {id(v) for f in self._frames for v in (f.values or ())} | \
                {id(v) for es in self._entries.values() for e in es for v in e.values}
            self._values = {k: hit for k, hit in self._values.items() if id(hit[2]) in live}

    @contextlib.contextmanager
    def reusing(self, modules: dict[int, torch.nn.Module], rerun: torch.nn.Module, fmt: Format,
                context_extra: Any) -> Iterator[None]:
        """Around the re-run of ``rerun`` in ``fmt``: the modules with kept outputs answer from them when called
        as before."""
        patched: list[tuple[torch.nn.Module, bool, Any]] = []
        try:
            for key, entries in self._entries.items():
                mine = [e for e in entries if e.fmt is fmt]
                m = modules[key]
                # a TorchScript module keeps its forward elsewhere than its __dict__: never patched
                if mine and key != id(rerun) and not isinstance(m, torch.jit.ScriptModule):
                    had = "forward" in m.__dict__
                    patched.append((m, had, m.__dict__.get("forward")))
                    # through __dict__: no __setattr__ of the user's runs, and what was there goes back exactly
                    m.__dict__["forward"] = self._answering(m, m.forward, mine, context_extra)
            yield
        finally:
            for m, had, old in reversed(patched):
                if had:
                    m.__dict__["forward"] = old
                else:
                    m.__dict__.pop("forward", None)

    def _answering(self, module: torch.nn.Module, forward: Any, entries: list[_Entry],
                   context_extra: Any) -> Any:
        def answer(*args: Any, **kwargs: Any) -> Any:
            ctx = (*autocast_context(), context_extra)
            state: Any = None
            for e in entries:
                if e.context == ctx and _same(args, e.args) and _same(kwargs, e.kwargs) \
                        and tuple(t._version for t in _tensors((args, kwargs))) == e.versions:
                    if state is None:
                        now = module_state(module)
                        state = now[0] if now is not None else ()
                    if state == e.state and all(_bits_equal(t, v) for t, v in
                                                zip(_tensors((args, kwargs)), e.values)):
                        self.reused += 1
                        return _copy(e.output)
            return forward(*args, **kwargs)
        return answer
