"""Where a non-finite step started: the per-call (min, max) records of every module's inputs and outputs, taken
as the calls happen (:class:`_SourceProbe`) or by replaying the step's forward (:class:`_ReplayProbe`), and the
rule that names the source (:class:`Attribution`). The controller (runtime/controller.py, whose docstring
describes the two ways and when each is used; docs/policy.md, "The runtime") reads them on bad steps only.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch

from .. import host_rng
from ..tf32_switches import restore
from .backward_tf32 import forward_state, switch_to

OUTSIDE_THE_MODEL = "(outside the model)"


def _floating_tensors(x: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            out.append(x)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _floating_tensors(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _floating_tensors(v, out)
    return out


def _range(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(min, max) of ``t`` in one kernel; both are non-finite iff some element is (aminmax propagates NaN)."""
    if t.numel() == 0:
        return None
    return torch.aminmax(t.detach())  # detached: no graph, no need for a no_grad context (cheaper per call)


def _innermost(names: set[str]) -> list[str]:
    """Drop every name that is a parent of another name in the set (the root "" is everyone's parent)."""
    keep = []
    for n in names:
        if not any(m != n and (n == "" or m.startswith(n + ".")) for m in names):
            keep.append(n)
    return sorted(keep)


def _kind(values: list[float]) -> str:
    """What non-finite values a list of (min, max) pairs shows: "+inf", "-inf", "NaN" or a combination."""
    kinds = []
    if any(math.isnan(v) for v in values):
        kinds.append("NaN")
    if any(v == math.inf for v in values):
        kinds.append("+inf")
    if any(v == -math.inf for v in values):
        kinds.append("-inf")
    return "/".join(kinds) or "non-finite"


@dataclass(frozen=True)
class Attribution:
    """Where a step's non-finite gradients started, decided before the optimizer step (docs/policy.md).

    ``source``: the first module, in the order the forward calls finished, whose floating output was non-finite
    although its floating inputs were finite, or None; ``detail``: what was seen there (quoted in logs and
    promotion reasons); ``forward_nonfinite``: some module output was non-finite in this step's forward;
    ``backward``: adaptive mode only, modules whose parameter gradients went non-finite from a finite output
    gradient (counted only when the forward was finite and the loss scale is <= 1).
    """

    source: str | None
    detail: str
    forward_nonfinite: bool
    backward: tuple[str, ...] = ()
    unreproduced: str = ""  # replay only: why the step's forward could not be replayed exactly (no source named)


class _SourceProbe:
    """Forward hooks recording, per module call, the (min, max) of its floating inputs and outputs, and (with
    ``backward=True``) tensor hooks recording those of the gradient arriving at its outputs.

    The values stay tensors (no device sync) until :meth:`evaluate` runs on a step that found non-finite
    gradients; a tensor seen twice in a step (one module's output is the next one's input) is reduced once.
    Records are kept in the order the calls finished, so a child comes before its parent and an earlier layer
    before a later one.
    """

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], backward: bool) -> None:
        # TorchScript modules take no Python hooks: what they compute is attributed to their eager parent
        modules = [(n, m) for n, m in modules if not isinstance(m, torch.jit.ScriptModule)]
        self.names = [n for n, _ in modules]
        self.backward = backward
        self.fwd: list[tuple[int, list, list]] = []  # (module index, input ranges, output ranges)
        self.bwd: list[tuple[int, tuple]] = []  # (module index, output-gradient range)
        self._memo: dict[int, tuple[weakref.ref, int, Any]] = {}
        self.handles = [m.register_forward_hook(self._make_hook(i), with_kwargs=True)
                        for i, (_, m) in enumerate(modules)]

    def _range_of(self, t: torch.Tensor) -> Any:
        key = id(t)
        version = t._version
        hit = self._memo.get(key)
        if hit is not None and hit[1] == version and hit[0]() is t:
            return hit[2]
        r = _range(t)
        self._memo[key] = (weakref.ref(t), version, r)
        return r

    def _make_hook(self, i: int):
        Tensor = torch.Tensor
        range_of = self._range_of
        fwd = self.fwd
        bwd = self.bwd
        backward = self.backward

        def grad_hook(grad: torch.Tensor) -> None:
            r = _range(grad)
            if r is not None:
                bwd.append((i, r))

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            # the common case (one tensor in, one out) without the generic walk: this runs on every call
            if type(output) is Tensor and not kwargs and len(args) == 1 and type(args[0]) is Tensor:
                if not output.is_floating_point():
                    return
                outs = [output]
                x = args[0]
                ins = [x] if x.is_floating_point() else []
            else:
                outs = _floating_tensors(output, [])
                if not outs:
                    return
                ins = _floating_tensors((args, kwargs), [])
            if torch.compiler.is_compiling():
                # traced by torch.compile: no memo (id() and weakrefs break the graph), the reductions become
                # part of the compiled graph; the backward tensor hooks are left out there
                fwd.append((i, [_range(t) for t in ins if t.numel()], [_range(t) for t in outs if t.numel()]))
                return
            fwd.append((i, [r for t in ins if (r := range_of(t)) is not None],
                        [r for t in outs if (r := range_of(t)) is not None]))
            if backward:
                for t in outs:
                    if t.requires_grad:
                        t.register_hook(grad_hook)

        return hook

    def clear(self) -> None:
        self.fwd.clear()
        self.bwd.clear()
        self._memo.clear()

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def remove(self) -> None:
        self.remove_hooks()
        self.clear()

    def evaluate(self, nonfinite_params: set[str], backward_counts: bool, device: torch.device,
                 reduce: Any, agree_text: Any = None) -> Attribution:
        """Where this step's non-finite values started; ``reduce`` all-reduces a tensor (MAX) across ranks,
        ``agree_text`` (distributed only) turns each rank's text (or None) into the lowest rank's non-None one.

        One device sync for the recorded ranges, one all-reduce: per module, minus the position of its first
        call that was a forward source (MAX of negatives = the earliest), the backward-source flags, and
        whether any forward output was non-finite; so every rank names the same source.
        """
        flat: list[torch.Tensor] = []

        def add(ranges: list) -> tuple[int, int]:
            start = len(flat)
            for lo, hi in ranges:
                flat.append(lo.float().to(device))
                flat.append(hi.float().to(device))
            return start, len(flat)

        spans = [(i, add(ins), add(outs)) for i, ins, outs in self.fwd]
        gspans = [(i, add([r])) for i, r in self.bwd]
        vals = torch.stack(flat).tolist() if flat else []
        bad = lambda span: not all(math.isfinite(v) for v in vals[span[0]:span[1]])  # noqa: E731
        n = len(self.names)
        none = -float(len(spans) + 1)
        first = [none] * n
        local_detail: dict[int, str] = {}
        any_fwd_bad = 0.0
        for pos, (i, ins, outs) in enumerate(spans):
            if not bad(outs):
                continue
            any_fwd_bad = 1.0
            if bad(ins) or first[i] != none:
                continue
            first[i] = -float(pos)
            amax = max((abs(v) for v in vals[ins[0]:ins[1]]), default=None)
            local_detail[i] = (f"its output went non-finite ({_kind(vals[outs[0]:outs[1]])}) from finite inputs"
                               + (f" (max |input| {amax:.3g})" if amax is not None else " (no floating inputs)"))
        grad_seen = [False] * n
        grad_bad = [False] * n
        for i, span in gspans:
            grad_seen[i] = True
            grad_bad[i] = grad_bad[i] or bad(span)
        bwd_src = [0.0] * n
        if backward_counts:
            for i, name in enumerate(self.names):
                if grad_seen[i] and not grad_bad[i] and any(
                        name == "" or p == name or p.startswith(name + ".") for p in nonfinite_params):
                    bwd_src[i] = 1.0
        agreed = reduce(torch.tensor(first + bwd_src + [any_fwd_bad], device=device, dtype=torch.float64)).tolist()
        forward_nonfinite = agreed[-1] > 0
        best = max(range(n), key=lambda i: agreed[i]) if n else None
        source = None
        detail = ""
        if best is not None and agreed[best] > none:
            source = self.names[best]
            seen: str | None = local_detail.get(best)  # None on a rank that did not see it itself
            if agree_text is not None:  # the lowest rank that saw it says what it saw, so promotions read the same
                seen = agree_text(seen)
            detail = seen if seen is not None else "its output went non-finite from finite inputs (on another rank)"
        # A non-finite forward explains the gradients; backward sources only count after a finite forward
        # (otherwise the module after the source, whose output gradient is still finite, would be blamed).
        bwd = () if forward_nonfinite else tuple(
            _innermost({self.names[i] for i in range(n) if agreed[n + i]}))
        return Attribution(source, detail, forward_nonfinite, bwd)


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and gradients); any other tensor itself."""
    return cast(torch.Tensor, t.to_local()) if _is_dtensor(t) else t  # type: ignore[attr-defined]


def stored_values(t: torch.Tensor) -> torch.Tensor:
    """The values a tensor stores, as a strided tensor: a sparse tensor's (a COO tensor coalesced first, so that a
    repeated index holds the sum the dense tensor would, as an ``nn.Embedding(sparse=True)`` gradient repeats the
    rows of repeated tokens); another layout's dense form; a strided tensor itself. The elements a sparse tensor
    does not store are zeros: finite, adding nothing to a norm, and counted apart by the caller where counts
    matter. (The controller's norm and non-finite scan; the audit's statistics, capture/stats.py.)"""
    if t.layout == torch.strided:
        return t
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    return t.values() if t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc) \
        else t.to_dense()


def _same(x: float, y: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y))


def _set_dict(m: torch.nn.Module, d: dict) -> None:
    cur = m.__dict__
    for k in [k for k in cur if k not in d]:
        del cur[k]
    cur.update(d)


def _versions(x: Any, out: list) -> list:
    if isinstance(x, torch.Tensor):
        out.append((x, x._version))
    elif isinstance(x, (tuple, list)):
        for v in x:
            _versions(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _versions(v, out)
    return out


def _rng_state(cuda_devices: tuple[int, ...]) -> tuple:
    """torch's CPU generator and those of ``cuda_devices`` (the model's), and Python's and NumPy's global ones (a
    forward may draw masks from ``np.random``, as wav2vec2's does): the replay draws what the step drew."""
    cuda = ([(d, torch.cuda.get_rng_state(d)) for d in cuda_devices]
            if cuda_devices and torch.cuda.is_initialized() else [])
    return torch.get_rng_state(), cuda, host_rng.state()


def _set_rng_state(state: tuple) -> None:
    cpu, cuda, host = state
    torch.set_rng_state(cpu)
    for d, s in cuda:
        torch.cuda.set_rng_state(s, d)
    host_rng.set_state(host)


_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass
class _RootCall:
    """One grad-enabled call of the root module, as the replay needs it."""

    args: tuple
    kwargs: dict
    versions: list  # (tensor, its version) of every tensor argument
    dicts: list  # (module, shallow copy of its __dict__) before the call
    rng: tuple
    autocast: tuple  # per device type (enabled, dtype), then the cache flag
    tf32: Any
    out_ranges: list | None = None  # (min, max) of the root's floating outputs


class _ReplayProbe:
    """Records each grad-enabled root call cheaply; on a bad step replays it under a :class:`_SourceProbe`
    (see the module docstring, "replay")."""

    MAX_CALLS = 16  # root calls kept between two steps (more: the oldest are dropped, and said so)

    def __init__(self, root: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]]) -> None:
        self.root = root
        self.modules = modules
        self.names = [n for n, _ in modules]
        self.calls: list[_RootCall] = []
        self.dropped = 0
        self._replaying = False
        self._all = list(root.modules())
        # the CUDA generators a replay must put back: the devices the model lives on (all of them once, not every
        # GPU of the node at every step)
        self._cuda = tuple(sorted({t.device.index or 0 for t in (*root.parameters(), *root.buffers()) if t.is_cuda}))
        if not self._cuda and torch.cuda.is_available():
            self._cuda = (torch.cuda.current_device(),) if torch.cuda.is_initialized() else (0,)
        self.handles = [root.register_forward_pre_hook(self._pre, with_kwargs=True),
                        root.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._replaying or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        tf32 = forward_state() if self._cuda and torch.cuda.is_initialized() else None
        autocast = tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)
        self.calls.append(_RootCall(args, dict(kwargs), _versions((args, kwargs), []),
                                    [(m, dict(m.__dict__)) for m in self._all], _rng_state(self._cuda),
                                    autocast + (torch.is_autocast_cache_enabled(),), tf32))
        if len(self.calls) > self.MAX_CALLS:
            del self.calls[0]
            self.dropped += 1

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if (self._replaying or not torch.is_grad_enabled() or torch.compiler.is_compiling() or not self.calls
                or self.calls[-1].out_ranges is not None):
            return
        self.calls[-1].out_ranges = [r for t in _floating_tensors(output, []) if (r := _range(t)) is not None]

    def clear(self) -> None:
        self.calls.clear()
        self.dropped = 0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.clear()

    def _run(self, call: _RootCall) -> list:
        """Run the root's forward again from the call's starting state; its output ranges."""
        with contextlib.ExitStack() as stack:
            for d, (enabled, dtype) in zip(_AUTOCAST_DEVICES, call.autocast):
                stack.enter_context(torch.autocast(d, dtype=dtype, enabled=enabled, cache_enabled=call.autocast[-1]))
            saved = switch_to(call.tf32) if call.tf32 is not None else None
            if saved is not None:
                stack.callback(restore, saved)
            stack.enter_context(torch.enable_grad())
            for m, d in call.dicts:
                _set_dict(m, d)
            _set_rng_state(call.rng)
            out = self.root(*call.args, **call.kwargs)
            return [r for t in _floating_tensors(out, []) if (r := _range(t)) is not None]

    def evaluate(self, nonfinite_params: set[str], backward_counts: bool, device: torch.device,
                 reduce: Any, agree_text: Any = None) -> Attribution:
        """Replay the step's root calls with per-call records, then decide as :meth:`_SourceProbe.evaluate`."""
        why = ""
        if self.dropped:
            why = f"{self.dropped} earlier forward call(s) since the last step were not kept"
        elif not self.calls:
            why = ("no forward call was recorded since the last step (none with gradients enabled, or the model was "
                   "compiled after the controller was made: pass the compiled model to the controller)")
        elif any(t._version != v for c in self.calls for t, v in c.versions):
            why = "an input tensor was modified in place after the forward"
        probe = _SourceProbe(self.modules, backward=False)
        after = [(m, dict(m.__dict__), dict(m._buffers)) for m in self._all]
        buffers = [(b, b.detach().clone()) for b in {id(b): b for _, _, bs in after for b in bs.values()
                                                       if b is not None}.values()]
        rng = _rng_state(self._cuda)
        self._replaying = True
        try:
            if not why:
                for call in self.calls:
                    got = self._run(call)
                    want = call.out_ranges or []
                    if len(got) != len(want) or not all(
                            _same(float(x), float(y)) for g, w in zip(got, want) for x, y in zip(g, w)):
                        why = "running the forward again gave other outputs (state outside the model changed)"
                        break
        finally:
            self._replaying = False
            for m, d, bs in after:
                _set_dict(m, d)
                m._buffers.clear()
                m._buffers.update(bs)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            _set_rng_state(rng)
            probe.remove_hooks()
        if why:
            probe.clear()
        a = probe.evaluate(nonfinite_params, backward_counts, device, reduce,
                           agree_text)  # collectives match on every rank
        probe.clear()
        if why:
            return Attribution(None, "", a.forward_nonfinite, (), unreproduced=why)
        return a
