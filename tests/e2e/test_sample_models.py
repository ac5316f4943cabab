"""Checks on the sample models in sample_models/ (plain torch, FP32; no precision_audit code)."""
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # the repository
SAMPLES = ROOT / "sample_models"
NAMES = ["mlp", "cnn", "tiny_gpt", "fp16_trouble"]
FP16_TINY = 2.0 ** -24  # smallest FP16 subnormal


def load_sample(name):
    path = SAMPLES / name / "model.py"
    spec = importlib.util.spec_from_file_location(f"_sample_model_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def default_loss(output, batch):
    """What the tool infers when model.py defines no loss_fn: (inputs, target) with an integer
    target -> cross-entropy; a float target of the output's shape -> MSE."""
    target = batch[-1]
    if target.dtype == torch.int64:
        return F.cross_entropy(output, target)
    assert target.shape == output.shape
    return F.mse_loss(output, target)


def run_fp32(module, model, batch):
    output = model(*batch[:-1])
    loss_fn = getattr(module, "loss_fn", None)
    loss = loss_fn(output, batch) if loss_fn is not None else default_loss(output, batch)
    return output, loss


@pytest.mark.parametrize("name", NAMES)
def test_files_present_and_small(name):
    folder = SAMPLES / name
    for f in ("model.py", "make_batch.py", "sample.pt"):
        assert (folder / f).is_file(), f
    assert (folder / "sample.pt").stat().st_size < 64 * 1024
    module = load_sample(name)
    assert module.__doc__ and len(module.__doc__.strip()) > 50
    source = (folder / "model.py").read_text()
    for line in source.splitlines():
        s = line.strip()
        if s.startswith(("import ", "from ")):
            top = s.split()[1].split(".")[0]
            assert top in {"torch", "math", "dataclasses", "__future__"}, s


@pytest.mark.parametrize("name", NAMES)
def test_build_is_deterministic(name):
    module = load_sample(name)
    a, b = module.build_model(), module.build_model()
    assert isinstance(a, nn.Module)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("name", NAMES)
def test_sample_pt_matches_sample_batch(name):
    module = load_sample(name)
    loaded = torch.load(SAMPLES / name / "sample.pt", weights_only=True)
    assert_same(loaded, module.sample_batch())
    assert_same(module.sample_batch(), module.sample_batch())


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_fp32(name):
    module = load_sample(name)
    model = module.build_model()
    batch = torch.load(SAMPLES / name / "sample.pt", weights_only=True)
    output, loss = run_fp32(module, model, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


def test_mlp_dims_aligned():
    module = load_sample("mlp")
    model = module.build_model()
    inputs, target = module.sample_batch()
    assert inputs.shape == (32, 64) and inputs.dtype == torch.float32
    assert target.shape == (32,) and target.dtype == torch.int64
    assert not hasattr(module, "loss_fn")
    assert any(isinstance(m, nn.ReLU) for m in model.modules())
    assert any(isinstance(m, nn.GELU) for m in model.modules())
    for m in model.modules():
        if isinstance(m, nn.Linear):
            assert m.in_features % 8 == 0 and m.out_features % 8 == 0, m


def test_cnn_structure():
    module = load_sample("cnn")
    model = module.build_model()
    images, labels = module.sample_batch()
    assert images.shape == (8, 3, 16, 16) and labels.shape == (8,)
    assert labels.dtype == torch.int64
    assert not hasattr(module, "loss_fn")
    kinds = {type(m) for m in model.modules()}
    for k in (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d, nn.AdaptiveAvgPool2d, nn.Linear):
        assert k in kinds, k
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 2


def test_tiny_gpt_structure():
    module = load_sample("tiny_gpt")
    for cls in ("Block", "CausalSelfAttention", "MLP", "TinyGPT", "GPTConfig"):
        assert hasattr(module, cls), cls
    model = module.build_model()
    assert isinstance(model, module.TinyGPT)
    idx, targets = module.sample_batch()
    assert idx.shape == targets.shape == (4, 32)
    assert idx.dtype == targets.dtype == torch.int64
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    logits = model(idx)
    assert logits.shape == (4, 32, 257)
    assert model.lm_head.out_features == 257 and 257 % 8 != 0
    assert model.lm_head.bias is None
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()  # not tied
    assert [b.attn.use_sdpa for b in model.blocks] == [False, True]
    assert callable(module.loss_fn)


def test_tiny_gpt_attention_paths_agree():
    module = load_sample("tiny_gpt")
    explicit = module.build_model(attn_impl="explicit")
    sdpa = module.build_model(attn_impl="sdpa")
    idx, _ = module.sample_batch()
    torch.testing.assert_close(explicit(idx), sdpa(idx), rtol=1e-4, atol=1e-5)


def test_tiny_gpt_overrides():
    module = load_sample("tiny_gpt")
    model = module.build_model(n_layer=4, d_model=32, n_head=2)
    assert len(model.blocks) == 4
    assert [b.attn.use_sdpa for b in model.blocks] == [False, True, False, True]
    idx, targets = module.sample_batch()
    out = model(idx)
    assert out.shape == (4, 32, 257)
    assert torch.isfinite(module.loss_fn(out, (idx, targets)))


def _fp16_trouble_fp32_run():
    module = load_sample("fp16_trouble")
    model = module.build_model()
    batch = torch.load(SAMPLES / "fp16_trouble" / "sample.pt", weights_only=True)
    inputs, targets = batch
    assert inputs.shape == (16, 32) and targets.shape == (16, 8)
    assert inputs.dtype == targets.dtype == torch.float32
    outs = {}

    def hook(name):
        def f(mod, inp, out):
            out.retain_grad()
            outs[name] = out
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    output, loss = run_fp32(module, model, batch)
    assert output.shape == targets.shape
    loss.backward()
    for h in handles:
        h.remove()
    return model, outs, loss


def test_fp16_trouble_hot_overflows_fp16_only():
    model, outs, loss = _fp16_trouble_fp32_run()
    assert torch.isfinite(loss)
    hot_max = outs["hot"].abs().max().item()
    assert 1e5 < hot_max < 1e6, hot_max
    assert hot_max > torch.finfo(torch.float16).max
    assert hot_max < torch.finfo(torch.bfloat16).max / 1e30
    assert model.hot.weight.abs().max().item() < torch.finfo(torch.float16).max
    assert outs["norm"].abs().max().item() < 10  # the LayerNorm brings it back to O(1)
    assert not torch.isfinite(outs["hot"].half()).all()  # stored in FP16 -> inf
    assert torch.isfinite(outs["hot"].bfloat16()).all()


def test_fp16_trouble_faint_gradients_underflow_unscaled():
    model, outs, _ = _fp16_trouble_fp32_run()
    g = outs["faint"].grad.abs()
    median = g[g > 0].median().item()
    assert FP16_TINY / 2 ** 14 < median < FP16_TINY, median
    assert median * 2 ** 12 > FP16_TINY  # a loss scale of 2^12 lifts it above 2^-24
    for n, p in model.faint.named_parameters():
        assert p.grad.abs().median().item() < FP16_TINY, n
    grads = [p.grad.abs().max().item() for p in model.parameters()]
    grads += [o.grad.abs().max().item() for o in outs.values() if o.grad is not None]
    assert max(grads) < 16, max(grads)
    assert max(grads) * 2 ** 12 < torch.finfo(torch.float16).max
