"""Step-by-step models of the CUDA kernels that do not round once (docs/emulation.md).

Under CUDA autocast most lower-precision ops are one Tensor Core GEMM: fp16/bf16 inputs, fp32 accumulation,
one rounding of the result, which emulation.py computes in fp32 and rounds once. The ops here round
differently on a GPU, so they are computed as their CUDA kernels compute them: every rounding of the kernel is
a ``.to(dtype)`` here, every fp32 ("opmath"/"accscalar") step is an fp32 torch op, in the kernel's order.

- ``addr``: an elementwise kernel in the tensor's own type (``beta * self + alpha * vec1 * vec2`` on
  ``c10::Half``/``c10::BFloat16``, whose operators round after every operation). Its backward is two
  ``mv`` (cuBLAS, fp32 accumulation, rounded) and ``maybe_multiply`` by alpha.
- ``addbmm``: one ``addmm_`` per batch into the low-precision output (rounded after every batch).
  Backward: one ``bmm`` per input, then ``maybe_multiply`` by alpha.
- ``conv_tbc``: the output starts as the bias and each kernel tap adds one ``addmm_`` into it (rounded each
  time); its backward accumulates dInput the same way (ConvolutionTBC.cpp).
- ``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell``: all gate math in fp32, hy/cy rounded once; the
  activated gates are saved rounded (the "workspace") and the backward kernel works from those rounded values.
  ``lstm_cell`` / ``gru_cell`` on CUDA are two rounded GEMMs (no bias) followed by the fused kernel.

Every function takes and returns tensors of one low-precision dtype (the autocast casts have been done).
Transcendental functions are evaluated in float64 and rounded to fp32 (a correctly rounded ``expf``/``tanhf``);
CUDA's ``expf``/``tanhf`` are within 2 fp32 ulps of that, and nvcc may contract ``a * b + c`` into one FMA:
both are fp32-level differences that can move a rounded result by one low-precision ulp (a documented gap).
"""

from __future__ import annotations

import torch


def _as_dtype(value: float, dtype: torch.dtype) -> float:
    """``Scalar::to<scalar_t>()``: the scalar rounded to the tensor's type."""
    return torch.tensor(float(value), dtype=dtype).item()


def maybe_multiply(t: torch.Tensor, s: float) -> torch.Tensor:
    """autograd's ``maybe_multiply``: ``t`` itself when ``s`` is 1, else ``t * s`` (one fp32 multiply, rounded)."""
    return t if float(s) == 1.0 else (t.float() * float(s)).to(t.dtype)


def gemm(fn, dtype: torch.dtype, *tensors: torch.Tensor) -> torch.Tensor:
    """A cuBLAS GEMM on low-precision operands: fp32 accumulation, one rounding."""
    return fn(*(t.float() for t in tensors)).to(dtype)


# ------------------------------------------------------------------------------------------------ addr


def addr_forward(self_: torch.Tensor, vec1: torch.Tensor, vec2: torch.Tensor, beta: float,
                 alpha: float) -> torch.Tensor:
    """``addr_kernel_cuda``: ``beta * self + (alpha * vec1) * vec2`` in scalar_t, each operation rounded;
    ``beta == 0`` ignores ``self`` (NaNs in it do not propagate)."""
    dt = vec1.dtype
    b, a = _as_dtype(beta, dt), _as_dtype(alpha, dt)
    av1 = (vec1.float() * a).to(dt)
    prod = (av1.float()[:, None] * vec2.float()[None, :]).to(dt)
    if b == 0:
        return prod
    bs = (self_.float().expand(prod.shape) * b).to(dt)
    return (bs.float() + prod.float()).to(dt)


def addr_backward(grad: torch.Tensor, vec1: torch.Tensor, vec2: torch.Tensor, beta: float,
                  alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """derivatives.yaml ``addr``: self ``maybe_multiply(grad, beta)`` (summed to self's shape by the engine),
    vec1 ``maybe_multiply(grad.mv(vec2), alpha)``, vec2 ``maybe_multiply(grad.t().mv(vec1), alpha)``."""
    dt = grad.dtype
    return (maybe_multiply(grad, beta),
            maybe_multiply(gemm(torch.mv, dt, grad, vec2), alpha),
            maybe_multiply(gemm(torch.mv, dt, grad.t(), vec1), alpha))


# ---------------------------------------------------------------------------------------------- addbmm


def addbmm_forward(self_: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, beta: float,
                   alpha: float) -> torch.Tensor:
    """``addbmm_impl_``: ``result.addmm_(batch1[i], batch2[i], beta_i, alpha)`` for each batch, beta_i = beta
    for the first and 1 after; each addmm_ is a cuBLAS GEMM (``alpha * acc + beta_i * result`` in fp32)
    rounded into the low-precision result."""
    dt = batch1.dtype
    beta, alpha = float(beta), float(alpha)
    shape = (batch1.shape[1], batch2.shape[2])
    out: torch.Tensor | None = self_.expand(shape) if beta != 0 else None
    if batch1.shape[0] == 0:
        return torch.zeros(shape, dtype=dt) if out is None else (out.float() * beta).to(dt)
    for i in range(batch1.shape[0]):
        acc = torch.mm(batch1[i].float(), batch2[i].float())
        if alpha != 1:
            acc = acc * alpha
        b = beta if i == 0 else 1.0
        if out is not None and b != 0:
            acc = acc + (out.float() if b == 1 else out.float() * b)
        out = acc.to(dt)
    assert out is not None  # the loop ran (batch1.shape[0] > 0)
    return out


def addbmm_backward(grad: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, beta: float,
                    alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """derivatives.yaml ``addbmm``: one bmm per input against the gradient expanded over the batch."""
    dt = grad.dtype
    g = grad.unsqueeze(0).expand(batch1.shape[0], batch1.shape[1], batch2.shape[2])
    return (maybe_multiply(grad, beta),
            maybe_multiply(gemm(torch.bmm, dt, g, batch2.transpose(1, 2)), alpha),
            maybe_multiply(gemm(torch.bmm, dt, batch1.transpose(1, 2), g), alpha))


# -------------------------------------------------------------------------------------------- conv_tbc


def _tbc_taps(ilen: int, olen: int, kw: int, pad: int):
    """ConvolutionTBC.cpp's loop: (kernel tap, input shift, output shift, length) of each addmm_."""
    for k in range(kw):
        i_shift, o_shift = max(0, k - pad), max(0, pad - k)
        t = min(ilen + pad - k, olen) - o_shift
        if t > 0:
            yield k, i_shift, o_shift, t


def _addmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out.addmm_(a, b)`` by cuBLAS: ``out + a @ b`` accumulated in fp32, rounded into ``out``."""
    out.copy_(torch.addmm(out.float(), a.float(), b.float()).to(out.dtype))


def conv_tbc_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, pad: int) -> torch.Tensor:
    """``conv_tbc``: the output starts as the bias; each kernel tap adds one GEMM into it, rounded each time."""
    ilen, batch, _ = x.shape
    kw, _, planes = weight.shape
    olen = ilen - kw + 1 + 2 * pad
    out = bias.expand(olen, batch, planes).clone()
    for k, i_shift, o_shift, t in _tbc_taps(ilen, olen, kw, pad):
        _addmm_into(out.narrow(0, o_shift, t).view(t * batch, planes),
                    x.narrow(0, i_shift, t).reshape(t * batch, -1), weight[k])
    return out


def conv_tbc_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, pad: int):
    """``conv_tbc_backward``: dInput and dWeight accumulated tap by tap with addmm_, dBias = sum over time
    (rounded), then over the batch (rounded)."""
    ilen, batch, planes_in = x.shape
    kw, _, planes = weight.shape
    olen = grad.shape[0]
    d_x, d_w = torch.zeros_like(x), torch.zeros_like(weight)
    for k, i_shift, o_shift, t in _tbc_taps(ilen, olen, kw, pad):
        d_o = grad.narrow(0, o_shift, t).reshape(t * batch, planes)
        _addmm_into(d_x.narrow(0, i_shift, t).view(t * batch, planes_in), d_o, weight[k].t())
        _addmm_into(d_w[k], x.narrow(0, i_shift, t).reshape(t * batch, planes_in).t(), d_o)
    d_b = grad.float().sum(0).to(grad.dtype).float().sum(0).to(grad.dtype)
    return d_x, d_w, d_b


# ------------------------------------------------------------------------------------ fused RNN cells


def _exp32(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).float()


def _tanh32(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x.double()).float()


def _sigmoid32(x: torch.Tensor) -> torch.Tensor:
    """The kernels' own ``sigmoid``: ``one / (one + ::exp(-in))`` in fp32."""
    d = 1.0 + _exp32(-x)
    return torch.ones_like(d).div_(d)


def _gate_sums(igates: torch.Tensor, hgates: torch.Tensor, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None,
               n: int) -> list[torch.Tensor]:
    """``H2F(i) + H2F(h) + H2F(b1) + H2F(b2)`` per gate, left to right in fp32."""
    s = igates.float() + hgates.float()
    if b_ih is not None:
        s = s + b_ih.float()
    if b_hh is not None:
        s = s + b_hh.float()
    return list(s.chunk(n, 1))


def lstm_cell_forward(igates: torch.Tensor, hgates: torch.Tensor, cx: torch.Tensor, b_ih: torch.Tensor | None,
                      b_hh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lstm_cell_forward`` (aten/src/ATen/native/cuda/RNN.cu): (hy, cy, workspace)."""
    dt = igates.dtype
    si, sf, sc, so = _gate_sums(igates, hgates, b_ih, b_hh, 4)
    ig, fg, cg, og = _sigmoid32(si), _sigmoid32(sf), _tanh32(sc), _sigmoid32(so)
    cy = fg * cx.float() + ig * cg
    hy = og * _tanh32(cy)
    return hy.to(dt), cy.to(dt), torch.cat([ig, fg, cg, og], 1).to(dt)


def lstm_cell_backward(grad_hy: torch.Tensor, grad_cy: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor,
                       workspace: torch.Tensor, has_bias: bool):
    """``lstm_cell_backward``: (grad_input_gates, grad_hidden_gates, grad_cx, grad_b_ih, grad_b_hh); the gate
    gradient is the same for both GEMMs, the bias gradient its column sum (fp32 accumulation, rounded)."""
    dt = workspace.dtype
    ig, fg, cg, og = workspace.float().chunk(4, 1)
    go, goc = grad_hy.float(), grad_cy.float()
    t = _tanh32(cy.float())
    gog = go * t
    gcx = go * og * (1 - t * t) + goc
    gig = gcx * cg
    gfg = gcx * cx.float()
    gcg = gcx * ig
    gcx = gcx * fg
    gig = gig * (1 - ig) * ig
    gfg = gfg * (1 - fg) * fg
    gcg = gcg * (1 - cg * cg)
    gog = gog * (1 - og) * og
    grad_gates = torch.cat([gig, gfg, gcg, gog], 1).to(dt)
    grad_bias = grad_gates.float().sum(0).to(dt) if has_bias else None
    return grad_gates, grad_gates, gcx.to(dt), grad_bias, grad_bias


def gru_cell_forward(igates: torch.Tensor, hgates: torch.Tensor, hx: torch.Tensor, b_ih: torch.Tensor | None,
                     b_hh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gru_cell_forward``: (hy, workspace = [rg, ig, ng, hx, hn + b_hn], rounded)."""
    dt = igates.dtype
    ir, ii, in_ = igates.float().chunk(3, 1)
    hr, hi, hn = hgates.float().chunk(3, 1)
    b1 = b_ih.float().chunk(3) if b_ih is not None else (None, None, None)
    b2 = b_hh.float().chunk(3) if b_hh is not None else (None, None, None)

    def plus(x, b):
        return x if b is None else x + b

    rg = _sigmoid32(plus(plus(ir + hr, b1[0]), b2[0]))
    ig = _sigmoid32(plus(plus(ii + hi, b1[1]), b2[1]))
    hn_b = plus(hn, b2[2])
    ng = _tanh32(plus(in_, b1[2]) + rg * hn_b)
    hx32 = hx.float()
    hy = ng + ig * (hx32 - ng)
    return hy.to(dt), torch.cat([rg, ig, ng, hx32, hn_b], 1).to(dt)


def gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool):
    """``gru_cell_backward``: (grad_input_gates, grad_hidden_gates, grad_hx, grad_b_ih, grad_b_hh)."""
    dt = workspace.dtype
    rg, ig, ng, hx, hn = workspace.float().chunk(5, 1)
    go = grad_hy.float()
    gig = go * (hx - ng) * (1 - ig) * ig
    ghx = go * ig
    gin = go * (1 - ig) * (1 - ng * ng)
    ghn = gin * rg
    grg = gin * hn * (1 - rg) * rg
    g_in = torch.cat([grg, gig, gin], 1).to(dt)
    g_hid = torch.cat([grg, gig, ghn], 1).to(dt)
    gb_in = g_in.float().sum(0).to(dt) if has_bias else None
    gb_hid = g_hid.float().sum(0).to(dt) if has_bias else None
    return g_in, g_hid, ghx.to(dt), gb_in, gb_hid


# ------------------------------------------------------------------------------- autograd Functions


class AddrFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, self_, vec1, vec2, beta, alpha):
        ctx.save_for_backward(vec1, vec2)
        ctx.beta, ctx.alpha = beta, alpha
        return addr_forward(self_, vec1, vec2, beta, alpha)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        vec1, vec2 = ctx.saved_tensors
        return (*addr_backward(grad, vec1, vec2, ctx.beta, ctx.alpha), None, None)


class ConvTBCFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, pad):
        ctx.save_for_backward(x, weight)
        ctx.pad = pad
        return conv_tbc_forward(x, weight, bias, pad)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return (*conv_tbc_backward(grad.contiguous(), x, weight, ctx.pad), None)


class AddbmmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, self_, batch1, batch2, beta, alpha):
        ctx.save_for_backward(batch1, batch2)
        ctx.beta, ctx.alpha = beta, alpha
        return addbmm_forward(self_, batch1, batch2, beta, alpha)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        batch1, batch2 = ctx.saved_tensors
        return (*addbmm_backward(grad, batch1, batch2, ctx.beta, ctx.alpha), None, None)


class FusedLSTMCellFunction(torch.autograd.Function):
    """``_thnn_fused_lstm_cell``: saves cx, cy and the rounded workspace, as ThnnFusedLstmCellBackward does."""

    @staticmethod
    def forward(ctx, igates, hgates, cx, b_ih, b_hh):
        hy, cy, workspace = lstm_cell_forward(igates, hgates, cx, b_ih, b_hh)
        ctx.save_for_backward(cx, cy, workspace)
        ctx.has_bias = b_ih is not None
        ctx.mark_non_differentiable(workspace)
        return hy, cy, workspace

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_hy, grad_cy, _grad_workspace):
        cx, cy, workspace = ctx.saved_tensors
        return lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, ctx.has_bias)


class FusedGRUCellFunction(torch.autograd.Function):
    """``_thnn_fused_gru_cell``: saves the rounded workspace, as ThnnFusedGruCellBackward does."""

    @staticmethod
    def forward(ctx, igates, hgates, hx, b_ih, b_hh):
        hy, workspace = gru_cell_forward(igates, hgates, hx, b_ih, b_hh)
        ctx.save_for_backward(workspace)
        ctx.has_bias = b_ih is not None
        ctx.mark_non_differentiable(workspace)
        return hy, workspace

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_hy, _grad_workspace):
        (workspace,) = ctx.saved_tensors
        return gru_cell_backward(grad_hy, workspace, ctx.has_bias)
