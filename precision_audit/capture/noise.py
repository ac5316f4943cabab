"""The FP32 noise floor: how much the reference itself moves when only the reduction order changes.

On a CPU the order in which a GEMM or a convolution sums its products depends on how many threads split the
work, so the same FP32 model gives slightly different losses at 1 and at 2 threads — and every low-precision
pass, which rounds those FP32 sums, moves with it (ResNet-50's BF16 loss change was 1.85e-2 at 2 threads and
1.15e-2 at 1). A verdict or a plan decision that rests on a difference smaller than that spread is an accident of
the thread count.

:func:`measure_noise_floor` re-runs, forward only and with no instrumentation, the FP32 reference and each
format's pass at a second thread count (1 when the audit runs with more, else 2), and compares the FP32 run with
the reference on the loss, the model output and a sample of layers. The pair of thread counts is the same
whichever of the two the audit runs with, so a decision taken on the pair (the upper end of what the two
orders measured: see docs/plan.md, "Noise floor") is the same at 1 and at 2 threads. On CUDA the thread count
does not change a kernel's reduction order; there the second run repeats the first (run-to-run
nondeterminism only) and says so.

On a CPU it also repeats the instrumented FP32 reference pass (forward, each module re-run alone per format,
backward) at the second thread count, for each module's first-order loss impact at that order
(:func:`second_order_impacts`): the planner takes the larger of the two orders' impacts, so that an audit at 1
thread and one at 2 threads give it the same numbers (docs/plan.md, "Noise floor").
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..formats import Format
from ..model_names import named_modules
from .records import float_tensors
from .reference_store import Kept
from .stats import ErrorStats, MagnitudeHistogram

log = logging.getLogger(__name__)

SAMPLE_LAYERS = 8  # layers whose FP32 outputs are compared between the two orders, spread over the model


@dataclass
class OrderRun:
    """One forward pass at the second reduction order: its loss and its output against that order's FP32 run."""

    loss: float | None
    output_rel_error: float | None
    error: str | None = None


@dataclass
class NoiseFloor:
    """What the second reduction order measured. ``threads``: (the audit's, the second run's); None on CUDA."""

    method: str
    threads: tuple[int, int] | None
    reference_loss: float | None  # the FP32 loss at the second order
    loss_rel: float  # |L_fp32(order 2) - L_fp32(order 1)| / |L_fp32(order 1)|
    output_rel_error: float  # the FP32 output of order 2 against order 1 (relative L2)
    layers: dict[str, float] = field(default_factory=dict)  # sample: module -> relative L2 of its FP32 output
    runs: dict[Format, OrderRun] = field(default_factory=dict)  # each format's pass at the second order
    # the FP32 output at the second order, kept as the references are (on the host on a GPU, in the reference
    # file on a CPU: capture/reference_store.py), for the format forwards and the plan's at that order
    outputs: list[Kept] | None = field(default=None, repr=False)
    # each module's |first-order loss impact| per format at the second order (None: not measured there); None
    # on CUDA, or when that pass failed (``impacts_note`` says why)
    impacts: dict[str, dict[Format, float | None]] | None = field(default=None, repr=False)
    impacts_note: str | None = None
    impacts_wall_s: float | None = None
    # the decisions whose figures were weighed for a re-check at the second order, each with why it was or was not
    # re-checked (planning/second_order.py fills it: ``Recheck.to_dict``); the margin it used
    rechecks: list[dict[str, Any]] = field(default_factory=list)
    margins: dict[str, float] | None = None

    def rel_change(self, loss: float | None) -> float | None:
        """A loss measured at the second order, against the FP32 loss of that order."""
        ref = self.reference_loss
        if loss is None or ref is None or not math.isfinite(loss):
            return None
        return abs(loss - ref) / abs(ref) if ref else abs(loss)

    def loss_rel_change(self, fmt: Format) -> float | None:
        """``fmt``'s loss change against the FP32 run of the same (second) order."""
        r = self.runs.get(fmt)
        return None if r is None else self.rel_change(r.loss)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "threads": list(self.threads) if self.threads else None,
            "fp32_loss_rel": self.loss_rel,
            "fp32_output_rel_error": self.output_rel_error,
            "fp32_layers_rel_l2": dict(self.layers),
            "second_order": {f.value: {"loss": r.loss, "loss_rel_change": self.loss_rel_change(f),
                                       "output_rel_error": r.output_rel_error, "error": r.error}
                             for f, r in self.runs.items()},
            "rule": RULE if self.margins is None else RULE_MARGIN,
            # The text is the same in every run of the same audit; the pass's wall time is a field of its own.
            "planner_impacts": ("each module's first-order loss impact measured at both orders (the reference pass "
                                "repeated at the second); the planner takes the larger"
                                if self.impacts is not None else self.impacts_note),
            "planner_impacts_wall_s": self.impacts_wall_s if self.impacts is not None else None,
            "margins": dict(self.margins) if self.margins is not None else None,
            "rechecks": [dict(r) for r in self.rechecks],
        }


RULE = ("a format is within budget only when both reduction orders measure it within budget; the plan's "
        "verification is held to the same rule")
RULE_MARGIN = ("a decision rests on the upper end of what the two reduction orders measure; a figure is re-measured "
               "at the second order only where that can change the decision: within its margin below its threshold "
               "(above it, the decision is already 'over budget' whatever the other order gives; further below, the "
               "other order cannot carry it over; a loss change is also judged by its first-order sum: "
               "docs/plan.md, \"Noise floor\")")


def second_threads(main: int) -> int:
    """The other member of the pair {1, 2} (or 1 for a machine running more threads)."""
    return 1 if main > 1 else 2


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _sample(session) -> list[torch.nn.Module]:
    recs = sorted((r for r in session.layers.values() if r.name and r.computes), key=lambda r: r.order)
    if not recs:
        return []
    step = max(1, len(recs) // SAMPLE_LAYERS)
    names = list(dict.fromkeys(r.name for r in recs[::step][:SAMPLE_LAYERS - 1] + [recs[-1]]))
    by_name = dict(named_modules(session.model))
    return [by_name[n] for n in names if n in by_name]


def measure_noise_floor(session, formats: tuple[Format, ...], full: bool = True) -> NoiseFloor:
    """The FP32 reference at the second reduction order (the noise floor) and, with ``full``, everything else there:
    each format's forward and the planner's impacts (:func:`complete`; see the module doc).

    ``session`` is a :class:`~precision_audit.capture.CaptureSession` whose reference and format passes
    have run (its FP32 outputs are what the sample of layers is compared against). Without ``full`` only the FP32
    forward runs (one no-grad forward); the audit then re-measures at that order only the formats and the planner
    inputs a decision needs (:func:`recheck_formats`, :func:`complete`; docs/plan.md, "Noise floor").
    """
    cuda = session.config.mode == "cuda"
    main = torch.get_num_threads()
    alt = None if cuda else second_threads(main)
    method = ("the FP32 reference and each format re-run forward at the same settings (on CUDA the CPU thread "
              "count does not change a kernel's reduction order: this measures run-to-run nondeterminism only)"
              if cuda else f"the FP32 reference and each format re-run forward with {alt} CPU thread(s) instead of "
                           f"{main}: the GEMMs and convolutions split their sums differently")
    noise = NoiseFloor(method=method, threads=None if alt is None else (main, alt), reference_loss=None,
                       loss_rel=math.nan, output_rel_error=math.nan,
                       impacts_note="not measured: on CUDA the thread count does not change the reduction order"
                       if cuda else NOT_NEEDED)
    fp32 = _Fp32Order(session)
    if full and alt is not None:
        # First: its forward is the FP32 forward at this order, and it leaves the calls on the batch (BatchCall)
        # whose impacts at this order the format forwards measure (capture/format_pass.py, _post_batch_only)
        _impacts_pass(session, noise, fp32)
    if fp32.outputs is None:  # without the repeat (not asked for, on CUDA, or it failed): a forward of its own
        with _threads(alt):
            fp32.run()
    main_loss = session.reference.loss if session.reference else None
    ref_loss = fp32.loss
    noise.reference_loss, noise.outputs, noise.output_rel_error = ref_loss, fp32.outputs, fp32.out_err
    noise.layers = {n: e.rel_l2 for n, e in fp32.layers.items()}
    noise.loss_rel = (abs(ref_loss - main_loss) / abs(main_loss) if main_loss else abs(ref_loss - (main_loss or 0.0))) \
        if ref_loss is not None and main_loss is not None else math.nan
    if full:
        _format_forwards(session, noise, formats)
    session.controls.reset()
    session.state.batch_call_records.clear()
    return noise


#: ``planner_impacts`` until the planner's inputs are measured at the second order (planning/second_order.py)
NOT_NEEDED = "not measured: no planner choice needed them (docs/plan.md, \"Noise floor\")"


def recheck_formats(session, noise: NoiseFloor, formats: tuple[Format, ...]) -> None:
    """Each of ``formats``' forward at the second order, against that order's FP32 output (into ``noise.runs``):
    the re-check of a verdict whose figures lie near their budget (planning/second_order.py)."""
    _format_forwards(session, noise, tuple(f for f in formats if f not in noise.runs))
    session.controls.reset()


def complete(session, noise: NoiseFloor, formats: tuple[Format, ...]) -> None:
    """Everything else at the second order: the planner's impacts (the reference pass repeated there) and every
    format's forward, as :func:`measure_noise_floor` with ``full`` measures them (the FP32 noise floor is kept)."""
    if noise.threads is None:  # on CUDA: no second order of impacts; the formats' forwards repeat the first
        recheck_formats(session, noise, formats)
        return
    _impacts_pass(session, noise, None)
    sink = noise.impacts is not None and any(c.refs is not None for c in session.state.batch_call_records.values())
    # a format forward already run for a verdict is run again only for the calls on the batch it measures
    _format_forwards(session, noise, formats if sink else tuple(f for f in formats if f not in noise.runs))
    session.controls.reset()
    session.state.batch_call_records.clear()


def _impacts_pass(session, noise: NoiseFloor, fp32: _Fp32Order | None) -> None:
    t0 = time.perf_counter()
    assert noise.threads is not None
    noise.impacts, noise.impacts_note = second_order_impacts(session, noise.threads[1], fp32)
    noise.impacts_wall_s = time.perf_counter() - t0


def _format_forwards(session, noise: NoiseFloor, formats: tuple[Format, ...]) -> None:
    """``formats``' forwards at the second order; with the planner's impacts being measured (the calls on the batch
    of the repeated reference pass still recorded), each also gives those calls' impacts, into ``noise.impacts``."""
    sink: dict[str, dict[Format, float]] | None = {} if noise.impacts is not None and any(
        c.refs is not None for c in session.state.batch_call_records.values()) else None
    alt = noise.threads[1] if noise.threads else None
    with _threads(alt):
        for f in formats:
            run = session.runs.get(f)
            if run is not None and run.error:
                continue
            t0 = time.perf_counter()
            noise.runs[f] = _format_forward(session, f, noise.outputs, sink)
            if sink is not None and noise.impacts_wall_s is not None:
                noise.impacts_wall_s += time.perf_counter() - t0
    if noise.impacts is not None and sink is not None:
        for name, per in sink.items():
            noise.impacts.setdefault(name, {}).update(per)


class _Fp32Order:
    """The FP32 forward at the second order: its loss, its outputs, their error against the main order's, and a
    sample of layers' outputs against the main order's. Read from the repeated reference pass's own forward when
    it runs (:func:`second_order_impacts`), else from a forward of its own (:meth:`run`)."""

    def __init__(self, session) -> None:
        self.session = session
        self.refs = session.state.ref_outputs  # the reference pass's FP32 outputs, per module and call
        self.root_ref = (self.refs.get(id(session.model)) or [None])[0]
        self.sample = _sample(session)
        self.loss: float | None = None
        self.outputs: list[Kept] | None = None
        self.out_err = math.nan
        self.layers: dict[str, ErrorStats] = {}

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Forward hooks on the sample of layers (the first call of each, never a local re-run's)."""
        session, hooks = self.session, []

        def hook_for(name: str, mid: int):
            def hook(m, args, out):
                refs = self.refs.get(mid)
                ys = float_tensors(out)
                if session.calls.rerunning or not refs or name in self.layers or len(refs[0]) != len(ys):
                    return
                e = ErrorStats()
                for r, y in zip(refs[0], ys):
                    if r.shape == y.shape:
                        e.update(session.state.refs.for_stats(r, y), y.detach())
                self.layers[name] = e
            return hook

        for m in self.sample:
            hooks.append(m.register_forward_hook(hook_for(session.calls.names[id(m)], id(m))))
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    def output(self, out: Any, loss: torch.Tensor) -> None:
        self.loss = float(loss.detach().float())
        ys = [y.detach() for y in float_tensors(out)]
        if self.root_ref is not None and len(self.root_ref) == len(ys):
            e = ErrorStats()
            for r, y in zip(self.root_ref, ys):
                e.update(self.session.state.refs.for_stats(r, y), y)
            self.out_err = e.rel_l2
        self.outputs = [self.session.state.refs.keep(y) for y in ys]

    def run(self) -> None:
        """A forward of its own (on CUDA, or when the repeated reference pass failed)."""
        session = self.session
        self.layers.clear()
        try:
            session.controls.reset()
            with self.watching(), torch.no_grad(), session.controls.fp32_switches(), \
                    session.controls.same_draws(Format.FP32):  # the reference's dropout masks (capture/rng_replay.py)
                out = session.controls.forward()
                self.output(out, session.controls.loss_of(out))
        finally:
            session.calls.stack.clear()


def second_order_impacts(session, threads: int, fp32: _Fp32Order | None = None
                         ) -> tuple[dict[str, dict[Format, float | None]] | None, str | None]:
    """Each module's |first-order loss impact| per format, from the reference pass repeated at ``threads``.

    The pass is the session's own :meth:`reference_run`, same code and same seed, so the figures at a thread count
    are the ones an audit run at that thread count measures itself. Its records go to a scratch set; the main
    pass's records, outputs and gradients are put back afterwards. Returns (impacts, None), or (None, why) when the
    pass failed (the planner then uses the main order's impacts alone). ``fp32``: also read the FP32 forward at
    this order from the pass's own forward (the noise floor's loss, outputs and sample of layers).
    """
    saved = (session.layers, session.grad_all, session.state.ref_outputs, session.reference,
             session.state.ref_grad_nonfinite, list(session.warnings), dict(session.memory))
    session.layers, session.grad_all, session.state.ref_outputs = {}, MagnitudeHistogram(), {}
    session.state.ref_grad_nonfinite = {}
    # Only the loss impacts are read from this pass: it skips the histograms, the FP32 references, the local
    # error sums and the op tracker (it reads the first pass's per-call op counts), none of which the impacts
    # depend on (docs/performance.md, "Second order")
    session.state.impacts_only = True
    session.state.on_reference_output = fp32.output if fp32 is not None else None
    try:
        with _threads(threads), (fp32.watching() if fp32 is not None else contextlib.nullcontext()):
            session.reference_run()
        return ({r.name: {f: (fs.loss_impact_abs if fs.impact_measured else None) for f, fs in r.formats.items()}
                 for r in session.layers.values()}, None)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # the main pass succeeded at the same settings: reported, never fatal
        log.warning("the reference pass at %d thread(s) failed (%s); the planner uses one order's impacts", threads, e)
        return None, f"not measured: the reference pass at {threads} thread(s) raised {type(e).__name__}: {e}"
    finally:
        session.state.impacts_only = False
        session.state.on_reference_output = None
        (session.layers, session.grad_all, session.state.ref_outputs, session.reference,
         session.state.ref_grad_nonfinite, session.warnings, session.memory) = saved
        session.state.clone_cache.clear()
        session.calls.stack.clear()
        session.controls.reset()


def _format_forward(session, fmt: Format, ref_outputs: list[Kept] | None,
                    sink: dict[str, dict[Format, float]] | None = None) -> OrderRun:
    """``fmt``'s forward at this order; with ``sink``, also the |loss impact| of each call on the batch (whose
    local error is its output in this forward: capture/reference_pass.py, BatchCall), into ``sink``."""
    session.controls.reset()
    try:
        if sink is not None:
            session.state.phase, session.state.batch_sink = fmt, sink
        with torch.no_grad(), session.controls.autocast(fmt), session.controls.same_draws(fmt):
            out = session.controls.forward()
            loss = float(session.controls.loss_of(out).detach().float())
        session.state.phase, session.state.batch_sink = None, None
        ys = float_tensors(out)
        err = None
        if ref_outputs is not None and len(ref_outputs) == len(ys):
            e = ErrorStats()
            for r, y in zip(ref_outputs, ys):
                e.update(session.state.refs.for_stats(r, y), y)
            err = e.rel_l2
        return OrderRun(loss=loss, output_rel_error=err)
    except torch.OutOfMemoryError:
        raise  # the device's limit, not the format's: the audit stops with cli.py's advice (docs/gpu.md)
    except Exception as e:  # reported beside the figure, never fatal: the main pass already measured it
        return OrderRun(loss=None, output_rel_error=None, error=f"{type(e).__name__}: {e}")
    finally:
        session.state.phase, session.state.batch_sink = None, None
        session.calls.stack.clear()


def plan_forward(session, noise: NoiseFloor, policy, default: Format | None) -> OrderRun:
    """The plan's verification forward at the second reduction order, against that order's FP32 run."""
    cuda = session.config.mode == "cuda"
    alt = None if cuda else (noise.threads[1] if noise.threads else None)
    device_type = "cuda" if cuda else "cpu"
    with _threads(alt):
        session.controls.reset()
        from ..runtime.apply import apply_policy

        handle = apply_policy(session.model, policy, device_type=device_type)
        try:
            with torch.no_grad(), (session.controls.autocast(default) if default else contextlib.nullcontext()), \
                    session.controls.same_draws(default or Format.FP32):
                out = session.controls.forward()
                loss = float(session.controls.loss_of(out).detach().float())
            ys = float_tensors(out)
            err = None
            if noise.outputs is not None and len(noise.outputs) == len(ys):
                e = ErrorStats()
                for r, y in zip(noise.outputs, ys):
                    e.update(session.state.refs.for_stats(r, y), y)
                err = e.rel_l2
            return OrderRun(loss=loss, output_rel_error=err)
        except torch.OutOfMemoryError:
            raise  # the device's limit, not the plan's fault: it must not count as a broken plan (docs/gpu.md)
        except Exception as e:  # the plan itself fails: reported as a broken plan, not a crash
            return OrderRun(loss=None, output_rel_error=None, error=f"{type(e).__name__}: {e}")
        finally:
            handle.remove()
            session.calls.stack.clear()
            session.controls.reset()
