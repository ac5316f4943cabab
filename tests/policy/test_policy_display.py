"""``result.policy`` in a REPL or a notebook (issue 35): a one-line ``repr`` instead of the dataclass's every field
(fingerprint, 300-entry layout, ...), and ``_repr_html_`` with every override's format and reason, escaped."""

from __future__ import annotations

from precision_audit.policy.schema import LossScaling, ModuleOverride, Policy


def _policy(**kw) -> Policy:
    base = dict(model_class="GPT2LMHeadModel", model_fingerprint="sha256:" + "ab" * 32, model_modules=301,
                target_name="H100 SXM", target_compute_capability=(9, 0), default_format="bf16", model_layout=None)
    base.update(kw)
    return Policy(**base)  # type: ignore[arg-type]


def test_repr_is_one_short_line_naming_the_decision():
    p = _policy(modules={f"h.{i}.mlp": ModuleOverride("fp32", "overflows fp16") for i in range(5)},
                loss_scaling=LossScaling(enabled=True, init_scale=131072.0))
    text = repr(p)
    assert "\n" not in text and len(text) < 200, text
    assert text == ("Policy(GPT2LMHeadModel on H100 SXM: bf16 by default, 5 overrides (fp32: h.0.mlp, h.1.mlp, h.2.mlp "
                    "and 2 more), loss scale 2^17, TF32 off)")
    assert "fingerprint" not in text
    assert repr(_policy()) == "Policy(GPT2LMHeadModel on H100 SXM: bf16 by default, no overrides, no loss scaling, " \
                              "TF32 off)"


def test_repr_html_lists_every_override_and_fp8_module_escaped():
    p = _policy(modules={"<script>x</script>": ModuleOverride("fp32", "a & b")},
                extra={"fp8": {"modules": {"fc": {"recipe": "fp8_tensorwise", "reason": "fast"},
                                           "kept": {"recipe": None, "reason": "kept"}}}})
    html = p._repr_html_()
    assert "<script>" not in html and "&lt;script&gt;x&lt;/script&gt;" in html and "a &amp; b" in html
    assert "fp8_tensorwise (FP8)" in html and "<code>fc</code>" in html and "<code>kept</code>" not in html
    assert repr(p).endswith(", 1 module(s) in FP8)")
