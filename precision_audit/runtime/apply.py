"""Applying a policy to a model in training: per-module formats, the forward-pass autocast, the GradScaler.

How a module is put in its format: its ``forward`` is replaced, as an instance attribute, by a
``functools.partial`` of :func:`_policy_forward` that enters the right autocast state around the original
forward and removes itself on :meth:`PolicyHandle.remove`. A wrapped forward (rather than a pre-hook that
enters a context and a post-hook that leaves it) keeps the context balanced when the forward raises, is
traced by ``torch.compile`` (a replaced ``forward`` is guarded, so even already-compiled code recompiles), and
survives ``copy.deepcopy`` (the copy's wrapper points at the copy).

- ``fp32``: autocast disabled; floating inputs in fp16/bf16 are cast to fp32 (nested in tuples, lists and
  dicts); on CUDA, TF32 is switched off inside (strict IEEE fp32).
- ``tf32``: as ``fp32``, but with TF32 switched on inside (``torch.backends.cuda.matmul.allow_tf32`` and
  ``torch.backends.cudnn.allow_tf32``, or their ``fp32_precision`` equivalents when the program uses the newer
  API), the user's exact settings restored after (precision_audit/tf32_switches.py). On CUDA the module's
  backward runs under the same switches, and the whole model's under those its forward began in
  (runtime/backward_tf32.py).
- ``bf16`` / ``fp16``: autocast in that dtype (e.g. an fp16 module inside a bf16 default). The autocast weight
  cache is only used when the dtype is the policy's default one: a weight shared by modules in two
  low-precision formats would otherwise be served from the cache in the wrong dtype.

A module without an override runs in whatever its parent runs in: the default format under
:func:`precision_audit.autocast`, or an overridden parent's.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PolicyError
from ..formats import LOW_PRECISION_DTYPES
from ..policy import RUNTIME_FORMATS, Policy, named_modules, unwrap_model
from ..tf32_switches import Tf32State, set_tf32, tf32_enabled
from ..tf32_switches import restore as tf32_restore
from ..tf32_switches import snapshot as tf32_snapshot
from .backward_tf32 import CONTROLLED, forward_state, run_marked

log = logging.getLogger(__name__)

# A policy names its formats as strings (policy/schema.py); the low-precision ones' dtypes, by name.
_DTYPE_OF_NAME: dict[str, torch.dtype] = {f.value: d for f, d in LOW_PRECISION_DTYPES.items()}

_UPCAST = (torch.float16, torch.bfloat16)

# The handle applied to each (unwrapped) model, so that a second apply is refused and the adaptive
# controller can find and update it.
_ACTIVE: weakref.WeakKeyDictionary[torch.nn.Module, PolicyHandle] = weakref.WeakKeyDictionary()


def active_handle(model: torch.nn.Module) -> PolicyHandle | None:
    """The handle of the policy currently applied to ``model`` (wrappers looked through), or None."""
    return _ACTIVE.get(unwrap_model(model))


# -- the wrapped forward -------------------------------------------------------------------------------------

@dataclass
class _ModuleState:
    name: str
    format: str
    dtype: torch.dtype | None  # None for fp32 / tf32
    cache: bool  # autocast weight cache allowed (dtype == the policy's default dtype)
    device_type: str | None  # None: from the inputs at each call
    orig: Callable[..., Any] | None  # the instance-level forward replaced, or None for the class's forward
    active: bool = True


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.float() if x.dtype in _UPCAST else x
    if isinstance(x, tuple):
        items = [_to_fp32(v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if isinstance(x, list):
        return [_to_fp32(v) for v in x]
    if isinstance(x, dict):
        return {k: _to_fp32(v) for k, v in x.items()}
    return x


def _infer_device_type(args: tuple, kwargs: dict, module: torch.nn.Module) -> str:
    for v in args:
        if isinstance(v, torch.Tensor):
            return v.device.type
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            return v.device.type
    for p in module.parameters():
        return p.device.type
    for b in module.buffers():
        return b.device.type
    return "cpu"


class _TF32:
    """Set both TF32 switches inside, restore the user's exact settings after (only touching them when they
    differ), through the API the program uses (precision_audit/tf32_switches.py). ``with`` gives whether it
    changed them."""

    def __init__(self, on: bool, cudnn: bool | None = None) -> None:
        self.want = (on, on if cudnn is None else cudnn)
        self.saved: Tf32State | None = None

    def __enter__(self) -> bool:
        if tf32_enabled() != self.want:
            self.saved = tf32_snapshot()
            set_tf32(*self.want, legacy=self.saved.legacy is not None)
            return True
        return False

    def __exit__(self, *exc: Any) -> None:
        if self.saved is not None:
            tf32_restore(self.saved)
            self.saved = None


def _call(module: torch.nn.Module, state: _ModuleState, args: tuple, kwargs: dict) -> Any:
    if state.orig is not None:
        return state.orig(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def _policy_forward(module: torch.nn.Module, state: _ModuleState, *args: Any, **kwargs: Any) -> Any:
    if not state.active:
        return _call(module, state, args, kwargs)
    device_type = state.device_type or _infer_device_type(args, kwargs, module)
    if state.dtype is None:  # fp32 / tf32
        args, kwargs = _to_fp32(args), _to_fp32(kwargs)
        with torch.autocast(device_type, enabled=False):
            if device_type == "cuda":
                on = state.format == "tf32"
                with _TF32(on) as changed:
                    if changed:  # its backward too (runtime/backward_tf32.py)
                        return run_marked(on, state.name, module, args, kwargs,
                                          lambda: _call(module, state, args, kwargs))
                    return _call(module, state, args, kwargs)
            return _call(module, state, args, kwargs)
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == state.dtype:
        return _call(module, state, args, kwargs)  # already in this format
    with torch.autocast(device_type, dtype=state.dtype, cache_enabled=state.cache):
        return _call(module, state, args, kwargs)


def _root_forward(module: torch.nn.Module, state: _ModuleState, *args: Any, **kwargs: Any) -> Any:
    """The whole model's forward on CUDA, its backward marked to run under the TF32 switches this forward began in
    (those of :func:`precision_audit.autocast`, or the caller's), as overridden modules' backwards run under theirs
    (runtime/backward_tf32.py)."""
    if not state.active or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return _call(module, state, args, kwargs)
    if (state.device_type or _infer_device_type(args, kwargs, module)) != "cuda":
        return _call(module, state, args, kwargs)
    controlled = CONTROLLED.get(module)
    if controlled is not None and tf32_enabled() == controlled:  # controller.step's backward runs under these
        return _call(module, state, args, kwargs)
    return run_marked(forward_state(), "", module, args, kwargs, lambda: _call(module, state, args, kwargs))


# -- the handle ----------------------------------------------------------------------------------------------

class PolicyHandle:
    """What :func:`apply_policy` returns: ``.remove()`` puts every wrapped forward back exactly as it was.

    Also a context manager (``with apply_policy(model, policy): ...`` removes on exit). ``modules`` maps each
    wrapped module's name to its format.
    """

    def __init__(self, policy: Policy, root: torch.nn.Module, device_type: str | None) -> None:
        self._policy = policy
        self._root_ref = weakref.ref(root)
        self._device_type = device_type
        # (module, state, had an instance-level forward, that forward, the partial we installed)
        self._wrapped: list[tuple[torch.nn.Module, _ModuleState, bool, Any, Any]] = []
        self.modules: dict[str, str] = {}
        self.active = False

    @property
    def policy(self) -> Policy:
        """The policy in effect (the adaptive controller may have replaced it with an updated copy)."""
        return self._policy

    def _install(self, root: torch.nn.Module) -> None:
        p = self._policy
        default_dtype = _DTYPE_OF_NAME.get(p.default_format)
        try:
            for name, module in named_modules(root):
                o = p.modules.get(name)
                if o is None:
                    continue
                dtype = _DTYPE_OF_NAME.get(o.format)
                had = "forward" in module.__dict__
                prev = module.__dict__.get("forward")
                state = _ModuleState(name=name, format=o.format, dtype=dtype, cache=dtype == default_dtype,
                                     device_type=self._device_type, orig=prev if had else None)
                wrapper = functools.partial(_policy_forward, module, state)
                module.forward = wrapper
                self._wrapped.append((module, state, had, prev, wrapper))
                self.modules[name] = o.format
            if self._device_type in (None, "cuda"):  # the default region's backward (runtime/backward_tf32.py)
                had = "forward" in root.__dict__
                prev = root.__dict__.get("forward")
                state = _ModuleState(name="", format=p.default_format, dtype=None, cache=False,
                                     device_type=self._device_type, orig=prev if had else None)
                wrapper = functools.partial(_root_forward, root, state)
                root.forward = wrapper
                self._wrapped.append((root, state, had, prev, wrapper))
        except BaseException:
            self._uninstall()
            raise
        self.active = True

    def _uninstall(self) -> None:
        for module, state, had, prev, wrapper in reversed(self._wrapped):
            state.active = False
            if module.__dict__.get("forward") is wrapper:
                if had:
                    module.__dict__["forward"] = prev
                else:
                    del module.__dict__["forward"]
            else:
                # Something replaced forward after us and holds our wrapper: leave it as a pass-through.
                log.warning("the forward of %r was replaced after the policy was applied; the policy's wrapper "
                            "stays inside it as a pass-through", state.name or "(root)")
        self._wrapped.clear()
        self.modules = {}
        self.active = False

    def remove(self) -> None:
        """Restore every wrapped module's forward. Safe to call twice."""
        if not self.active:
            return
        self._uninstall()
        root = self._root_ref()
        if root is not None and _ACTIVE.get(root) is self:
            del _ACTIVE[root]

    def _reapply(self, policy: Policy) -> None:
        """Swap in an updated policy for the same model (used by the adaptive controller)."""
        root = self._root_ref()
        if root is None:
            raise RuntimeError("the model this policy was applied to no longer exists")
        _check_runtime_formats(policy)
        from .fsdp import unit_conflicts

        runtime = policy
        if unit_conflicts(root, policy):
            # FSDP2 gathers each unit's parameters in the dtype fixed when it was sharded: a change that needs
            # another one waits for the next sharding (docs/distributed.md, "The runtime across ranks")
            runtime, held = self._policy, []
            for name, o in policy.modules.items():
                if self._policy.modules.get(name) == o:
                    continue
                trial = runtime.with_override(name, o.format, o.reason)
                if unit_conflicts(root, trial):
                    held.append(f"{name or '(root)'} -> {o.format}")
                else:
                    runtime = trial
            log.warning("under FSDP2 these changes cannot take effect now, since their FSDP unit gathers the "
                        "parameters in the dtype set when the model was sharded: %s; the updated policy holds "
                        "them, and takes full effect once the model is sharded again with "
                        "precision_audit.shard_fsdp2(model, policy)", ", ".join(held))
        self._uninstall()
        self._policy = runtime
        self._install(root)

    def __enter__(self) -> PolicyHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<PolicyHandle {state}: {len(self.modules)} module(s) overridden>"


def _check_runtime_formats(policy: Policy) -> None:
    bad = {n: o.format for n, o in policy.modules.items() if o.format not in RUNTIME_FORMATS}
    if bad:
        listing = ", ".join(f"{n or '(root)'}: {f}" for n, f in list(bad.items())[:12])
        raise PolicyError(f"the runtime cannot put these modules in their format (autocast has no fp8): {listing}",
                          choices=RUNTIME_FORMATS, hint="use torchao.float8 for fp8 modules, or change the policy")


def apply_policy(model: torch.nn.Module, policy: Policy, *, device_type: str | None = None,
                 strict: bool = True) -> PolicyHandle:
    """Put every module the policy overrides in its format; returns a :class:`PolicyHandle`.

    ``model`` may be wrapped by torch.compile, DDP or DataParallel: the policy's names are those of the model
    inside. A model sharded with FSDP2's ``fully_shard`` is refused when a unit would gather a module's parameters
    in another low-precision dtype than the policy's format for it (shard it with
    :func:`precision_audit.shard_fsdp2`; docs/distributed.md, "The runtime across ranks").
    ``device_type`` ("cuda", "cpu", ...) fixes the autocast device; by default each call uses the device of its
    first tensor input. ``strict=False`` turns a fingerprint mismatch into a logged warning
    (override names must still exist).

    Example::

        import precision_audit as pa
        handle = pa.apply_policy(model, policy)
        with pa.autocast(policy, "cuda"):
            loss = loss_fn(model(x), y)
        handle.remove()
    """
    if isinstance(model, Policy) or not isinstance(policy, Policy):
        # A programming mistake, not bad input: a TypeError, as Python gives for any wrong argument.
        raise TypeError("apply_policy takes the model first, then the policy: apply_policy(model, policy); "
                        f"got apply_policy({type(model).__name__}, {type(policy).__name__})")
    root = unwrap_model(model)
    if strict:
        policy.check_model(model)
    else:
        try:
            policy._check_fingerprint(model)
        except PolicyError as e:
            log.warning("applying the policy anyway (strict=False): %s", e.problem)
        policy.check_override_names(model)
    _check_runtime_formats(policy)
    from .fsdp import check_units, is_fsdp2

    if is_fsdp2(root):
        check_units(root, policy)
    if root in _ACTIVE:
        raise PolicyError("a policy is already applied to this model",
                          hint="call .remove() on the handle apply_policy returned before applying another")
    handle = PolicyHandle(policy, root, device_type)
    handle._install(root)
    _ACTIVE[root] = handle
    log.info("policy applied: %d module(s) overridden (%s)", len(handle.modules),
             ", ".join(f"{n or '(root)'}={f}" for n, f in list(handle.modules.items())[:8]))
    return handle


# -- the forward-pass context and the scaler -----------------------------------------------------------------

class PolicyAutocast:
    """``precision_audit.autocast(policy, device_type)``: autocast in the default format, TF32 switches set inside.

    - default ``bf16`` / ``fp16``: ``torch.autocast(device_type, dtype=...)``;
    - default ``fp32``: autocast disabled; default ``tf32``: autocast disabled and TF32 on;
    - the policy's ``tf32`` switches (``torch.backends.cuda.matmul.allow_tf32``,
      ``torch.backends.cudnn.allow_tf32``, or the newer ``fp32_precision`` API when the program uses it) are
      set on entry and the user's exact settings restored on exit, even on error.

    ``enabled=False`` is a no-op context (plain fp32 run). Re-entrant: each ``with`` saves and restores.

    Example::

        with precision_audit.autocast(policy, "cuda"):
            loss = loss_fn(model(x), y)
    """

    def __init__(self, policy: Policy, device_type: str = "cuda", *, enabled: bool = True) -> None:
        if policy.default_format not in RUNTIME_FORMATS:
            raise PolicyError(f"the runtime cannot run the default format {policy.default_format!r} "
                              "(autocast has no fp8)", choices=RUNTIME_FORMATS)
        if not isinstance(device_type, str):
            raise PolicyError("autocast(policy, device_type) takes a device type such as 'cuda' or 'cpu'",
                              found=repr(device_type))
        self.device_type = device_type
        self.dtype = _DTYPE_OF_NAME.get(policy.default_format)
        self.enabled = enabled
        self.tf32 = policy_tf32(policy)
        self._stack: list[tuple[Tf32State | None, torch.autocast]] = []

    def __enter__(self) -> PolicyAutocast:
        saved = None
        if self.enabled:
            saved = tf32_snapshot()
            set_tf32(*self.tf32, legacy=saved.legacy is not None)
        ctx = torch.autocast(self.device_type, dtype=self.dtype,
                             enabled=self.enabled and self.dtype is not None)
        try:
            ctx.__enter__()
        except BaseException:
            if saved is not None:
                tf32_restore(saved)
            raise
        self._stack.append((saved, ctx))
        return self

    def __exit__(self, *exc: Any) -> None:
        saved, ctx = self._stack.pop()
        try:
            ctx.__exit__(*exc)
        finally:
            if saved is not None:
                tf32_restore(saved)


def policy_tf32(policy: Policy) -> tuple[bool, bool]:
    """The TF32 switches :func:`precision_audit.autocast` sets for the forward: both on for a ``tf32`` default,
    else the policy's ``tf32`` section."""
    return (True, True) if policy.default_format == "tf32" else (policy.tf32_matmul, policy.tf32_cudnn)


def backward_tf32(policy: Policy) -> _TF32:
    """The context ``controller.step`` runs the backward in: :func:`policy_tf32`'s switches."""
    return _TF32(*policy_tf32(policy))


def make_grad_scaler(policy: Policy, device: str = "cuda") -> torch.amp.GradScaler:
    """``torch.amp.GradScaler(device, ...)`` from ``policy.loss_scaling`` (disabled unless ``enabled``)."""
    ls = policy.loss_scaling
    return torch.amp.GradScaler(device, init_scale=ls.init_scale, growth_factor=ls.growth_factor,
                                backoff_factor=ls.backoff_factor, growth_interval=ls.growth_interval,
                                enabled=ls.enabled)
