"""The model's own autocast(enabled=False) regions (capture/user_autocast.py).

A module called inside such a region runs in FP32 on a GPU: its format-pass output is float32 and its local
error (a re-run alone on its FP32 inputs, as the model runs it) is FP32's own, zero. The reference for the three
ways of writing the region is PyTorch's own handling of the one on the tensors' device type."""

from __future__ import annotations

import warnings

import pytest
import torch

from precision_audit.capture.session import CaptureConfig, CaptureSession
from precision_audit.formats import Format

FORMATS = (Format.FP16, Format.BF16)


class _Island(torch.nn.Module):
    """``b`` in FP32 inside an autocast-off region, written three ways; or (``on-device``, ``on-cuda``) pinned to
    bf16 by an autocast-on region, written two ways."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)
        self.how = how

    def forward(self, x):
        h = self.a(x)
        if self.how.startswith("on-"):
            with torch.autocast(x.device.type if self.how == "on-device" else "cuda", dtype=torch.bfloat16):
                h = torch.tanh(self.b(h))
            return self.head(h.float())
        if self.how == "device":
            region = torch.autocast(x.device.type, enabled=False)
        elif self.how == "cuda":
            region = torch.autocast("cuda", enabled=False)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                region = torch.cuda.amp.autocast(enabled=False)
        with region:
            h = torch.tanh(self.b(h.float()))
        return self.head(h)


def _figures(how: str, model_class: type = _Island) -> dict:
    """Every module's figures per format (local error, accumulated error, output dtypes, loss impact)."""
    torch.manual_seed(0)
    model, x = model_class(how), torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(), CaptureConfig(FORMATS)) as s:
        s.reference_run()
        for f in FORMATS:
            s.format_run(f)
        res = s.result()
    return {r.name: {f.value: (fs.local.rel_l2 if fs.local else fs.local_note, fs.accumulated.rel_l2,
                               sorted(fs.output_dtypes), fs.loss_impact)
                     for f, fs in r.formats.items()} for r in res.layers}


@pytest.mark.parametrize("how", ["device", "cuda", "amp"])
def test_a_module_inside_an_autocast_off_region_is_measured_in_fp32(how):
    got = _figures(how)
    for f in ("fp16", "bf16"):
        local, _, dtypes, impact = got["b"][f]
        assert local == 0.0 and impact == 0.0  # re-run with autocast off, as the model runs it
        assert dtypes == ["float32"]  # the format pass: FP32 inside the region
        assert got["a"][f][2] == [{"fp16": "float16", "bf16": "bfloat16"}[f]]  # and low precision outside it
    assert got == _figures("device")  # "cuda" hard-coded or torch.cuda.amp: as PyTorch runs the device's own


@pytest.mark.parametrize("how", ["on-device", "on-cuda"])
def test_a_module_inside_an_autocast_on_region_computes_in_its_dtype_in_every_pass(how):
    got = _figures(how)
    for f in ("fp16", "bf16"):
        local, acc, dtypes, impact = got["b"][f]
        # the model computes b in bf16 in every pass, the FP32 reference included (as a GPU does): re-run in
        # bf16 too, whatever the format, its local error and impact are zero
        assert local == 0.0 and impact == 0.0, got["b"]
        assert dtypes == ["bfloat16"]
        assert got["a"][f][2] == [{"fp16": "float16", "bf16": "bfloat16"}[f]]  # outside it, the format's
    assert got["b"]["fp16"][1] > 0  # its accumulated error: a's fp16 error carried through
    assert got == _figures("on-device")  # "cuda" hard-coded: as PyTorch runs the device's own region


def test_the_fp32_reference_runs_an_on_region_in_its_dtype():
    torch.manual_seed(0)
    model, x = _Island("on-cuda"), torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    seen: list[torch.dtype] = []
    model.b.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(), CaptureConfig(FORMATS)) as s:
        s.reference_run()
    assert seen and set(seen) == {torch.bfloat16}, seen  # the call and its re-runs
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "CUDA is not available ... Disabling autocast"
        plain = model(x)  # outside the session, on a CPU-only build: CUDA autocast off, the region does nothing
    assert plain.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


def test_torch_autocast_is_put_back_after_the_session():
    from torch.amp.autocast_mode import autocast

    before = (autocast.__init__, autocast.__enter__, autocast.__exit__)
    model = _Island("cuda")
    with pytest.raises(RuntimeError, match="boom"):
        with CaptureSession(model, lambda m: m(torch.randn(2, 16)), lambda y: y.sum(), CaptureConfig(FORMATS)):
            assert autocast.__enter__ is not before[1]
            raise RuntimeError("boom")
    assert (autocast.__init__, autocast.__enter__, autocast.__exit__) == before


# -- the model's questions about CUDA autocast (capture/user_autocast.py, CudaQueries) ----------------------------

class _CastNorm(torch.nn.LayerNorm):
    """Nemotron's LayerNorm: casts its arguments to the autocast dtype when autocast is on, then normalises with
    autocast off (so in that dtype). ``how`` is how it asks."""

    def __init__(self, n: int, how: str) -> None:
        super().__init__(n)
        self.how = how

    def forward(self, x):
        dev = x.device.type
        if self.how == "device":  # PyTorch's own answer for the device the tensors are on: the reference
            on, dtype = torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)
        elif self.how == "bare":  # no argument: CUDA's state
            on = torch.is_autocast_enabled()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dtype = torch.get_autocast_gpu_dtype()
        else:
            on, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        args = (x, self.weight + 1.0, self.bias)
        if on:
            args = torch.amp.autocast_mode._cast(args, dev, dtype)
        with torch.autocast(dev, enabled=False):
            return torch.nn.functional.layer_norm(args[0], self.normalized_shape, args[1], args[2], self.eps)


def _fp32_matmul(device_type: str):
    class MatmulFp32(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type, cast_inputs=torch.float32)
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.T, x.T @ g

    return MatmulFp32


class _Custom(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn, self.w = fn, torch.nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x):
        return self.fn.apply(x, self.w)


class _Asks(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
        self.norm = _CastNorm(32, "device" if how == "custom_cpu" else how if how != "custom_cuda" else "cuda")
        self.custom = _Custom(_fp32_matmul("cpu" if how in ("device", "custom_cpu") else "cuda"))

    def forward(self, x):
        return self.head(self.custom(self.norm(self.a(x))))


@pytest.mark.parametrize("how", ["bare", "cuda"])
def test_cuda_autocast_queries_get_a_gpus_answers_in_emulated_passes(how):
    """``torch.is_autocast_enabled()`` / ``("cuda")``, ``get_autocast_gpu_dtype`` / ``get_autocast_dtype("cuda")``
    and ``custom_fwd(device_type="cuda", cast_inputs=torch.float32)``: the same figures as the code asking about
    the tensors' own device, which PyTorch answers itself. Before, CUDA autocast read as off in every pass: the
    norm normalised in FP32 (local error 0) and the custom matmul ran in low precision."""
    got, ref = _figures(how, _Asks), _figures("device", _Asks)
    assert got == ref
    for f, low in (("fp16", "float16"), ("bf16", "bfloat16")):
        assert got["norm"][f][2] == [low] and got["norm"][f][0] > 0  # cast and normalised in the format
        assert got["custom"][f][2] == ["float32"] and got["custom"][f][0] == 0.0  # cast_inputs: FP32, autocast off


def test_cuda_autocast_queries_are_put_back_with_cudas_state():
    real = (torch.is_autocast_enabled, torch.get_autocast_dtype, torch.get_autocast_gpu_dtype,
            torch.amp.autocast_mode._cast)
    state = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))

    class SetsBack(torch.nn.Module):  # saves CUDA's answer and sets it back, as older AMP code does
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            prev, dtype = torch.is_autocast_enabled(), torch.get_autocast_dtype("cuda")
            torch.set_autocast_enabled("cuda", prev)
            torch.set_autocast_dtype("cuda", dtype)
            return self.fc(x)

    with CaptureSession(SetsBack(), lambda m: m(torch.randn(2, 4)), lambda y: y.sum(), CaptureConfig(FORMATS)) as s:
        s.reference_run()
        s.format_run(Format.BF16)
        assert torch.is_autocast_enabled is not real[0]
    assert (torch.is_autocast_enabled, torch.get_autocast_dtype, torch.get_autocast_gpu_dtype,
            torch.amp.autocast_mode._cast) == real
    assert (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) == state


# PyTorch's recipe for a custom function under autocast (torch.amp docs, "Autocast and Custom Autograd Functions"):
# custom_fwd runs the forward under the caller's autocast state, custom_bwd runs the backward under the same state
class _RecipeMM(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), a.t().mm(grad)


class _MM(torch.nn.Module):
    def __init__(self, recipe: bool) -> None:
        super().__init__()
        self.recipe, self.w = recipe, torch.nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x):
        return _RecipeMM.apply(x, self.w) if self.recipe else x.mm(self.w)


class _Recipe(torch.nn.Module):
    def __init__(self, recipe: bool) -> None:
        super().__init__()
        self.a, self.mm, self.head = torch.nn.Linear(16, 32), _MM(recipe), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.mm(self.a(x))))


def _recipe_figures(recipe: bool) -> dict:
    torch.manual_seed(0)
    model, x = _Recipe(recipe), torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "CUDA is not available ... Disabling autocast" either
        with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(), CaptureConfig(FORMATS)) as s:
            s.reference_run()
            runs = {f.value: s.format_run(f) for f in FORMATS}
            res = s.result()
    assert not any(r.error for r in runs.values()), {f: r.error for f, r in runs.items()}
    return {"loss": {f: r.loss for f, r in runs.items()},
            **{r.name: {f.value: (fs.local.rel_l2 if fs.local else fs.local_note, fs.accumulated.rel_l2,
                                  sorted(fs.output_dtypes), fs.grad_output, fs.loss_impact)
                        for f, fs in r.formats.items()} for r in res.layers}}


def test_a_custom_function_on_pytorchs_autocast_recipe_runs_as_autograds_own_mm():
    """custom_bwd's backward runs under the autocast its forward ran under: emulated, the backward's GEMMs are
    the format's, as autograd's own backward of the same mm (the reference: no custom function). Before, the
    backward ran with autocast off and raised on the fp16 gradient times the float32 weight."""
    got, ref = _recipe_figures(True), _recipe_figures(False)
    assert got == ref
    assert got["a"]["bf16"][3].amax > 0  # dL/dy of the layer before it came through the custom backward
