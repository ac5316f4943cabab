"""The capture session of one rank: the single-process session, with every pass's statistics reduced across ranks.

:class:`DistributedCaptureSession` runs the same passes as :class:`~precision_audit.capture.runner.CaptureSession`
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
from typing import Any

import torch
import torch.distributed as dist

from ..capture import noise as _noise
from ..capture.reference_pass import LOSS_SOURCE
from ..capture.runner import CaptureSession
from ..capture.stats import ErrorStats, dot64
from ..formats import Format
from . import reduce as R
from . import saved as saved_copies
from .grads import GradTaker
from .lockstep import Lockstep

#: What the session calls when the model raised on this rank: (the exception, which part of which pass, the module
#: that raised or None). It returns when every rank raised there alike; else it ends the audit (run.py, failure.py).
ModelRaised = Callable[[BaseException, str, "str | None"], None]
_AGREED = "_precision_audit_agreed"


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


class DistributedCaptureSession(CaptureSession):
    """A :class:`CaptureSession` on one rank; see the module docstring. ``run_module`` is what the forward calls
    (a DDP wrapper, or the model itself); hooks and names stay on the original ``model``."""

    # every local error is a re-run's, added up over ranks after the reference pass (reduce.reference_fields)
    _batch_calls = False
    # FSDP2 reduces each parameter's gradient in its backward hooks: the second order takes the whole backward
    _outputs_only_backward = False

    def __init__(self, model: torch.nn.Module, forward: Callable[[torch.nn.Module], Any],
                 loss_of: Callable[[Any], torch.Tensor], config: Any, progress: Callable[[str], None] | None = None,
                 *, run_module: torch.nn.Module | None = None, weight: float = 1.0, lockstep: Lockstep | None = None,
                 model_raised: ModelRaised | None = None, untracked: Any = None,
                 original_types: dict[str, str] | None = None) -> None:
        runner = run_module if run_module is not None else model
        self._lockstep = lockstep = lockstep if lockstep is not None else Lockstep()
        self._model_raised = model_raised

        def forward_through_wrapper(m: torch.nn.Module) -> Any:
            with self._user_code("forward"):
                return forward(runner if m is model else m)

        def global_loss(out: Any) -> torch.Tensor:
            with self._user_code("loss"):
                local = loss_of(out)
            if _is_global(local):  # the model's own loss (or a view of it), made global at its output already
                return local
            spec = getattr(getattr(loss_of, "__self__", None), "spec", None)  # audit.py's SubjectRun: its kind
            return _GlobalLoss.apply(local * weight if weight != 1.0 else local, lockstep,
                                     f"the loss ({spec.kind if spec is not None else 'the loss function'})")

        self._weight = weight

        super().__init__(model, forward_through_wrapper, global_loss, config, progress)
        self.group = lockstep.group
        self._stage = "FP32 reference pass"  # where the model is, for the message of an exception on one rank
        self._raised_count = 0
        self._impact_log: list[tuple[Any, Format, float]] = []
        # module outputs that are the same tensor on every rank (computed from no sample: a position embedding's
        # output): counted once (rank 0) and their gradients summed over ranks, see _replicated()
        # key -> (the tensor, weakly, and the answer): a hit must be the very tensor, on every rank alike (a freed
        # tensor's id and address reused on one rank only would skip this collective there: a deadlock)
        self._same_everywhere: dict[tuple, tuple[weakref.ref, bool]] = {}
        self._pending_flags: list[str] = []
        self._rank = dist.get_rank(self.group)
        self._format_depth = 0
        self._noise_patch = contextlib.ExitStack()
        self._original_types = dict(original_types or {})  # before fully_shard swapped the classes
        self._grads = GradTaker(self)  # FSDP2's sharded gradients read as they arrive, then freed (grads.py)
        if untracked is not None:
            untracked.session = self

    # -- context: noise.py's error ratios over every rank --------------------------------------------------
    def __enter__(self) -> DistributedCaptureSession:
        # before the session's own hooks: they must see the global loss the model returns
        self._globalizer = self.model.register_forward_hook(
            lambda m, args, out: _globalize_scalars(out, self._weight, self._lockstep))
        self._noise_patch.callback(self._globalizer.remove)
        patched = type("ReducedErrorStats", (_ReducedErrorStats,), {"lockstep": self._lockstep})
        saved = _noise.ErrorStats
        setattr(_noise, "ErrorStats", patched)  # noqa: B010 - a module attribute swapped for the audit
        self._noise_patch.callback(setattr, _noise, "ErrorStats", saved)
        try:
            super().__enter__()
        except BaseException:
            self._noise_patch.close()
            raise
        self._noise_patch.callback(self._grads.remove)
        try:
            self._grads.install(self.model)
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

    # -- the model's own code: an exception must be every rank's, or the audit ends (failure.py) ------------
    @contextlib.contextmanager
    def _user_code(self, part: str) -> Iterator[None]:
        try:
            yield
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit too: sys.exit() in the model on one rank
            self._raised(e, part)
            raise

    def _raised(self, e: BaseException, part: str) -> None:
        """The model raised ``e`` on this rank: returns when every rank raised the same there (the audit goes on
        as one process's would, with the same finding); else the audit ends naming this rank."""
        if self._model_raised is None or getattr(e, _AGREED, False):
            return
        with contextlib.suppress(AttributeError, TypeError):
            setattr(e, _AGREED, True)  # noqa: B010 - once per exception, however many wrappers it crosses
        self._raised_count += 1
        where = self._names.get(self._stack[-1], "?") if self._stack else None
        self._model_raised(e, f"{part} of the {self._stage}", where)

    def _where(self) -> str:
        return f"'{self._names.get(self._stack[-1], '?') or '(root)'}'" if self._stack else "the model"

    def _pre_hook(self, m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._phase not in (None, "profile") and not self._rerunning:
            self._lockstep.called(self._names.get(id(m), "?") or "(root)")
        super()._pre_hook(m, args, kwargs)

    # -- tensors that are not split along the batch ----------------------------------------------------------
    def _replicated(self, t: torch.Tensor, label: str = "a module output") -> bool:
        """Whether ``t`` holds the same values on every rank: a tensor computed from no sample of the batch (a
        position embedding's output, a causal mask). Its statistics are rank 0's alone, and the gradient flowing
        into it is the sum of every rank's. All-zero tensors count as per-sample (a zero-initialised layer's
        output is zero for every sample). A collective: called at the same point of every rank's pass, which
        it checks (``label``: what ``t`` is, lockstep.py)."""
        key = self._tensor_key(t)
        hit = self._same_everywhere.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        x = t.detach().reshape(-1).to(torch.float64)
        finite = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
        idx = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device)
        sig = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
                           finite.sum(), (finite * finite).sum(), (finite * idx).sum(),
                           (~torch.isfinite(x)).sum().to(torch.float64)]).cpu()
        hi, lo = self._lockstep.check(label, sig.tolist())
        same = hi == lo and hi[2] > 0
        self._same_everywhere[key] = (weakref.ref(t), same)
        return same

    def _reset(self) -> None:
        super()._reset()
        self._same_everywhere.clear()
        self._grads.reset()

    # -- parameter gradients taken as they arrived (grads.py), merged as the ones still held ----------------
    def _param_grad_histograms(self) -> None:
        super()._param_grad_histograms()  # the gradients still held (not taken: they are None here otherwise)
        taken = self._grads.histograms
        seen: set[int] = set()
        for mid, rec in self.layers.items():  # attributed as ReferencePass does: the first owner, ties apart
            for p in self._modules[mid].parameters(recurse=False):
                got = taken.get(id(p))
                if got is None:
                    continue
                if id(p) in seen:
                    rec.grad_param_tied.merge(got[0])
                    continue
                seen.add(id(p))
                rec.grad_param.merge(got[0])
                self.grad_all.merge(got[0])
                if got[1] is not None:
                    self._ref_grad_nonfinite[id(p)] = got[1]
        taken.clear()

    def _count_grad_nonfinite(self, fmt: Format, run: Any) -> None:
        super()._count_grad_nonfinite(fmt, run)  # the gradients still held
        taken = self._grads.nonfinite
        for mid, rec in self.layers.items():  # attributed as FormatPasses does: the first owner
            for p in self._modules[mid].parameters(recurse=False):
                got = taken.pop(id(p), None)
                if got is not None:
                    rec.formats[fmt].grad_param_nonfinite += got[0]
                    run.param_grads_nonfinite += got[0]
                    run.param_grads_nonfinite_shared += got[1]
        for added, shared in taken.values():  # parameters no module that ran owns
            run.param_grads_nonfinite += added
            run.param_grads_nonfinite_shared += shared
        taken.clear()

    def _cached(self, kind: str, tensors: tuple, make: Callable[[], Any],
                operands: Callable[[], tuple] | None = None) -> Any:
        # _replicated first, on every rank: it is a collective
        if self._phase is not None and self._replicated(tensors[-1], f"a {kind} statistic of {self._where()}") \
                and self._rank != 0:
            return make()  # counted by rank 0 only: this rank adds nothing
        return super()._cached(kind, tensors, make, operands)

    def _post_hook_body(self, m, args, kwargs, output) -> None:  # noqa: ANN001 - the runner's signature
        from ..capture.records import float_tensors

        # per output that will get a gradient hook: "global" (the model's loss made global: dL/dL is the same on
        # every rank, rank 0 counts it), "sum" (a tensor every rank shares: gradients summed), "local"
        name = self._names.get(id(m), "?") or "(root)"
        self._pending_flags = ["global" if getattr(y, _GLOBAL_MARK, False) else
                               "sum" if self._replicated(y, f"output {i} of '{name}'") else "local"
                               for i, y in enumerate(float_tensors(output)) if y.requires_grad]
        super()._post_hook_body(m, args, kwargs, output)

    def _local_rerun(self, m, rec, args, kwargs, ys, pre_rng):  # noqa: ANN001 - the runner's signature
        if ys and all(self._replicated(y, f"output {i} of '{rec.name}' re-run") for i, y in enumerate(ys)) \
                and self._rank != 0:
            saved = {f: copy.deepcopy(fs.local) for f, fs in rec.formats.items()}
            diffs = super()._local_rerun(m, rec, args, kwargs, ys, pre_rng)
            for f, fs in rec.formats.items():
                if fs.local is not None and f in saved:
                    fs.local = saved[f] if saved[f] is not None else ErrorStats()
            return diffs
        return super()._local_rerun(m, rec, args, kwargs, ys, pre_rng)

    # -- per-call loss impacts, reduced before their absolute value ------------------------------------------
    def _grad_hook(self, rec, diffs=None, own=None):  # noqa: ANN001 - the runner's signature
        inner = super()._grad_hook(rec, None, own)
        kind = self._pending_flags.pop(0) if self._pending_flags else "local"

        def hook(g: torch.Tensor) -> None:
            if g is None:
                return
            if kind == "sum":  # the gradient into a tensor every rank shares: the sum of every rank's
                self._lockstep.check(f"the gradient into an output of '{rec.name}' ({list(g.shape)})")
                total = g.detach().clone()  # on its device: the process group's backend for it serves it
                dist.all_reduce(total, group=self.group)
                inner(total if self._rank == 0 else total.new_empty((0,)))
            elif kind == "global":  # dL/dL of the model's own (global) loss: rank 0's alone, kept apart there
                if self._rank == 0:
                    inner(g)
            else:
                inner(g)
            for f, d in (diffs or {}).items():
                # d may be in the references' file (capture/reference_store.py); the same fused product as
                # one process's (capture/reference_pass.py, _reference_grad)
                self._impact_log.append((rec, f, dot64(g.detach(), self._refs.for_stats(d, g))))
        return hook

    # -- the passes, each followed by its reduction --------------------------------------------------------
    def reference_run(self):
        self._impact_log.clear()
        self._grads.phase = "ref"
        self._stage = "FP32 pass at the second reduction order" if self._impacts_only else "FP32 reference pass"
        try:
            run = super().reference_run()
        except KeyboardInterrupt:
            self._impact_log.clear()
            raise
        except BaseException as e:  # its FP32 backward (the forward and the loss are agreed on where they raise)
            self._impact_log.clear()
            self._raised(e, "backward")
            raise
        finally:
            self._grads.phase = None
        layers = list(self.layers.values())
        red = R.Reduction(self._lockstep, f"the statistics of the {self._stage}")
        R.reference_fields(red, layers)
        red.run()
        R.reduce_impacts(self._impact_log, self._lockstep)
        self._impact_log.clear()
        self.grad_all = R.rebuild_grad_all(layers)
        return run

    def format_run(self, fmt: Format, loss_scale: float = 1.0):
        self._format_depth += 1
        outer, self._grads.phase = self._grads.phase, fmt
        self._stage = f"{fmt.value} pass"
        raised_before = self._raised_count
        try:
            run = super().format_run(fmt, loss_scale)
        finally:
            self._format_depth -= 1
            self._grads.phase = outer
        if run.error is not None and self._raised_count == raised_before and self._model_raised is not None:
            # the pass failed in its backward (recorded as the format's finding): every rank's, or the end
            self._model_raised(RuntimeError(run.error), f"backward of the {self._stage}", None)
        if self._format_depth:  # the runner's own retry (fp32-fallback kernels): reduced once, by the outer call
            return run
        layers = list(self.layers.values())
        red = R.Reduction(self._lockstep, f"the statistics of the {self._stage} (loss scale {loss_scale:g})")
        R.format_fields(red, layers, fmt, run)
        red.run()
        if run.output is not None:
            run.output_nonfinite = run.output.nonfinite
        root = self.layers.get(id(self.model))
        if root is not None and fmt in root.formats and root.formats[fmt].local is not None:
            root.formats[fmt].local = copy.deepcopy(root.formats[fmt].accumulated)
        return run

    def verify_plan(self, policy: Any, default: Format | None):
        self._stage = "plan verification"
        run = super().verify_plan(policy, default)
        _, lowest = self._lockstep.check("the plan verification's output", [run.output is not None])
        if run.output is not None and lowest[0]:
            run.output = R.reduced_error_copy(run.output, self._lockstep)
            run.output_nonfinite = run.output.nonfinite
        elif run.output is not None:
            run.output = None
        return run

    def timed_steps(self, steps: int, traces: bool = True) -> dict[str, list[float]]:
        self._stage = "timed steps"
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
        self.session: CaptureSession | None = None
        self._saved: list[bool] = []
        self.handles: list[Any] = []

    def _pause(self, *args: Any, **kwargs: Any) -> None:
        s = self.session
        self._saved.append(bool(s._rerunning) if s is not None else False)
        if s is not None:
            s._rerunning = True

    def _resume(self, *args: Any, **kwargs: Any) -> None:
        was = self._saved.pop() if self._saved else False
        if self.session is not None:
            self.session._rerunning = was

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
