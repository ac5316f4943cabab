"""Random draws (dropout masks) taken once, in the FP32 reference pass, and replayed in the other passes.

On CUDA, seeding every pass identically does not give the same dropout masks in every format: the
vectorised dropout kernel's unroll width, so the RNG offset each element gets, depends on the dtype, and
fused attention picks a different kernel (with its own draws) per dtype. Train-mode errors would then be
dominated by mask differences. So in cuda mode (docs/gpu.md, "Dropout in the numerics passes"; docs/memory.md,
"Random draws"):

- the reference pass records, for every random op (ops tagged ``nondeterministic_seeded`` that draw:
  ``native_dropout`` in training, ``bernoulli_``, ``rand``, fused attention with ``dropout_p > 0``, ...), in call
  order, the state of the generator it draws from before and after it, and the op with the shapes, strides and
  dtypes of its tensor arguments — not the draw itself, which is as large as the activation it masks;
- the format passes, each module's local re-runs, the noise floor's forwards and the plan verification replay
  them by position. A draw that depends only on shapes (dropout's mask, ``rand``, ``bernoulli_(p)``, ...) is
  recomputed: the same op on an uninitialised tensor of the reference's dtype, strides and alignment, from the
  recorded generator state, gives the reference's draw bit for bit; ``native_dropout`` is then applied as CUDA's
  kernel computes it (``x * mask * 1/(1-p)`` in fp32, rounded once to the input's dtype). Fused attention with
  dropout runs the pass's own kernel from the recorded state: the memory-efficient kernel draws each element of
  its mask from its position in the attention matrix and the generator's offset, whatever the dtype. A draw
  that depends on the values of its inputs (``bernoulli`` of a probability tensor, ``multinomial``) or on an
  explicit ``generator=`` is kept, in host memory;
- attention with dropout (``scaled_dot_product_attention`` with ``dropout_p > 0``) runs through the
  memory-efficient backend in these passes (the math backend where that one cannot take the inputs, as on a
  CPU), in every dtype: FlashAttention has no FP32 kernel, so the FP32 reference could not draw its masks.
  Attention without dropout draws nothing and keeps its kernels. The timed steps run the user's kernels
  untouched.

A draw whose op or shape differs from the reference's at that position is drawn live and counted
(``ReplayRandom.mismatches``); the audit warns about it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

_aten = torch.ops.aten
_SEEDED = torch.Tag.nondeterministic_seeded
_ALIGN = 256  # bytes: a recomputed draw's input starts at the reference input's address modulo this

#: random ops whose only tensor argument is ``self``, read for its shape, dtype and device only (an in-place
#: fill overwrites it; a ``*_like`` op takes its layout): their draws are recomputed from the generator state
_SHAPE_ONLY = {"bernoulli_.float", "bernoulli.p", "uniform_.default", "normal_.default", "exponential_.default",
               "geometric_.default", "cauchy_.default", "log_normal_.default", "random_.default", "random_.from",
               "random_.to", "rand_like.default", "randn_like.default", "randint_like.default",
               "randint_like.low_dtype"}


def _is_random(func: Any) -> bool:
    return _SEEDED in getattr(func, "tags", ())


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for x in out:
            if isinstance(x, torch.Tensor):
                return x
    return None


def _argument(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value of ``func``'s argument ``name`` in this call (its default when not given); None if it has none."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if name in kwargs:
                return kwargs[name]
            if i < len(args) and not a.kwarg_only:
                return args[i]
            return a.default_value if a.has_default_value() else None
    return None


def _kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    """How a random op's draw is replayed: "dropout" (``native_dropout``), "recompute" (a shape-only draw), "state"
    (fused attention, replayed by running it from the recorded generator state), "kept", or None when it draws
    nothing (dropout off: ``train=False`` or ``dropout_p == 0``)."""
    if func is _aten.native_dropout.default:
        return None if _argument(func, args, kwargs, "train") is False else "dropout"
    p = _argument(func, args, kwargs, "dropout_p")
    if p is not None:  # fused attention (flash, memory-efficient, cuDNN): draws only with dropout
        return "state" if p > 0 else None
    if kwargs.get("generator") is not None:
        return "kept"  # not the default generator, whose state is what is recorded
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors:
        return "recompute"
    if func.__name__ in _SHAPE_ONLY and len(tensors) == 1 and tensors[0] is args[0]:
        return "recompute"
    return "kept"


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    """The device whose generator the op draws from: its tensors', else its ``device`` argument's."""
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            return t.device
    d = kwargs.get("device")
    return torch.device(d) if d is not None else torch.get_default_device()


def _get_state(device: torch.device) -> torch.Tensor | None:
    if device.type == "cpu":
        return torch.get_rng_state()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, device)


class _Template:
    """A tensor argument of a recorded op, kept as its layout: shape, strides, dtype, device, and its address
    modulo :data:`_ALIGN` (CUDA's dropout kernel vectorises by the input's alignment, which sets the mask)."""

    __slots__ = ("shape", "stride", "dtype", "device", "align")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype, self.device = t.shape, t.stride(), t.dtype, t.device
        self.align = t.data_ptr() % _ALIGN

    def make(self) -> torch.Tensor:
        """An uninitialised tensor of this layout (its values are never read: the draws do not depend on them)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        extent = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) if all(self.shape) else 0
        base = torch.empty(extent + _ALIGN // size, dtype=self.dtype, device=self.device)
        offset = ((self.align - base.data_ptr()) % _ALIGN) // size
        return base.as_strided(self.shape, self.stride, offset)


class Draw:
    """One recorded random op: how to give a later pass the reference's draw (see the module doc)."""

    __slots__ = ("func", "kind", "shape", "device", "before", "after", "recipe", "kept")

    def __init__(self, func: Any, kind: str, shape: torch.Size, device: torch.device,
                 before: torch.Tensor | None) -> None:
        self.func, self.kind, self.shape, self.device, self.before = func, kind, shape, device, before
        self.after: torch.Tensor | None = None
        self.recipe: tuple | None = None  # (args, kwargs) with tensors as _Template: "dropout" and "recompute"
        self.kept: torch.Tensor | None = None  # the draw itself, on the host: "kept"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.before, self.after, self.kept) if t is not None)

    def recompute(self) -> Any:
        """The op's output in the reference pass: the same op on fresh tensors of the recorded layouts, from the
        recorded generator state (which it leaves at the recorded state after it)."""
        assert self.recipe is not None and self.before is not None and self.after is not None
        args, kwargs = tree_map(lambda a: a.make() if isinstance(a, _Template) else a, self.recipe)
        _set_state(self.device, self.before)
        out = self.func(*args, **kwargs)
        _set_state(self.device, self.after)
        return out

    def draw(self) -> torch.Tensor:
        """The reference's draw ("recompute" and "kept")."""
        if self.kept is not None:
            return self.kept
        out = _first_tensor(self.recompute())
        assert out is not None
        return out


class RandomDraws:
    """The reference pass's draws, in call order (:class:`Draw`)."""

    def __init__(self) -> None:
        self.draws: list[Draw] = []

    def __len__(self) -> int:
        return len(self.draws)

    def clear(self) -> None:
        self.draws.clear()

    def nbytes(self) -> int:
        """Bytes the record holds (generator states, kept draws): on the host, whatever the device."""
        return sum(d.nbytes() for d in self.draws)


class RecordRandom(TorchDispatchMode):
    """Records every random op into ``draws`` (its generator states and recipe; the draw itself where it depends
    on values)."""

    def __init__(self, draws: RandomDraws) -> None:
        super().__init__()
        self.draws = draws

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs) if _is_random(func) else None
        if kind is None:
            return func(*args, **kwargs)
        device = _device_of(args, kwargs)
        before = _get_state(device) if kind != "kept" else None
        if before is None and kind != "kept":  # a device whose generator is not read here (not cpu or cuda)
            self.draws.draws.append(Draw(func, "live", torch.Size(), device, None))  # drawn live when replayed
            return func(*args, **kwargs)
        recipe = tree_map(lambda a: _Template(a) if isinstance(a, torch.Tensor) else a, (args, kwargs)) \
            if kind in ("dropout", "recompute") else None
        out = func(*args, **kwargs)
        drawn = args[0] if kind == "state" else out[1] if kind == "dropout" else _first_tensor(out)
        if drawn is None:  # nothing to replay it into: drawn live when replayed
            self.draws.draws.append(Draw(func, "live", torch.Size(), device, None))
            return out
        d = Draw(func, kind, drawn.shape, device, before)  # fused attention: the query's shape, its mask's follows
        if kind == "kept":
            d.kept = drawn.detach().to("cpu", copy=True)
        else:
            d.after, d.recipe = _get_state(device), recipe
        self.draws.draws.append(d)
        return out


class ReplayRandom(TorchDispatchMode):
    """Replays ``draws`` from position ``start``: each random op gets the reference's draw at its position."""

    def __init__(self, draws: RandomDraws, start: int = 0) -> None:
        super().__init__()
        self.draws = draws
        self.position = start
        self.replayed = 0
        self.mismatches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs) if _is_random(func) else None
        if kind is None:
            return func(*args, **kwargs)
        k = self.position
        self.position += 1
        rec = self.draws.draws[k] if k < len(self.draws.draws) else None
        if rec is not None and (rec.func is not func or rec.kind != kind):
            rec = None
        if kind == "dropout":
            return self._dropout(func, args, kwargs, rec)
        if kind == "state":
            if rec is None or rec.shape != args[0].shape:
                self.mismatches += 1
                return func(*args, **kwargs)
            assert rec.before is not None and rec.after is not None
            _set_state(rec.device, rec.before)
            out = func(*args, **kwargs)  # the pass's own kernel, drawing the reference's mask
            _set_state(rec.device, rec.after)
            self.replayed += 1
            return out
        out = func(*args, **kwargs)
        target = _first_tensor(out)
        if rec is None or target is None or rec.shape != target.shape:
            self.mismatches += 1
            return out
        target.copy_(rec.draw())  # in place ops mutate args[0], which is target; the others return it
        self.replayed += 1
        return out

    def _dropout(self, func: Any, args: tuple, kwargs: dict, rec: Draw | None) -> Any:
        x = args[0]
        if rec is None or rec.shape != x.shape:
            self.mismatches += 1
            return func(*args, **kwargs)
        p = float(_argument(func, args, kwargs, "p"))
        keep = rec.recompute()[1]
        scale = 1.0 / (1.0 - p) if p < 1 else 0.0
        y = (x.float() * keep * scale).to(x.dtype)  # CUDA's kernel: fp32 math, rounded once
        self.replayed += 1
        return y, keep


class _ReplayableAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` with ``dropout_p > 0`` through the memory-efficient backend, or the math
    backend where that one cannot take the inputs: one backend for every dtype, whose draws replay (module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording(draws: RandomDraws) -> Iterator[None]:
    """The reference pass: attention with dropout through one backend for every dtype, every draw recorded."""
    with _ReplayableAttention(), RecordRandom(draws):
        yield


@contextlib.contextmanager
def replaying(draws: RandomDraws, start: int = 0) -> Iterator[ReplayRandom]:
    """A pass that replays the reference's draws from ``start``."""
    mode = ReplayRandom(draws, start)
    with _ReplayableAttention(), mode:
        yield mode
