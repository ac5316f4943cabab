"""The capture session of one rank: the single-process session, with every pass's statistics reduced across ranks.

:class:`DistributedCaptureSession` runs the same passes as :class:`~precision_audit.capture.CaptureSession`
on this rank's share of the global batch, and after each pass replaces the records that pass wrote with their
sums over every rank (precision_audit/distributed/reduce.py). Every rank therefore holds the global batch's
statistics after every pass, takes the same decisions (the FP16 loss scale, the plan and its verification) and so
stays in step with the others for the next collective.

The loss is the global batch's on every rank (:class:`_GlobalLoss`): each rank's loss, weighted by its share of
the batch, is summed across ranks in the forward; the backward passes each rank's gradient through unchanged, so
each rank backpropagates its share of the global loss, as data-parallel training does. This assumes a loss that
is a mean over the batch's samples (the inferred cross-entropy and MSE are; docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..capture import CaptureSession
from ..capture import noise as _noise
from ..capture.calls import CallStack
from ..capture.ranks import GradHook, MakeGradHook, Ranks, tensor_key
from ..capture.reference_pass import LOSS_SOURCE
from ..capture.stats import ErrorStats, blocks, dot64
from ..formats import Format
from . import reduce as R
from . import saved as saved_copies
from .grads import GradTaker
from .lockstep import Lockstep

#: What the session calls when the model raised on this rank: (the exception, which part of which pass, the module
#: that raised or None). It returns when every rank raised there alike; else it ends the audit (run.py, failure.py).
ModelRaised = Callable[[BaseException, str, "str | None"], None]
_AGREED = "_precision_audit_agreed"
T = TypeVar("T")



def value_signature(t: torch.Tensor) -> list[float]:
    """What the ranks compare to tell whether ``t`` holds the same values on each: its size, and in float64 the sum,
    the sum of squares and the sum weighted by position (1-based, row-major) of its finite elements, and how many
    are not finite. Made a block at a time (capture/stats.py's :func:`blocks`), summed on the device and read once:
    over a whole module output the float64 copies were ~50 bytes an element (a GPT's logits at batch 32 would have
    asked ~20 GB of a GPU; docs/distributed.md, "Memory per rank")."""
    x = t.detach().reshape(-1)
    acc = torch.zeros(4, dtype=torch.float64, device=x.device)
    for i in blocks(x.shape):
        b = (x[i] if i else x).to(torch.float64)
        start = i[0].start if i else 0
        ok = torch.isfinite(b)
        f = torch.where(ok, b, 0.0)
        idx = torch.arange(start + 1, start + b.numel() + 1, dtype=torch.float64, device=b.device)
        acc += torch.stack([f.sum(), (f * f).sum(), (f * idx).sum(), (~ok).sum(dtype=torch.float64)])
    return [float(x.numel()), *acc.cpu().tolist()]

class _GlobalLoss(torch.autograd.Function):
    """Forward: the sum over ranks of the (weighted) local losses. Backward: the gradient passes through
    unchanged, since d(sum_r L_r)/dL_r = 1 for this rank's own term. ``label`` says which loss it is: every rank
    must be summing the same kind (lockstep.py)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, lockstep: Lockstep, label: str) -> torch.Tensor:
        lockstep.check(label)
        out = local.detach().clone().to(torch.float64)  # on the loss's device: its backend serves it (run.py)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=lockstep.group)
        return out.to(local.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


_GLOBAL_MARK = "_precision_audit_global"


def _globalize_scalars(out: Any, weight: float, lockstep: Lockstep) -> Any:
    """The model's own scalar outputs (a Hugging Face model's ``loss``), each a mean over this rank's samples,
    replaced by the global batch's value (weighted sum over ranks; the backward passes through unchanged)."""
    def one(t: torch.Tensor) -> torch.Tensor:
        g = _GlobalLoss.apply(t * weight if weight != 1.0 else t, lockstep, "the model's own scalar output")
        setattr(g, _GLOBAL_MARK, True)
        setattr(g, LOSS_SOURCE, t)  # t's gradient is this rank's weight, not one a format computes (kept alive)
        return g

    if isinstance(out, torch.Tensor):
        return one(out) if out.dim() == 0 and out.is_floating_point() else out
    if isinstance(out, dict):
        for k in list(out.keys()):
            v = out[k]
            if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point():
                out[k] = one(v)
        return out
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(_globalize_scalars(v, weight, lockstep) if isinstance(v, torch.Tensor) else v for v in out)
    return out


def _is_global(t: torch.Tensor) -> bool:
    """A tensor marked by :func:`_globalize_scalars`, or a view of one (``loss.float().reshape(())``)."""
    while t is not None:
        if getattr(t, _GLOBAL_MARK, False):
            return True
        t = t._base  # type: ignore[assignment]
    return False


class _ReducedErrorStats(ErrorStats):
    """noise.py's per-call error sums, whose ratios are taken over every rank's sums (installed for the session)."""

    lockstep: Lockstep | None = None

    @property
    def rel_l2(self) -> float:
        return ErrorStats.rel_l2.fget(R.reduced_error_copy(self, self.lockstep))  # type: ignore[attr-defined]


class RankReductions(Ranks):
    """The capture session's hook (capture/ranks.py) on one rank of a distributed audit: each pass's statistics
    reduced across ranks when it ends, a tensor every rank holds alike counted once (rank 0), the model's calls kept
    in lockstep, and an exception of the model's own agreed across ranks (or the audit ends; failure.py)."""

    # every local error is a re-run's, added up over ranks after the reference pass (reduce.reference_fields)
    batch_calls = False
    # FSDP2 reduces each parameter's gradient in its backward hooks: the second order takes the whole backward
    outputs_only_backward = False

    def __init__(self, lockstep: Lockstep, model_raised: ModelRaised | None = None) -> None:
        self.lockstep = lockstep
        self.group = lockstep.group
        self.model_raised = model_raised
        self.stage = "FP32 reference pass"  # where the model is, for the message of an exception on one rank
        self.raised_count = 0
        self.rank = dist.get_rank(self.group)
        self._impact_log: list[tuple[Any, Format, float]] = []
        # module outputs that are the same tensor on every rank (computed from no sample: a position embedding's
        # output): counted once (rank 0) and their gradients summed over ranks, see replicated()
        # key -> (the tensor, weakly, and the answer): a hit must be the very tensor, on every rank alike (a freed
        # tensor's id and address reused on one rank only would skip this collective there: a deadlock)
        self._same_everywhere: dict[tuple, tuple[weakref.ref, bool]] = {}
        self._pending_flags: list[str] = []
        self._format_depth = 0

    def bind(self, calls: CallStack, refs: Any, grad_nonfinite: Callable[..., tuple[int, int]]) -> None:
        self.calls, self.refs = calls, refs
        self.grads = GradTaker(calls, grad_nonfinite)  # FSDP2's sharded gradients read as they arrive (grads.py)

    # -- the model's own code: an exception must be every rank's, or the audit ends (failure.py) ------------
    @contextlib.contextmanager
    def user_code(self, part: str) -> Iterator[None]:
        try:
            yield
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit too: sys.exit() in the model on one rank
            self.raised(e, part)
            raise

    def raised(self, e: BaseException, part: str) -> None:
        """The model raised ``e`` on this rank: returns when every rank raised the same there (the audit goes on
        as one process's would, with the same finding); else the audit ends naming this rank."""
        if self.model_raised is None or getattr(e, _AGREED, False):
            return
        with contextlib.suppress(AttributeError, TypeError):
            setattr(e, _AGREED, True)  # noqa: B010 - once per exception, however many wrappers it crosses
        self.raised_count += 1
        where = self.calls.names.get(self.calls.stack[-1], "?") if self.calls.stack else None
        self.model_raised(e, f"{part} of the {self.stage}", where)

    def module_called(self, name: str) -> None:
        self.lockstep.called(name)

    # -- tensors that are not split along the batch ----------------------------------------------------------
    def replicated(self, t: torch.Tensor, label: str = "a module output") -> bool:
        """Whether ``t`` holds the same values on every rank: a tensor computed from no sample of the batch (a
        position embedding's output, a causal mask). Its statistics are rank 0's alone, and the gradient flowing
        into it is the sum of every rank's. All-zero tensors count as per-sample (a zero-initialised layer's
        output is zero for every sample). A collective: called at the same point of every rank's pass, which
        it checks (``label``: what ``t`` is, lockstep.py)."""
        key = tensor_key(t)
        hit = self._same_everywhere.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        hi, lo = self.lockstep.check(label, value_signature(t))
        same = hi == lo and hi[2] > 0
        self._same_everywhere[key] = (weakref.ref(t), same)
        return same

    def reset(self) -> None:
        self._same_everywhere.clear()
        self.grads.reset()

    def counted_here(self, t: Any, label: Callable[[], str]) -> bool:
        # replicated() first, on every rank: it is a collective; a replicated tensor is counted by rank 0 only
        return not (self.replicated(t, label()) and self.rank != 0)

    def outputs(self, name: str, ys: list[torch.Tensor]) -> None:
        # per output that will get a gradient hook: "global" (the model's loss made global: dL/dL is the same on
        # every rank, rank 0 counts it), "sum" (a tensor every rank shares: gradients summed), "local"
        self._pending_flags = ["global" if getattr(y, _GLOBAL_MARK, False) else
                               "sum" if self.replicated(y, f"output {i} of '{name}'") else "local"
                               for i, y in enumerate(ys) if y.requires_grad]

    def local_rerun(self, rec: Any, ys: list[torch.Tensor], rerun: Callable[[], T]) -> T:
        if ys and all(self.replicated(y, f"output {i} of '{rec.name}' re-run") for i, y in enumerate(ys)) \
                and self.rank != 0:
            saved = {f: copy.deepcopy(fs.local) for f, fs in rec.formats.items()}
            diffs = rerun()
            for f, fs in rec.formats.items():
                if fs.local is not None and f in saved:
                    fs.local = saved[f] if saved[f] is not None else ErrorStats()
            return diffs
        return rerun()

    # -- parameter gradients taken as they arrived (grads.py), merged as the ones still held ----------------
    def param_grads_taken(self, layers: dict[int, Any], modules: dict[int, torch.nn.Module], grad_all: Any,
                          fp32_nonfinite: dict[int, torch.Tensor]) -> None:
        taken = self.grads.histograms
        seen: set[int] = set()
        for mid, rec in layers.items():  # attributed as ReferencePass does: the first owner, ties apart
            for p in modules[mid].parameters(recurse=False):
                got = taken.get(id(p))
                if got is None:
                    continue
                if id(p) in seen:
                    rec.grad_param_tied.merge(got[0])
                    continue
                seen.add(id(p))
                rec.grad_param.merge(got[0])
                grad_all.merge(got[0])
                if got[1] is not None:
                    fp32_nonfinite[id(p)] = got[1]
        taken.clear()

    def grads_nonfinite_taken(self, fmt: Format, run: Any, layers: dict[int, Any],
                              modules: dict[int, torch.nn.Module]) -> None:
        taken = self.grads.nonfinite
        for mid, rec in layers.items():  # attributed as FormatPasses does: the first owner
            for p in modules[mid].parameters(recurse=False):
                got = taken.pop(id(p), None)
                if got is not None:
                    rec.formats[fmt].grad_param_nonfinite += got[0]
                    run.param_grads_nonfinite += got[0]
                    run.param_grads_nonfinite_shared += got[1]
        for added, shared in taken.values():  # parameters no module that ran owns
            run.param_grads_nonfinite += added
            run.param_grads_nonfinite_shared += shared
        taken.clear()

    # -- per-call loss impacts, reduced before their absolute value ------------------------------------------
    def grad_hook(self, rec: Any, diffs: dict[Format, Any] | None, own: tuple[int, Any] | None,
                  make: MakeGradHook) -> GradHook:
        inner = make(rec, None, own)
        kind = self._pending_flags.pop(0) if self._pending_flags else "local"

        def hook(g: torch.Tensor) -> None:
            if g is None:
                return
            if kind == "sum":  # the gradient into a tensor every rank shares: the sum of every rank's
                self.lockstep.check(f"the gradient into an output of '{rec.name}' ({list(g.shape)})")
                total = g.detach().clone()  # on its device: the process group's backend for it serves it
                dist.all_reduce(total, group=self.group)
                inner(total if self.rank == 0 else total.new_empty((0,)))
            elif kind == "global":  # dL/dL of the model's own (global) loss: rank 0's alone, kept apart there
                if self.rank == 0:
                    inner(g)
            else:
                inner(g)
            for f, d in (diffs or {}).items():
                # d may be in the references' file (capture/reference_store.py); the same fused product as
                # one process's (capture/reference_pass.py, _reference_grad)
                self._impact_log.append((rec, f, dot64(g.detach(), self.refs.for_stats(d, g))))
        return hook

    # -- the passes, each followed by its reduction --------------------------------------------------------
    @contextlib.contextmanager
    def reference_pass(self, impacts_only: bool) -> Iterator[None]:
        self._impact_log.clear()
        # the second order's repeat reads no gradient of a parameter (grads.py frees them all the same)
        self.grads.phase = None if impacts_only else "ref"
        self.stage = "FP32 pass at the second reduction order" if impacts_only else "FP32 reference pass"
        try:
            yield
        except KeyboardInterrupt:
            self._impact_log.clear()
            raise
        except BaseException as e:  # its FP32 backward (the forward and the loss are agreed on where they raise)
            self._impact_log.clear()
            self.raised(e, "backward")
            raise
        finally:
            self.grads.phase = None

    def reference_done(self, layers: list[Any], grad_all: Any) -> Any:
        red = R.Reduction(self.lockstep, f"the statistics of the {self.stage}")
        R.reference_fields(red, layers)
        red.run()
        R.reduce_impacts(self._impact_log, self.lockstep)
        self._impact_log.clear()
        return R.rebuild_grad_all(layers)

    @contextlib.contextmanager
    def format_pass(self, fmt: Format) -> Iterator[Any]:
        self._format_depth += 1
        outer, self.grads.phase = self.grads.phase, fmt
        self.stage = f"{fmt.value} pass"
        try:
            yield self.raised_count
        finally:
            self._format_depth -= 1
            self.grads.phase = outer

    def format_done(self, fmt: Format, loss_scale: float, run: Any, started: Any, layers: dict[int, Any],
                    root: Any) -> None:
        if run.error is not None and self.raised_count == started and self.model_raised is not None:
            # the pass failed in its backward (recorded as the format's finding): every rank's, or the end
            self.model_raised(RuntimeError(run.error), f"backward of the {self.stage}", None)
        if self._format_depth:  # the runner's own retry (fp32-fallback kernels): reduced once, by the outer call
            return
        red = R.Reduction(self.lockstep, f"the statistics of the {self.stage} (loss scale {loss_scale:g})")
        R.format_fields(red, list(layers.values()), fmt, run)
        red.run()
        if run.output is not None:
            run.output_nonfinite = run.output.nonfinite
        if root is not None and fmt in root.formats and root.formats[fmt].local is not None:
            root.formats[fmt].local = copy.deepcopy(root.formats[fmt].accumulated)


class DistributedCaptureSession(CaptureSession):
    """A :class:`CaptureSession` on one rank, with :class:`RankReductions` as its ranks' hook; see the module
    docstring. ``run_module`` is what the forward calls (a DDP wrapper, or the model itself); hooks and names stay on
    the original ``model``. It overrides none of the session's own methods: only its public door (entering and
    leaving, the plan's verification, the timed steps, the result) adds what a rank needs."""

    def __init__(self, model: torch.nn.Module, forward: Callable[[torch.nn.Module], Any],
                 loss_of: Callable[[Any], torch.Tensor], config: Any, progress: Callable[[str], None] | None = None,
                 *, run_module: torch.nn.Module | None = None, weight: float = 1.0, lockstep: Lockstep | None = None,
                 model_raised: ModelRaised | None = None, untracked: Any = None,
                 original_types: dict[str, str] | None = None) -> None:
        runner = run_module if run_module is not None else model
        self.reductions = ranks = RankReductions(lockstep if lockstep is not None else Lockstep(), model_raised)
        steps = ranks.lockstep

        def forward_through_wrapper(m: torch.nn.Module) -> Any:
            with ranks.user_code("forward"):
                return forward(runner if m is model else m)

        def global_loss(out: Any) -> torch.Tensor:
            with ranks.user_code("loss"):
                local = loss_of(out)
            if _is_global(local):  # the model's own loss (or a view of it), made global at its output already
                return local
            spec = getattr(getattr(loss_of, "__self__", None), "spec", None)  # audit.py's SubjectRun: its kind
            return _GlobalLoss.apply(local * weight if weight != 1.0 else local, steps,
                                     f"the loss ({spec.kind if spec is not None else 'the loss function'})")

        self._weight = weight
        super().__init__(model, forward_through_wrapper, global_loss, config, progress, ranks=ranks)
        self._noise_patch = contextlib.ExitStack()
        self._original_types = dict(original_types or {})  # before fully_shard swapped the classes
        if untracked is not None:
            untracked.calls = self.calls

    # -- context: noise.py's error ratios over every rank --------------------------------------------------
    def __enter__(self) -> DistributedCaptureSession:
        steps = self.reductions.lockstep
        # before the session's own hooks: they must see the global loss the model returns
        self._globalizer = self.model.register_forward_hook(
            lambda m, args, out: _globalize_scalars(out, self._weight, steps))
        self._noise_patch.callback(self._globalizer.remove)
        patched = type("ReducedErrorStats", (_ReducedErrorStats,), {"lockstep": steps})
        saved = _noise.ErrorStats
        setattr(_noise, "ErrorStats", patched)  # noqa: B010 - a module attribute swapped for the audit
        self._noise_patch.callback(setattr, _noise, "ErrorStats", saved)
        try:
            super().__enter__()
        except BaseException:
            self._noise_patch.close()
            raise
        self._noise_patch.callback(self.reductions.grads.remove)
        try:
            self.reductions.grads.install(self.model)
            saved_copies.install(self.model, self._noise_patch)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._noise_patch.close()

    def verify_plan(self, policy: Any, default: Format | None):
        self.reductions.stage = "plan verification"
        run = super().verify_plan(policy, default)
        steps = self.reductions.lockstep
        _, lowest = steps.check("the plan verification's output", [run.output is not None])
        if run.output is not None and lowest[0]:
            run.output = R.reduced_error_copy(run.output, steps)
            run.output_nonfinite = run.output.nonfinite
        elif run.output is not None:
            run.output = None
        return run

    def timed_steps(self, steps: int, traces: bool = True) -> dict[str, list[float]]:
        self.reductions.stage = "timed steps"
        return super().timed_steps(steps, traces)

    def result(self):
        res = super().result()
        for rec in res.layers:
            rec.type = self._original_types.get(rec.name, rec.type)
        return res


class Untracked:
    """Forward hooks around FSDP2's own pre- and post-forward hooks: the all-gathers and copies FSDP runs there
    are not the model's work, and must not make a module look as if it computed something itself (which would
    change which modules are re-run alone, and their op records, against the single-process audit)."""

    def __init__(self) -> None:
        self.calls: CallStack | None = None  # the session's (DistributedCaptureSession sets it)
        self._saved: list[bool] = []
        self.handles: list[Any] = []

    def _pause(self, *args: Any, **kwargs: Any) -> None:
        calls = self.calls
        self._saved.append(bool(calls.rerunning) if calls is not None else False)
        if calls is not None:
            calls.rerunning = True

    def _resume(self, *args: Any, **kwargs: Any) -> None:
        was = self._saved.pop() if self._saved else False
        if self.calls is not None:
            self.calls.rerunning = was

    def install(self, model: torch.nn.Module) -> None:
        """Around every FSDP unit's hooks; call after sharding and before the session installs its own hooks."""
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                self.handles += [
                    m.register_forward_pre_hook(self._pause, prepend=True),
                    m.register_forward_pre_hook(self._resume),
                    m.register_forward_hook(self._pause, prepend=True),
                    m.register_forward_hook(self._resume),
                ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
