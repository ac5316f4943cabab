"""TF32 (issue 18 item 3): the rounding, brute force against an arithmetic model; the emulated TF32 GEMMs; a
hand-made model whose TF32 error is known exactly; the TF32 pass in audit.json and the policy's TF32 switches
set from it (docs/emulation.md, "TF32"; docs/plan.md, "TF32")."""

from __future__ import annotations

import math

import pytest
import torch

from fakecuda import fake_cuda  # noqa: F401 - the fixture
from precision_audit.analysis.findings import Budget, FormatSummary
from precision_audit.capture.gemm_mode import Tf32GemmMode, round_to_tf32
from precision_audit.formats import SPECS, Format
from precision_audit.gpus import resolve_target
from precision_audit.planning.rules import LayerPlan, Plan
from precision_audit.policy.build import tf32_decision

# --- the rounding, against a model written in exact float64 arithmetic (no bit tricks) ----------------------------


def _reference_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto TF32's grid, computed in float64 (exact for every float32 input): the grid step
    at |x| is 2^(e - 10) with e the exponent of x's leading bit (at least -126: the subnormal grid continues
    at 2^-136); a tie goes to the neighbour with an even multiple of the step; a result >= 2^128 is inf."""
    d = x.double()
    finite = torch.isfinite(d)
    a = torch.where(finite, d.abs(), torch.zeros_like(d))
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1): the leading bit is 2^(e-1)
    lead = torch.clamp(e - 1, min=-126)
    step = torch.ldexp(torch.ones_like(a), lead - 10)
    q = a / step  # exact: a division by a power of two
    lo = torch.floor(q)
    frac = q - lo
    up = (frac > 0.5) | ((frac == 0.5) & (torch.remainder(lo, 2) == 1))
    r = (lo + up.double()) * step
    r = torch.where(r >= 2.0 ** 128, torch.full_like(r, math.inf), r)
    out = torch.copysign(r, d).float()
    return torch.where(finite, out, x)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).view(torch.float32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaN payloads included."""
    return bool(torch.equal(_bits(a), _bits(b)))


def test_every_exponent_and_kept_mantissa_at_every_rounding_boundary_matches_the_arithmetic_model():
    # all 256 exponent fields x all 1024 kept mantissas x the low-13-bit patterns that decide the rounding
    # (0, just above 0, just below the tie, the tie itself, just above it, all ones), both signs: 3.1M values,
    # every tie case of every binade (and of the subnormal range) among them
    exp = torch.arange(256, dtype=torch.int64).view(-1, 1, 1)
    kept = torch.arange(1024, dtype=torch.int64).view(1, -1, 1)
    low = torch.tensor([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF], dtype=torch.int64).view(1, 1, -1)
    pos = (exp << 23) | (kept << 13) | low
    b = torch.cat([pos.flatten(), pos.flatten() | (1 << 31)])
    b = torch.where(b >= 2 ** 31, b - 2 ** 32, b)  # as int32 bit patterns
    x = _from_bits(b)
    got, want = round_to_tf32(x), _reference_tf32(x)
    assert _same(got, want)
    finite = torch.isfinite(got)
    assert bool(((_bits(got[finite]) & 0x1FFF) == 0).all())  # the low 13 mantissa bits are zero


def test_random_bit_patterns_and_every_low_13_bit_pattern_of_some_values_match_the_model():
    g = torch.Generator().manual_seed(0)
    b = torch.randint(-2 ** 31, 2 ** 31, (2_000_000,), generator=g, dtype=torch.int64)
    x = _from_bits(b)
    assert _same(round_to_tf32(x), _reference_tf32(x))
    # exhaustively over the dropped bits for a few kept mantissas (even and odd) in a normal and a subnormal binade
    for hi in (0x3F800000, 0x3F802000, 0x3FFFE000, 0x00002000, 0x007FE000, 0x7F7FE000):
        y = _from_bits(torch.arange(hi, hi + 0x2000, dtype=torch.int64))
        assert _same(round_to_tf32(y), _reference_tf32(y))


def test_ties_go_to_the_even_neighbour():
    t = torch.tensor([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -(1 + 2.0 ** -11), 2 + 2.0 ** -10], dtype=torch.float32)
    assert round_to_tf32(t).tolist() == [1.0, 1 + 2.0 ** -9, -1.0, 2.0]
    just_above = torch.tensor([1 + 2.0 ** -11 + 2.0 ** -23], dtype=torch.float32)
    assert round_to_tf32(just_above).item() == 1 + 2.0 ** -10


def test_subnormals_keep_tf32s_grid_and_round_up_into_the_normal_range():
    vals = [2.0 ** -149, 2.0 ** -137, 2.0 ** -137 + 2.0 ** -149, 3 * 2.0 ** -137, (2.0 ** -126) - 2.0 ** -149]
    got = round_to_tf32(torch.tensor(vals, dtype=torch.float32)).tolist()
    # below half the first step: 0; the tie at half a step: 0 (even); above: one step; 1.5 steps: 2 steps (even);
    # the largest fp32 subnormal: up to the smallest normal
    assert got == [0.0, 0.0, 2.0 ** -136, 2.0 ** -135, 2.0 ** -126]
    assert SPECS[Format.TF32].min_subnormal == 2.0 ** -136


def test_inf_nan_and_signed_zero_pass_unchanged():
    nan_payload = _from_bits(torch.tensor([0x7FC01234], dtype=torch.int64))
    x = torch.cat([torch.tensor([math.inf, -math.inf, 0.0, -0.0], dtype=torch.float32), nan_payload])
    assert _same(round_to_tf32(x), x)


def test_values_near_fp32_max_round_up_to_inf_from_tf32s_overflow_threshold():
    tf32_max = SPECS[Format.TF32].max
    mid = SPECS[Format.TF32].overflow_from  # (2 - 2^-11) * 2^127: a tie, TF32's max is odd, so it goes up
    assert mid == (2 - 2.0 ** -11) * 2.0 ** 127
    below = float(torch.nextafter(torch.tensor(mid), torch.tensor(0.0)))
    fp32_max = float(torch.finfo(torch.float32).max)
    got = round_to_tf32(torch.tensor([tf32_max, below, mid, fp32_max, -fp32_max], dtype=torch.float32)).tolist()
    assert got == [tf32_max, tf32_max, math.inf, math.inf, -math.inf]


def test_the_rounding_error_is_at_most_half_a_tf32_step():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-100, 100, (100_000,), generator=g).float())
    rel = ((round_to_tf32(x).double() - x.double()).abs() / x.double().abs()).max().item()
    assert 0 < rel <= 2.0 ** -11


def test_round_to_tf32_refuses_other_dtypes():
    with pytest.raises(TypeError, match="float32"):
        round_to_tf32(torch.ones(2, dtype=torch.float16))


# --- the emulated TF32 GEMMs -------------------------------------------------------------------------------------

W = 1 + 3 * 2.0 ** -12  # TF32 rounds it to 1 + 2^-10 (0.75 of a step: up)
W_TF32 = 1 + 2.0 ** -10


def test_gemm_operands_are_rounded_the_addend_and_other_ops_are_not():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    w = torch.eye(3) * W
    bias = torch.full((3,), 2.0 ** -20)
    with Tf32GemmMode() as mode:
        mm = x @ w
        lin = torch.nn.functional.linear(x, w, bias)  # addmm: the bias enters the fp32 epilogue unrounded
        mul = x * W  # elementwise: fp32
    assert mm.dtype == torch.float32 and mm.tolist() == [[1 * W_TF32, 2 * W_TF32, 3 * W_TF32]]
    assert lin.tolist() == [[v * W_TF32 + 2.0 ** -20 for v in (1.0, 2.0, 3.0)]]
    assert mul.tolist() == [[1 * W, 2 * W, 3 * W]]
    assert mode.gemm_calls == 2
    assert (x @ w).tolist() == [[1 * W, 2 * W, 3 * W]]  # outside the mode: IEEE fp32


def test_gradient_gemms_and_convolutions_run_on_tf32_too():
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    w = (torch.eye(2) * W).requires_grad_()
    with Tf32GemmMode():
        (x @ w).sum().backward()
    assert x.grad.tolist() == [[W_TF32, W_TF32]]  # dL/dx = 1 @ round(w)^T
    assert w.grad.tolist() == [[1.0, 1.0], [2.0, 2.0]]  # x^T @ 1: both exact in TF32
    img = torch.full((1, 1, 2, 2), 2.0, requires_grad=True)
    k = torch.full((1, 1, 1, 1), W, requires_grad=True)
    with Tf32GemmMode():
        y = torch.nn.functional.conv2d(img, k)
        y.sum().backward()
    assert y.flatten().tolist() == [2 * W_TF32] * 4
    assert img.grad.flatten().tolist() == [W_TF32] * 4  # dgrad reads round(k)


def test_fp16_and_fp64_gemms_are_left_alone():
    a = torch.full((2, 2), W, dtype=torch.float64)
    h = torch.full((2, 2), 1.5, dtype=torch.float16)
    with Tf32GemmMode() as mode:
        assert (a @ a)[0, 0].item() == 2 * W * W
        (h @ h)
    assert mode.gemm_calls == 0


# --- a hand-made model with a known TF32 error, through the whole audit ------------------------------------------


class _Scale(torch.nn.Module):
    """y = x @ (W * I): TF32 computes x * (1 + 2^-10) exactly, FP32 x * W."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(4) * W)

    def forward(self, x):
        return self.lin(x)


EXPECTED_REL = (W_TF32 - W) / W  # every output element off by the same relative amount


def _audit(budget=None, target="a100", formats="tf32"):
    import precision_audit

    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-1.0, 0.5, 8.0, 16.0]])
    return precision_audit.audit(_Scale(), x, loss_fn=lambda out, batch: out.sum(), target=target, formats=formats,
                                 budget=budget, progress=False, device="cpu", steps=0)


def test_the_tf32_pass_measures_the_known_error_of_a_hand_made_model_and_turns_tf32_on(monkeypatch):
    # a 4x4 GEMM is launch-bound: at the cost model's per-kernel floor every format ties with FP32 and uniform
    # fp32 is returned (tests/analysis/test_cost_floor.py), and with K = 4 its tiles' fixed cost outweighs TF32's
    # peak (analysis/cost.py's calibration); this test is about TF32's speed from its peak, so neither
    from precision_audit.analysis import cost

    monkeypatch.setattr(cost, "KERNEL_FLOOR_S", 0.0)
    monkeypatch.setattr(cost, "K_HALF_AT_BF16_PEAK", 0.0)
    r = _audit()
    a = r.audit
    assert a["formats"] == ["tf32"]
    assert "aten.mm.default" in a["emulation"]["tf32"]["gemm_ops"] and a["emulation"]["tf32"]["known_gaps"]
    out = a["summary"]["tf32"]
    assert out["output"]["rel_l2"] == pytest.approx(EXPECTED_REL, rel=1e-6) and out["safe"]
    # loss = sum(x) * W in FP32, sum(x) * (1 + 2^-10) in TF32
    assert out["loss_rel_change"] == pytest.approx(EXPECTED_REL, rel=1e-5)
    layer = next(L for L in a["layers"] if L["name"] == "lin")
    assert layer["error"]["tf32"]["local"]["rel_l2"] == pytest.approx(EXPECTED_REL, rel=1e-6)
    assert layer["error"]["tf32"]["accumulated"]["rel_l2"] == pytest.approx(EXPECTED_REL, rel=1e-6)
    # speed from the target's TF32 peak; the plan weighs the uniform tf32 candidate
    assert a["estimates"]["step_time_s"]["tf32"] < a["estimates"]["step_time_s"]["fp32"]
    chosen = [c["label"] for c in a["plan"]["candidates"] if c["chosen"]]
    assert chosen == ["uniform tf32"]  # within budget, and faster than fp32 on the target
    p = r.policy
    assert p.default_format == "tf32" and p.tf32_matmul and p.tf32_cudnn
    assert "tf32" in r.html.lower()


def test_tf32_measured_within_budget_beside_bf16_turns_the_switches_on_for_a_bf16_plan():
    r = _audit(formats="bf16,tf32")
    assert r.audit["formats"] == ["bf16", "tf32"]
    p = r.policy
    assert p.default_format == "bf16" and p.tf32_matmul and p.tf32_cudnn
    assert p.extra["tf32_reason"].startswith("on: the TF32 pass is within budget (loss change 2.44e-04")
    import re

    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", r.html))
    assert text.count("est. tf32") == 1  # the GEMM table's tf32 column once, though tf32 is also audited


def test_a_tf32_error_over_the_budget_switches_tf32_off_with_the_measured_figure():
    r = _audit(budget=Budget(max_loss_rel_change=1e-5, max_output_rel_error=1e-5))
    assert not r.policy.tf32_matmul and not r.policy.tf32_cudnn
    reason = r.policy.extra["tf32_reason"]
    assert reason.startswith("off: the TF32 pass is over budget") and "output error" in reason
    assert r.policy.default_format == "fp32"


def test_tf32_is_not_a_candidate_before_ampere():
    r = _audit(target="v100", formats="fp16,tf32")
    a = r.audit
    assert a["formats"] == ["fp16"]
    skipped = {s["format"]: s["reason"] for s in a["formats_skipped"]}
    assert "has no tf32 Tensor Cores" in skipped["tf32"] and "Ampere" in skipped["tf32"]
    assert not r.policy.tf32_matmul and "no TF32 Tensor Cores" in r.policy.extra["tf32_reason"]


# --- the switch decision, case by case ----------------------------------------------------------------------------


def _summary(safe: bool) -> FormatSummary:
    verdict = "safe as is: loss change 1e-04, output error 2e-04" if safe else "unsafe as is: loss changes by 0.1"
    return FormatSummary(Format.TF32, 1.0, 1e-4, None, 0, 0, 1.0, None, safe, verdict)


def test_tf32_switches_follow_the_measurement_not_the_target():
    h100 = resolve_target("h100")
    bf16 = Plan(default_format=Format.BF16, default_reason="t")
    assert tf32_decision(h100, bf16, None) == (False, "off: not measured (add tf32 to --formats to measure it); "
                                                      "fp32 GEMMs and convolutions stay IEEE fp32")
    assert tf32_decision(h100, bf16, _summary(True))[0]
    on, why = tf32_decision(h100, bf16, _summary(False))
    assert not on and "loss changes by 0.1" in why
    pinned = Plan(default_format=Format.BF16, default_reason="t",
                  overrides={"a": LayerPlan(Format.FP32, "bf16 local error 1e-1 over budget")})
    on, why = tf32_decision(h100, pinned, _summary(True))
    assert not on and "pinned to fp32 for their local error (a)" in why
    assert tf32_decision(h100, Plan(default_format=Format.TF32, default_reason="t"), None)[0]
    assert not tf32_decision(resolve_target("v100"), bf16, _summary(True))[0]


# --- cuda mode (under the fake device, tests/fakecuda.py): the TF32 pass switches TF32 on, forward and backward ---


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("user", ["default", "legacy-medium", "new-conv-ieee"])
def test_the_cuda_tf32_pass_runs_forward_and_backward_with_both_switches_on_and_restores_the_users(user, fake_cuda):
    from precision_audit.capture.runner import CaptureConfig, CaptureSession
    from precision_audit.tf32_switches import restore, snapshot, tf32_enabled

    saved = snapshot()
    try:
        {"default": lambda: None,
         "legacy-medium": lambda: torch.set_float32_matmul_precision("medium"),
         "new-conv-ieee": lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee")}[user]()
        before = snapshot()
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        forward, backward = [], []
        model[0].register_forward_pre_hook(lambda m, a: forward.append(tf32_enabled()))
        model[0].register_full_backward_hook(lambda m, gi, go: backward.append(tf32_enabled()))
        x = torch.randn(4, 8, device="cuda")
        cfg = CaptureConfig(formats=(Format.TF32,), device="cuda", mode="cuda")
        with CaptureSession(model, lambda m: m(x), lambda out: out.float().pow(2).mean(), cfg) as s:
            s.reference_run()
            run = s.format_run(Format.TF32)
        assert run.error is None
        # the reference (forward, its re-run alone in TF32, backward), then the TF32 pass
        assert forward == [(False, False), (True, True), (True, True)]
        assert backward == [(False, False), (True, True)]
        assert snapshot() == before
    finally:
        restore(saved)


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("user", ["legacy-high", "new-tf32"])
def test_cuda_bf16_passes_and_local_reruns_run_under_the_same_tf32_switches(user, fake_cuda):
    """Issue 31 item 7: a local re-run in BF16 ran inside the FP32 reference (TF32 off) while the whole BF16 pass ran
    under the user's switches (here on): what autocast leaves in fp32 was computed two ways. Both strict now, as
    the emulation computes them, forward and backward, with the user's settings back after."""
    from precision_audit.capture.runner import CaptureConfig, CaptureSession
    from precision_audit.tf32_switches import restore, snapshot, tf32_enabled

    saved = snapshot()
    try:
        if user == "legacy-high":
            torch.set_float32_matmul_precision("high")
        else:
            torch.backends.fp32_precision = "tf32"
        before = snapshot()
        assert tf32_enabled() == (True, True)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        forward, backward = [], []
        model[0].register_forward_pre_hook(lambda m, a: forward.append(tf32_enabled()))
        model[0].register_full_backward_hook(lambda m, gi, go: backward.append(tf32_enabled()))
        x = torch.randn(4, 8, device="cuda")
        cfg = CaptureConfig(formats=(Format.BF16,), device="cuda", mode="cuda", timed_steps=1)
        with CaptureSession(model, lambda m: m(x), lambda out: out.float().pow(2).mean(), cfg) as s:
            s.reference_run()
            assert s.format_run(Format.BF16).error is None
            s.timed_steps(1)
        # reference forward, its BF16 re-run, the BF16 pass, then the timed steps (fp32 and bf16, each warm-up + 1)
        assert forward and set(forward) == {(False, False)}, forward
        assert backward and set(backward) == {(False, False)}, backward
        assert snapshot() == before
    finally:
        restore(saved)
