"""The emulation against brute-force models of the CUDA kernels that do not round once (docs/emulation.md).

Each model here is written from the CUDA kernel's source, independently of emulation/cuda_kernels.py: element by
element in Python floats, every fp32 operation rounded to fp32 (``f32``) and every store to fp16/bf16 rounded to
that format (``lo``). The inputs lie on a grid (multiples of 1/64, |x| <= 1: exact in fp16 and bf16, products
of 14 bits that fp16 must round) so that every GEMM sum is exact in fp32 whatever its order: the only
roundings left are the kernel's own, and the emulation must equal the model bit for bit, forward and
backward. Each test also checks that one rounding (the emulation's old behaviour, or the CPU composite) would
NOT give the model's values for these inputs, so it cannot pass by accident.

Ops: addr (elementwise kernel in half/bf16 arithmetic), addbmm (one rounded addmm_ per batch), lstm_cell /
gru_cell (two rounded GEMMs, fused fp32 gate kernel saving rounded gates), rnn_tanh/relu_cell (composite),
cudnn convolution bias (a second rounded add; depthwise convs round once), linear on a non-contiguous input
(matmul then add), einsum summing a dimension out of one operand first, prelu's weight gradient, conv_tbc (one
rounded addmm_ per kernel tap), and the same models on tensors already in fp16/bf16 under LowPrecisionGemmMode.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
import torch.nn.functional as F

from precision_audit.emulation.autocast import CudaAutocastPolicy, LowPrecisionGemmMode, emulated_autocast

FP16, BF16 = torch.float16, torch.bfloat16
DTYPES = [pytest.param(FP16, id="fp16"), pytest.param(BF16, id="bf16")]


# ----------------------------------------------------------------------------------- scalar arithmetic


def f32(v: float) -> float:
    """Round a Python float to the nearest fp32 (one IEEE fp32 operation on fp32 operands = this of the
    float64 result)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def lo(v: float, dt: torch.dtype) -> float:
    """Round to fp16/bf16 (round to nearest even), back as a Python float."""
    return torch.tensor(f32(v), dtype=torch.float32).to(dt).item()


def exp32(v: float) -> float:
    return f32(math.exp(v))


def tanh32(v: float) -> float:
    return f32(math.tanh(v))


def sigmoid32(v: float) -> float:  # RNN.cu: one / (one + ::exp(-in)), fp32
    return f32(1.0 / f32(1.0 + exp32(-v)))


def grid(*shape: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 values k/64, |k| <= 64: exact in fp16 and bf16, their GEMM sums (< 2^10 terms) exact in fp32."""
    return torch.randint(-64, 65, shape, generator=gen).float() / 64


def as_list(t: torch.Tensor):
    return t.double().tolist()


def tensor(values, dt: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dt)


def exact_dot(a, b) -> float:
    return math.fsum(x * y for x, y in zip(a, b))


def assert_bitwise(emu: torch.Tensor, model: torch.Tensor, what: str) -> None:
    assert emu.dtype == model.dtype, f"{what}: dtype {emu.dtype}, model {model.dtype}"
    assert emu.shape == model.shape, f"{what}: shape {tuple(emu.shape)}, model {tuple(model.shape)}"
    differ = emu.double() != model.double()
    if differ.any():
        i = int(differ.flatten().nonzero()[0])
        raise AssertionError(f"{what}: {int(differ.sum())}/{emu.numel()} elements differ from the CUDA-kernel model; "
                             f"first: emulated {emu.flatten()[i].item()!r}, model {model.flatten()[i].item()!r}")


def assert_differs(single: torch.Tensor, model: torch.Tensor, what: str) -> None:
    assert (single.double() != model.double()).any(), (
        f"{what}: rounding once gives the model's values for these inputs, so this test could not tell the two "
        "apart (choose other inputs)")


@pytest.fixture
def cuda_policy():
    with CudaAutocastPolicy():
        yield


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.clone().requires_grad_(True) for t in tensors]


# ------------------------------------------------------------------------------------------------ addr


def addr_model(S, v1, v2, beta, alpha, dt):
    """addr_kernel_cuda: beta * self + alpha * vec1 * vec2 in scalar_t (each c10::Half/BFloat16 op rounds)."""
    b, a = lo(beta, dt), lo(alpha, dt)
    out = []
    for i in range(len(v1)):
        row = []
        for j in range(len(v2)):
            prod = lo(f32(lo(f32(a * v1[i]), dt) * v2[j]), dt)
            row.append(prod if b == 0 else lo(f32(lo(f32(b * S[i][j]), dt) + prod), dt))
        out.append(row)
    return out


def addr_grad_model(G, v1, v2, beta, alpha, dt):
    """derivatives.yaml addr: maybe_multiply(grad, beta); maybe_multiply(grad.mv(vec2), alpha); ..."""
    def mm(v, s):
        return v if s == 1 else lo(f32(v * s), dt)
    g_self = [[mm(g, beta) for g in row] for row in G]
    g_v1 = [mm(lo(exact_dot(G[i], v2), dt), alpha) for i in range(len(v1))]
    g_v2 = [mm(lo(exact_dot([G[i][j] for i in range(len(v1))], v1), dt), alpha) for j in range(len(v2))]
    return g_self, g_v1, g_v2


@pytest.mark.parametrize(("beta", "alpha"), [(1, 1), (0.7, 1.3), (0, 2.5)], ids=["plain", "scaled", "beta0"])
@pytest.mark.parametrize("dt", DTYPES)
def test_addr_is_the_elementwise_cuda_kernel(cuda_policy, dt, beta, alpha) -> None:
    gen = torch.Generator().manual_seed(1)
    S, v1, v2 = leaves(grid(12, 13, gen=gen), grid(12, gen=gen), grid(13, gen=gen))
    G = grid(12, 13, gen=gen).to(dt)
    with emulated_autocast(dt):
        y = torch.addr(S, v1, v2, beta=beta, alpha=alpha)
    y.backward(G)
    Sl, v1l, v2l, Gl = (as_list(t.detach().to(dt)) for t in (S, v1, v2, G))
    model = tensor(addr_model(Sl, v1l, v2l, beta, alpha, dt), dt)
    assert_bitwise(y, model, "addr forward")
    g_self, g_v1, g_v2 = addr_grad_model(Gl, v1l, v2l, beta, alpha, dt)
    for name, leaf, ref in (("self", S, g_self), ("vec1", v1, g_v1), ("vec2", v2, g_v2)):
        assert leaf.grad.dtype == torch.float32
        assert_bitwise(leaf.grad.to(dt), tensor(ref, dt), f"addr d{name}")
    if beta != 0:
        single = (S.detach().to(dt).double() * lo(beta, dt) + lo(alpha, dt) * torch.outer(
            v1.detach().to(dt).double(), v2.detach().to(dt).double())).to(dt)
        assert_differs(single, model, "addr")


def test_addr_broadcast_self_gradient_is_summed_in_the_low_dtype(cuda_policy) -> None:
    gen = torch.Generator().manual_seed(2)
    S, v1, v2 = leaves(grid(7, gen=gen), grid(6, gen=gen), grid(7, gen=gen))
    G = grid(6, 7, gen=gen).to(BF16)
    with emulated_autocast(BF16):
        y = torch.addr(S, v1, v2, beta=0.75)
    y.backward(G)
    # the engine reduces maybe_multiply(grad, beta) (rounded) to self's shape: fp32 accumulation, rounded once
    per_elem = [[lo(f32(g * 0.75), BF16) for g in row] for row in as_list(G)]
    ref = [lo(math.fsum(per_elem[i][j] for i in range(6)), BF16) for j in range(7)]
    assert_bitwise(S.grad.to(BF16), tensor(ref, BF16), "addr dself (broadcast)")


# ---------------------------------------------------------------------------------------------- addbmm


def addbmm_model(S, A, B, beta, alpha, dt):
    """addbmm_impl_: result.addmm_(batch1[i], batch2[i], beta_i, alpha), each a cuBLAS GEMM rounded into the
    low-precision result (alpha * acc + beta_i * C in fp32)."""
    n, m = len(A[0]), len(B[0][0])
    out = [[S[i][j] for j in range(m)] for i in range(n)]
    for b in range(len(A)):
        bi = beta if b == 0 else 1
        new = []
        for i in range(n):
            row = []
            for j in range(m):
                acc = f32(exact_dot(A[b][i], [B[b][k][j] for k in range(len(B[b]))]))
                if alpha != 1:
                    acc = f32(alpha * acc)
                if bi != 0:
                    acc = f32(acc + (out[i][j] if bi == 1 else f32(bi * out[i][j])))
                row.append(lo(acc, dt))
            new.append(row)
        out = new
    return out


@pytest.mark.parametrize(("beta", "alpha"), [(1, 1), (0.5, 0.3)], ids=["plain", "scaled"])
@pytest.mark.parametrize("dt", DTYPES)
def test_addbmm_rounds_after_every_batch(cuda_policy, dt, beta, alpha) -> None:
    gen = torch.Generator().manual_seed(3)
    S, A, B = leaves(grid(4, 5, gen=gen), grid(6, 4, 8, gen=gen), grid(6, 8, 5, gen=gen))
    G = grid(4, 5, gen=gen).to(dt)
    with emulated_autocast(dt):
        y = torch.addbmm(S, A, B, beta=beta, alpha=alpha)
    y.backward(G)
    Sl, Al, Bl, Gl = (as_list(t.detach().to(dt)) for t in (S, A, B, G))
    model = tensor(addbmm_model(Sl, Al, Bl, beta, alpha, dt), dt)
    assert_bitwise(y, model, "addbmm forward")
    single = (S.detach().to(dt).double() * beta + alpha * torch.einsum(
        "bik,bkj->ij", A.detach().to(dt).double(), B.detach().to(dt).double())).to(dt)
    assert_differs(single, model, "addbmm")

    def mmul(v, s):
        return v if s == 1 else lo(f32(v * s), dt)
    # backward: one bmm per input against the expanded gradient, then maybe_multiply by alpha
    g_a = [[[mmul(lo(exact_dot(Gl[i], Bl[b][k]), dt), alpha) for k in range(8)] for i in range(4)] for b in range(6)]
    g_b = [[[mmul(lo(math.fsum(Al[b][i][k] * Gl[i][j] for i in range(4)), dt), alpha) for j in range(5)]
            for k in range(8)] for b in range(6)]
    assert_bitwise(A.grad.to(dt), tensor(g_a, dt), "addbmm dbatch1")
    assert_bitwise(B.grad.to(dt), tensor(g_b, dt), "addbmm dbatch2")
    assert_bitwise(S.grad.to(dt), tensor([[mmul(g, beta) for g in row] for row in Gl], dt), "addbmm dself")


# ------------------------------------------------------------------------------------ fused RNN cells


def gemm_rows(X, W, dt):
    """X @ W.T with exact sums, rounded once (the cell's matmul_ih / matmul_hh, no bias)."""
    return [[lo(exact_dot(x, w), dt) for w in W] for x in X]


def lstm_model(X, H, C, Wih, Whh, bih, bhh, dt, gates=None):
    """RNN.cpp LSTMCell on CUDA + RNN.cu lstm_cell_forward: (hy, cy, workspace). ``gates``: the two rounded
    GEMM results when the caller computes them (default: exact sums, rounded once)."""
    ig_, hg_ = gates or (gemm_rows(X, Wih, dt), gemm_rows(H, Whh, dt))
    hsz = len(C[0])
    hy, cy, ws = [], [], []
    for r in range(len(X)):
        hrow, crow, wrow = [], [], [[None] * hsz for _ in range(4)]
        for j in range(hsz):
            s = [f32(f32(f32(ig_[r][g * hsz + j] + hg_[r][g * hsz + j]) + bih[g * hsz + j]) + bhh[g * hsz + j])
                 for g in range(4)]
            i, f, c, o = sigmoid32(s[0]), sigmoid32(s[1]), tanh32(s[2]), sigmoid32(s[3])
            cyv = f32(f32(f * C[r][j]) + f32(i * c))
            hyv = f32(o * tanh32(cyv))
            hrow.append(lo(hyv, dt))
            crow.append(lo(cyv, dt))
            for g, v in enumerate((i, f, c, o)):
                wrow[g][j] = lo(v, dt)
        hy.append(hrow)
        cy.append(crow)
        ws.append([v for g in wrow for v in g])
    return hy, cy, ws


def lstm_grad_model(GH, GC, C, CY, WS, dt):
    """RNN.cu lstm_cell_backward: gate gradients (rounded) and grad_cx, from the rounded workspace."""
    hsz = len(C[0])
    gates, gcx_out = [], []
    for r in range(len(C)):
        ig, fg, cg, og = (WS[r][g * hsz:(g + 1) * hsz] for g in range(4))
        row = [[None] * hsz for _ in range(4)]
        crow = []
        for j in range(hsz):
            go, goc = GH[r][j], GC[r][j]
            t = tanh32(CY[r][j])
            gog = f32(go * t)
            gcx = f32(f32(f32(go * og[j]) * f32(1 - f32(t * t))) + goc)
            gig, gfg, gcg = f32(gcx * cg[j]), f32(gcx * C[r][j]), f32(gcx * ig[j])
            gcx = f32(gcx * fg[j])
            gig = f32(f32(gig * f32(1 - ig[j])) * ig[j])
            gfg = f32(f32(gfg * f32(1 - fg[j])) * fg[j])
            gcg = f32(gcg * f32(1 - f32(cg[j] * cg[j])))
            gog = f32(f32(gog * f32(1 - og[j])) * og[j])
            for g, v in enumerate((gig, gfg, gcg, gog)):
                row[g][j] = lo(v, dt)
            crow.append(lo(gcx, dt))
        gates.append([v for g in row for v in g])
        gcx_out.append(crow)
    return gates, gcx_out


def _cell_inputs(gen, batch, n_in, hsz, chunks):
    return leaves(grid(batch, n_in, gen=gen), grid(batch, hsz, gen=gen), grid(batch, hsz, gen=gen),
                  grid(chunks * hsz, n_in, gen=gen), grid(chunks * hsz, hsz, gen=gen), grid(chunks * hsz, gen=gen),
                  grid(chunks * hsz, gen=gen))


@pytest.mark.parametrize("dt", DTYPES)
def test_lstm_cell_is_two_rounded_gemms_and_the_fused_kernel(cuda_policy, dt) -> None:
    gen = torch.Generator().manual_seed(4)
    x, h, c, wih, whh, bih, bhh = _cell_inputs(gen, 3, 5, 4, 4)
    GH, GC = grid(3, 4, gen=gen).to(dt), grid(3, 4, gen=gen).to(dt)
    with emulated_autocast(dt):
        hy, cy = torch.lstm_cell(x, [h, c], wih, whh, bih, bhh)
    torch.autograd.backward([hy, cy], [GH, GC])
    L = {k: as_list(v.detach().to(dt)) for k, v in dict(x=x, h=h, c=c, wih=wih, whh=whh, bih=bih, bhh=bhh).items()}
    m_hy, m_cy, m_ws = lstm_model(L["x"], L["h"], L["c"], L["wih"], L["whh"], L["bih"], L["bhh"], dt)
    assert_bitwise(hy, tensor(m_hy, dt), "lstm_cell hy")
    assert_bitwise(cy, tensor(m_cy, dt), "lstm_cell cy")
    composite = torch.lstm_cell(*(t.detach().to(dt) for t in (x,)), [h.detach().to(dt), c.detach().to(dt)],
                                *(t.detach().to(dt) for t in (wih, whh, bih, bhh)))
    assert_differs(torch.cat(composite, 1), tensor([a + b for a, b in zip(m_hy, m_cy)], dt),
                   "lstm_cell vs the CPU composite in the low dtype")

    g_gates, g_cx = lstm_grad_model(as_list(GH), as_list(GC), L["c"], m_cy, m_ws, dt)
    n_in = 5
    g_x = [[lo(math.fsum(g_gates[r][k] * L["wih"][k][i] for k in range(16)), dt) for i in range(n_in)]
           for r in range(3)]
    g_h = [[lo(math.fsum(g_gates[r][k] * L["whh"][k][i] for k in range(16)), dt) for i in range(4)] for r in range(3)]
    g_wih = [[lo(math.fsum(g_gates[r][k] * L["x"][r][i] for r in range(3)), dt) for i in range(n_in)]
             for k in range(16)]
    g_b = [lo(math.fsum(g_gates[r][k] for r in range(3)), dt) for k in range(16)]
    assert_bitwise(c.grad.to(dt), tensor(g_cx, dt), "lstm_cell dcx")
    assert_bitwise(x.grad.to(dt), tensor(g_x, dt), "lstm_cell dinput")
    assert_bitwise(h.grad.to(dt), tensor(g_h, dt), "lstm_cell dhx")
    assert_bitwise(wih.grad.to(dt), tensor(g_wih, dt), "lstm_cell dw_ih")
    assert_bitwise(bih.grad.to(dt), tensor(g_b, dt), "lstm_cell db_ih")
    assert_bitwise(bhh.grad.to(dt), tensor(g_b, dt), "lstm_cell db_hh (the same column sum)")


def gru_model(X, H, Wih, Whh, bih, bhh, dt, gates=None):
    """RNN.cpp GRUCell on CUDA + RNN.cu gru_cell_forward: (hy, workspace); ``gates`` as for lstm_model."""
    ig_, hg_ = gates or (gemm_rows(X, Wih, dt), gemm_rows(H, Whh, dt))
    hsz = len(H[0])
    hy, ws = [], []
    for r in range(len(X)):
        hrow, wrow = [], [[None] * hsz for _ in range(5)]
        for j in range(hsz):
            def at(v, g, j=j):
                return v[g * hsz + j]
            rg = sigmoid32(f32(f32(f32(at(ig_[r], 0) + at(hg_[r], 0)) + at(bih, 0)) + at(bhh, 0)))
            zg = sigmoid32(f32(f32(f32(at(ig_[r], 1) + at(hg_[r], 1)) + at(bih, 1)) + at(bhh, 1)))
            hn = f32(at(hg_[r], 2) + at(bhh, 2))
            ng = tanh32(f32(f32(at(ig_[r], 2) + at(bih, 2)) + f32(rg * hn)))
            hrow.append(lo(f32(ng + f32(zg * f32(H[r][j] - ng))), dt))
            for g, v in enumerate((rg, zg, ng, H[r][j], hn)):
                wrow[g][j] = lo(v, dt)
        hy.append(hrow)
        ws.append([v for g in wrow for v in g])
    return hy, ws


def gru_grad_model(GH, WS, dt):
    """RNN.cu gru_cell_backward: (grad_input_gates, grad_hidden_gates, grad_hx)."""
    hsz = len(GH[0])
    g_in, g_hid, g_hx = [], [], []
    for r in range(len(GH)):
        rg, zg, ng, hx, hn = (WS[r][g * hsz:(g + 1) * hsz] for g in range(5))
        a, b, c = [], [], []
        for j in range(hsz):
            go = GH[r][j]
            gig = f32(f32(f32(go * f32(hx[j] - ng[j])) * f32(1 - zg[j])) * zg[j])
            ghx = f32(go * zg[j])
            gin = f32(f32(go * f32(1 - zg[j])) * f32(1 - f32(ng[j] * ng[j])))
            ghn = f32(gin * rg[j])
            grg = f32(f32(f32(gin * hn[j]) * f32(1 - rg[j])) * rg[j])
            a.append((lo(grg, dt), lo(gig, dt), lo(gin, dt)))
            b.append((lo(grg, dt), lo(gig, dt), lo(ghn, dt)))
            c.append(lo(ghx, dt))
        g_in.append([t[g] for g in range(3) for t in a])
        g_hid.append([t[g] for g in range(3) for t in b])
        g_hx.append(c)
    return g_in, g_hid, g_hx


@pytest.mark.parametrize("dt", DTYPES)
def test_gru_cell_is_two_rounded_gemms_and_the_fused_kernel(cuda_policy, dt) -> None:
    gen = torch.Generator().manual_seed(5)
    x, h, _, wih, whh, bih, bhh = _cell_inputs(gen, 3, 5, 4, 3)
    GH = grid(3, 4, gen=gen).to(dt)
    with emulated_autocast(dt):
        hy = torch.gru_cell(x, h, wih, whh, bih, bhh)
    hy.backward(GH)
    L = {k: as_list(v.detach().to(dt)) for k, v in dict(x=x, h=h, wih=wih, whh=whh, bih=bih, bhh=bhh).items()}
    m_hy, m_ws = gru_model(L["x"], L["h"], L["wih"], L["whh"], L["bih"], L["bhh"], dt)
    assert_bitwise(hy, tensor(m_hy, dt), "gru_cell hy")
    composite = torch.gru_cell(*(t.detach().to(dt) for t in (x, h, wih, whh, bih, bhh)))
    assert_differs(composite, tensor(m_hy, dt), "gru_cell vs the CPU composite in the low dtype")

    g_in, g_hid, g_hx = gru_grad_model(as_list(GH), m_ws, dt)
    # hx feeds the fused kernel (grad_hx) and matmul_hh: the engine adds the two low-precision gradients
    g_h = [[lo(f32(g_hx[r][i] + lo(math.fsum(g_hid[r][k] * L["whh"][k][i] for k in range(12)), dt)), dt)
            for i in range(4)] for r in range(3)]
    g_x = [[lo(math.fsum(g_in[r][k] * L["wih"][k][i] for k in range(12)), dt) for i in range(5)] for r in range(3)]
    g_whh = [[lo(math.fsum(g_hid[r][k] * L["h"][r][i] for r in range(3)), dt) for i in range(4)] for k in range(12)]
    assert_bitwise(x.grad.to(dt), tensor(g_x, dt), "gru_cell dinput")
    assert_bitwise(h.grad.to(dt), tensor(g_h, dt), "gru_cell dhx")
    assert_bitwise(whh.grad.to(dt), tensor(g_whh, dt), "gru_cell dw_hh")
    assert_bitwise(bih.grad.to(dt), tensor([lo(math.fsum(g_in[r][k] for r in range(3)), dt) for k in range(12)], dt),
                   "gru_cell db_ih")
    assert_bitwise(bhh.grad.to(dt), tensor([lo(math.fsum(g_hid[r][k] for r in range(3)), dt) for k in range(12)], dt),
                   "gru_cell db_hh")


@pytest.mark.parametrize("cell", ["rnn_tanh_cell", "rnn_relu_cell"])
@pytest.mark.parametrize("dt", DTYPES)
def test_simple_rnn_cells_are_the_composite(cuda_policy, dt, cell) -> None:
    """RNN.cpp SimpleCell: linear_hh(hx).add_(linear_ih(x)) (two addmm, one rounding each), then the
    nonlinearity in the low dtype."""
    gen = torch.Generator().manual_seed(6)
    x, h, _, wih, whh, bih, bhh = _cell_inputs(gen, 3, 5, 4, 1)
    with emulated_autocast(dt):
        y = getattr(torch, cell)(x, h, wih, whh, bih, bhh)
    L = {k: as_list(v.detach().to(dt)) for k, v in dict(x=x, h=h, wih=wih, whh=whh, bih=bih, bhh=bhh).items()}
    act = math.tanh if cell == "rnn_tanh_cell" else (lambda v: max(v, 0.0))
    ref = [[lo(act(lo(f32(lo(exact_dot(L["h"][r], L["whh"][j]) + L["bhh"][j], dt) +
                          lo(exact_dot(L["x"][r], L["wih"][j]) + L["bih"][j], dt)), dt)), dt)
            for j in range(4)] for r in range(3)]
    assert_bitwise(y, tensor(ref, dt), cell)


# ------------------------------------------------------------------- GEMMs whose bias is added apart


@pytest.mark.parametrize("dt", DTYPES)
def test_conv_bias_is_a_second_rounding_except_depthwise(cuda_policy, dt) -> None:
    """Convolution.cpp: cuDNN computes the convolution without bias, `output.add_(bias)` rounds again; CUDA's
    depthwise kernels add the bias inside (one rounding); with cuDNN disabled the slow path rounds once too."""
    gen = torch.Generator().manual_seed(7)
    x, w, b = grid(2, 4, 6, 6, gen=gen), grid(8, 4, 3, 3, gen=gen), grid(8, gen=gen) + 1 / 64
    wd = grid(8, 1, 3, 3, gen=gen)
    xl, wl, bl, wdl = (t.to(dt).double() for t in (x, w, b, wd))
    with emulated_autocast(dt):
        y = F.conv2d(x, w, b)
        yd = F.conv2d(x, wd, b, groups=4)
        with torch.backends.cudnn.flags(enabled=False):
            y_slow = F.conv2d(x, w, b)
    two = (F.conv2d(xl, wl).to(dt).double() + bl.view(1, -1, 1, 1)).to(dt)
    one = F.conv2d(xl, wl, bl).to(dt)
    assert_bitwise(y, two, "conv2d with bias (cuDNN, bias added by a second kernel)")
    assert_differs(one, two, "conv2d bias")
    assert_bitwise(yd, F.conv2d(xl, wdl, bl, groups=4).to(dt), "depthwise conv2d (bias inside the kernel)")
    assert_bitwise(y_slow, one, "conv2d with cuDNN disabled (one rounding)")


@pytest.mark.parametrize("dt", DTYPES)
def test_linear_on_a_non_contiguous_input_adds_the_bias_apart(cuda_policy, dt) -> None:
    """Linear.cpp: a non-contiguous n-D input takes matmul + add (two roundings); 2-D or contiguous: addmm."""
    gen = torch.Generator().manual_seed(8)
    x, w, b = grid(5, 3, 8, gen=gen).transpose(0, 1), grid(6, 8, gen=gen), grid(6, gen=gen) + 1 / 64
    xl, wl, bl = (t.to(dt).double() for t in (x, w, b))
    with emulated_autocast(dt):
        y = F.linear(x, w, b)
        yc = F.linear(x.contiguous(), w, b)
    two = ((xl @ wl.t()).to(dt).double() + bl).to(dt)
    one = F.linear(xl, wl, bl).to(dt)
    assert not x.is_contiguous()
    assert_bitwise(y, two, "linear, non-contiguous 3-D input (matmul, then add)")
    assert_bitwise(yc, one, "linear, contiguous 3-D input (addmm)")
    assert_differs(one, two, "linear bias")


@pytest.mark.parametrize("dt", DTYPES)
def test_einsum_sums_a_lone_dimension_first(cuda_policy, dt) -> None:
    """einsum ("ij,jk->i"): k appears only in the second operand, so it is summed (rounded) before the bmm."""
    gen = torch.Generator().manual_seed(9)
    # b: normal values already in dt (their row sums need more bits than dt has, and fit fp32 exactly)
    a, b = grid(4, 6, gen=gen), torch.randn(6, 256, generator=gen).to(dt).float()
    al, bl = a.to(dt).double(), b.to(dt).double()
    with emulated_autocast(dt):
        y = torch.einsum("ij,jk->i", a, b)
    two = (al @ bl.sum(1).to(dt).double()).to(dt)
    assert_bitwise(y, two, "einsum ij,jk->i")
    assert_differs((al @ bl).sum(1).to(dt), two, "einsum")


@pytest.mark.parametrize("dt", DTYPES)
def test_prelu_weight_gradient_rounds_each_product(cuda_policy, dt) -> None:
    """_prelu_kernel_backward returns x * grad per element (rounded), which the engine sums to the weight."""
    gen = torch.Generator().manual_seed(10)
    x, w = leaves(grid(4, 3, 5, gen=gen) * 0.9, grid(3, gen=gen))
    G = grid(4, 3, 5, gen=gen).to(dt)
    with emulated_autocast(dt):
        y = F.prelu(x, w)
    y.backward(G)
    xl, wl, Gl = x.detach().to(dt).double(), w.detach().to(dt).double(), G.double()
    assert_bitwise(y, torch.where(xl > 0, xl, xl * wl.view(1, 3, 1)).to(dt), "prelu forward")
    per_elem = torch.where(xl > 0, 0.0, xl * Gl).to(dt).double()
    ref = per_elem.sum((0, 2)).to(dt)
    assert_bitwise(w.grad.to(dt), ref, "prelu dweight")
    assert_differs(torch.where(xl > 0, 0.0, xl * Gl).sum((0, 2)).to(dt), ref, "prelu dweight")


@pytest.mark.parametrize("dt", DTYPES)
def test_cudnn_convolution_runs_on_cpu_as_one_rounded_convolution(cuda_policy, dt) -> None:
    gen = torch.Generator().manual_seed(11)
    x, w = grid(2, 4, 6, 6, gen=gen), grid(8, 4, 3, 3, gen=gen)
    with emulated_autocast(dt):
        y = torch.cudnn_convolution(x, w, (1, 1), (1, 1), (1, 1), 1, False, True, True)
        yt = torch.cudnn_convolution_transpose(x, w.transpose(0, 1), (1, 1), (0, 0), (1, 1), (1, 1), 1, False, True,
                                               True)
    xl, wl = x.to(dt).double(), w.to(dt).double()
    assert_bitwise(y, F.conv2d(xl, wl, padding=1).to(dt), "cudnn_convolution")
    assert_bitwise(yt, F.conv_transpose2d(xl, wl.transpose(0, 1), padding=1).to(dt), "cudnn_convolution_transpose")


# --------------------------------------------------------- tensors already in fp16/bf16 (dispatch mode)


@pytest.mark.parametrize("dt", DTYPES)
def test_gemm_mode_uses_the_same_models(dt) -> None:
    """A model cast with .half(): LowPrecisionGemmMode computes addr, addbmm and convolution(+bias) as CUDA
    does; their backward formulas run as ordinary ops (GEMMs emulated)."""
    gen = torch.Generator().manual_seed(12)
    S, v1, v2 = (t.to(dt).requires_grad_() for t in (grid(6, 7, gen=gen), grid(6, gen=gen), grid(7, gen=gen)))
    M, A, B = (t.to(dt) for t in (grid(4, 5, gen=gen), grid(6, 4, 8, gen=gen), grid(6, 8, 5, gen=gen)))
    x, w, b = (t.to(dt) for t in (grid(2, 4, 6, 6, gen=gen), grid(8, 4, 3, 3, gen=gen), grid(8, gen=gen) + 1 / 64))
    G = grid(6, 7, gen=gen).to(dt)
    mode = LowPrecisionGemmMode()
    with mode:
        y_addr = torch.addr(S, v1, v2, beta=0.7, alpha=1.3)
        y_addbmm = torch.addbmm(M, A, B)
        y_conv = F.conv2d(x, w, b)
        y_addr.backward(G)
    L = [as_list(t.detach()) for t in (S, v1, v2)]
    assert_bitwise(y_addr, tensor(addr_model(*L, 0.7, 1.3, dt), dt), "addr under the dispatch mode")
    assert_bitwise(y_addbmm, tensor(addbmm_model(*(as_list(t) for t in (M, A, B)), 1, 1, dt), dt),
                   "addbmm under the dispatch mode")
    xl, wl, bl = (t.double() for t in (x, w, b))
    assert_bitwise(y_conv, (F.conv2d(xl, wl).to(dt).double() + bl.view(1, -1, 1, 1)).to(dt),
                   "conv2d+bias under the dispatch mode")
    g_self, g_v1, g_v2 = addr_grad_model(as_list(G), L[1], L[2], 0.7, 1.3, dt)
    assert_bitwise(v1.grad, tensor(g_v1, dt), "addr dvec1 under the dispatch mode")
    assert_bitwise(v2.grad, tensor(g_v2, dt), "addr dvec2 under the dispatch mode")
    assert_bitwise(S.grad, tensor(g_self, dt), "addr dself under the dispatch mode")


@pytest.mark.parametrize("pad", [0, 1])
@pytest.mark.parametrize("dt", DTYPES)
def test_conv_tbc_adds_one_rounded_gemm_per_kernel_tap(cuda_policy, dt, pad) -> None:
    """ConvolutionTBC.cpp: output = bias, then O.addmm_(I, W[k]) per tap (rounded each time); backward:
    dInput accumulated tap by tap the same way, dWeight[k] one GEMM each, dBias summed over time then batch."""
    gen = torch.Generator().manual_seed(13)
    x, w, b = leaves(grid(7, 2, 5, gen=gen), grid(3, 5, 4, gen=gen), grid(4, gen=gen))
    with emulated_autocast(dt):
        y = torch.conv_tbc(x, w, b, pad)
    G = grid(*y.shape, gen=gen).to(dt)
    y.backward(G)
    X, W, B, Gl = (as_list(t.detach().to(dt)) for t in (x, w, b, G))
    ilen, batch, cin, kw, cout = 7, 2, 5, 3, 4
    olen = ilen - kw + 1 + 2 * pad
    out = [[[B[o] for o in range(cout)] for _ in range(batch)] for _ in range(olen)]
    d_x = [[[0.0] * cin for _ in range(batch)] for _ in range(ilen)]
    taps = []
    for k in range(kw):
        i_shift, o_shift = max(0, k - pad), max(0, pad - k)
        t = min(ilen + pad - k, olen) - o_shift
        if t > 0:
            taps.append((k, i_shift, o_shift, t))
    for k, i_shift, o_shift, t in taps:
        for s in range(t):
            for n in range(batch):
                for o in range(cout):
                    acc = math.fsum(X[i_shift + s][n][c] * W[k][c][o] for c in range(cin))
                    out[o_shift + s][n][o] = lo(f32(out[o_shift + s][n][o] + acc), dt)
                for c in range(cin):
                    acc = math.fsum(Gl[o_shift + s][n][o] * W[k][c][o] for o in range(cout))
                    d_x[i_shift + s][n][c] = lo(f32(d_x[i_shift + s][n][c] + acc), dt)
    d_w = [[[0.0] * cout for _ in range(cin)] for _ in range(kw)]
    for k, i_shift, o_shift, t in taps:  # dWeight[k].addmm_(I.t(), dO): one GEMM into zeros
        for c in range(cin):
            for o in range(cout):
                d_w[k][c][o] = lo(math.fsum(X[i_shift + s][n][c] * Gl[o_shift + s][n][o]
                                            for s in range(t) for n in range(batch)), dt)
    per_batch = [[lo(math.fsum(Gl[s][n][o] for s in range(olen)), dt) for o in range(cout)] for n in range(batch)]
    d_b = [lo(math.fsum(per_batch[n][o] for n in range(batch)), dt) for o in range(cout)]
    assert_bitwise(y, tensor(out, dt), f"conv_tbc(pad={pad}) forward")
    assert_bitwise(x.grad.to(dt), tensor(d_x, dt), "conv_tbc dinput")
    assert_bitwise(w.grad.to(dt), tensor(d_w, dt), "conv_tbc dweight")
    assert_bitwise(b.grad.to(dt), tensor(d_b, dt), "conv_tbc dbias")
    single = torch.conv_tbc(x.detach().to(dt).double(), w.detach().to(dt).double(), b.detach().to(dt).double(),
                            pad).to(dt)
    assert_differs(single, tensor(out, dt), "conv_tbc")


def test_the_cost_model_sees_addbmm_and_conv_tbc_as_gemms() -> None:
    """Both are GEMMs on a GPU (one per batch / kernel tap), whatever the CPU reference runs."""
    from precision_audit.capture.ops import ModuleOps, record_op

    ops = ModuleOps()
    a, b, c = torch.randn(4, 3, 8), torch.randn(4, 8, 5), torch.randn(3, 5)
    record_op(ops, torch.ops.aten.addbmm.default, (c, a, b), {}, torch.addbmm(c, a, b))
    x, w, bias = torch.randn(7, 2, 5), torch.randn(3, 5, 4), torch.randn(4)
    record_op(ops, torch.ops.aten.conv_tbc.default, (x, w, bias, 1), {}, torch.conv_tbc(x, w, bias, 1))
    got = {g.op: (g.m, g.n, g.k, g.batch, g.flops) for g, _ in ops.gemms.values()}
    assert got == {"addbmm": (3, 5, 8, 4, 2 * 4 * 3 * 5 * 8), "conv_tbc": (14, 4, 5, 3, 2 * 3 * 14 * 5 * 4)}
    assert ops.other_ops == 0
