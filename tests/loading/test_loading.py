"""Tests for precision_audit.loading: MODEL and BATCH conventions, their error messages, and loss resolution."""

from __future__ import annotations

import dataclasses
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_audit.errors import BatchError, LossError, ModelLoadError
from precision_audit.loading import (
    Batch,
    LossKind,
    ModelSource,
    load_batch,
    load_model,
    output_structure,
    resolve_loss,
)

HEADER = "import torch\nfrom torch import nn\n\n"

TWO_INPUTS = """
class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x, y):
        return self.a(x) + self.b(y)

def build_model():
    return TwoInputs()
"""

ONE_INPUT = """
def build_model():
    return nn.Linear(4, 3)
"""


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def write(folder: Path, body: str, name: str = "model.py", header: bool = True) -> Path:
    path = folder / name
    path.write_text((HEADER if header else "") + textwrap.dedent(body))
    return path


def save(folder: Path, obj: object, name: str = "batch.pt") -> Path:
    path = folder / name
    torch.save(obj, path)
    return path


def linear_source(tmp_path: Path) -> tuple[nn.Module, ModelSource]:
    return load_model(str(write(tmp_path, ONE_INPUT)))


class Opaque:
    """A custom class: torch.load(weights_only=True) must refuse it."""

    def __init__(self) -> None:
        self.t = torch.ones(2)


# --- MODEL conventions -----------------------------------------------------------------------------------------


def test_build_model_is_called(tmp_path: Path) -> None:
    path = write(tmp_path, "def build_model():\n    return nn.Linear(4, 2)\n")
    model, source = load_model(str(path))
    assert isinstance(model, nn.Linear) and model.out_features == 2
    assert source.attribute == "build_model"
    assert source.path == path.resolve()
    assert source.spec == str(path)
    assert source.module.__name__.startswith("_precision_audit_user_model_")
    assert source.label == "build_model in model.py"


def test_get_model_is_used_without_build_model(tmp_path: Path) -> None:
    path = write(tmp_path, "def get_model():\n    return nn.Linear(4, 5)\n")
    model, source = load_model(str(path))
    assert source.attribute == "get_model" and model.out_features == 5


def test_module_level_model_instance(tmp_path: Path) -> None:
    path = write(tmp_path, "model = nn.Linear(4, 6)\n")
    model, source = load_model(str(path))
    assert source.attribute == "model" and model.out_features == 6
    assert model is source.module.model


def test_build_model_wins_over_get_model_and_model(tmp_path: Path) -> None:
    body = """
    def build_model():
        return nn.Linear(1, 1)
    def get_model():
        return nn.Linear(2, 2)
    model = nn.Linear(3, 3)
    """
    model, source = load_model(str(write(tmp_path, body)))
    assert source.attribute == "build_model" and model.in_features == 1


def test_colon_name_picks_another_factory(tmp_path: Path) -> None:
    body = """
    def build_model():
        return nn.Linear(1, 1)
    def make_big(width=64):
        return nn.Linear(width, width)
    """
    path = write(tmp_path, body)
    model, source = load_model(f"{path}:make_big")
    assert source.attribute == "make_big" and model.in_features == 64
    assert source.spec == f"{path}:make_big"


def test_colon_name_can_be_a_class(tmp_path: Path) -> None:
    body = """
    class Net(nn.Module):
        def __init__(self, width: int = 8):
            super().__init__()
            self.fc = nn.Linear(width, 2)
        def forward(self, x):
            return self.fc(x)
    """
    model, source = load_model(f"{write(tmp_path, body)}:Net")
    assert type(model).__name__ == "Net" and source.attribute == "Net"


def test_package_module_colon_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "pa_test_pkg_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package, "def factory():\n    return nn.Linear(3, 7)\n", name="zoo.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    model, source = load_model("pa_test_pkg_models.zoo:factory")
    assert model.out_features == 7
    assert source.path is None and source.attribute == "factory"
    assert source.module.__name__ == "pa_test_pkg_models.zoo"
    assert source.label == "factory in pa_test_pkg_models.zoo"


def test_file_can_import_its_siblings_and_sys_path_is_restored(tmp_path: Path) -> None:
    write(tmp_path, "def head():\n    return nn.Linear(4, 9)\n", name="pa_sibling_layers.py")
    path = write(tmp_path, "from pa_sibling_layers import head\n\ndef build_model():\n    return head()\n")
    before = list(sys.path)
    model, _ = load_model(str(path))
    assert model.out_features == 9
    assert sys.path == before, "the model's folder must come off sys.path after loading"


def test_dataclasses_in_the_model_file_work(tmp_path: Path) -> None:
    body = """
    from __future__ import annotations
    import dataclasses
    from torch import nn

    @dataclasses.dataclass
    class Config:
        width: int = 5

    def build_model():
        return nn.Linear(Config().width, 1)
    """
    model, _ = load_model(str(write(tmp_path, body, header=False)))
    assert model.in_features == 5


def test_two_files_get_distinct_modules(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, first = load_model(str(write(tmp_path / "a", "model = nn.Linear(1, 1)\n")))
    _, second = load_model(str(write(tmp_path / "b", "model = nn.Linear(2, 2)\n")))
    assert first.module.__name__ != second.module.__name__


# --- MODEL errors ----------------------------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found") as info:
        load_model(str(tmp_path / "nope.py"))
    assert "nope.py" in str(info.value)


def test_directory_is_refused(tmp_path: Path) -> None:
    write(tmp_path, ONE_INPUT)
    with pytest.raises(ModelLoadError, match="directory") as info:
        load_model(str(tmp_path))
    assert "model.py" in str(info.value), "the .py files inside should be offered"


def test_non_python_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save(torch.ones(1), path)
    with pytest.raises(ModelLoadError, match=r"not a \.py file"):
        load_model(str(path))


def test_neither_file_nor_module_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="neither a .py file nor") as info:
        load_model("just_a_word")
    assert "package.module:name" in str(info.value)


def test_bad_name_after_colon(tmp_path: Path) -> None:
    path = write(tmp_path, ONE_INPUT)
    with pytest.raises(ModelLoadError, match="not a Python name"):
        load_model(f"{path}:2bad")


def test_syntax_error_shows_file_line_and_text(tmp_path: Path) -> None:
    path = write(tmp_path, "def build_model(:\n    return nn.Linear(1, 1)\n")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    message = str(info.value)
    assert "model.py" in message and "line 4" in message, message
    assert "def build_model(:" in message
    assert isinstance(info.value.__cause__, SyntaxError)


def test_exception_at_import_shows_type_message_and_line(tmp_path: Path) -> None:
    body = """
    WIDTH = 4
    raise ValueError("bad width configuration")
    """
    path = write(tmp_path, body)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    message = str(info.value)
    assert "ValueError: bad width configuration" in message
    assert "model.py, line 6" in message and 'raise ValueError("bad width configuration")' in message, message
    assert isinstance(info.value.__cause__, ValueError)
    assert not any(
        n.startswith("_precision_audit_user_model_") and getattr(m, "__file__", None) == str(path.resolve())
        for n, m in sys.modules.items()
    ), "a failed import must not stay in sys.modules"


def test_exception_deep_in_torch_points_at_the_users_line(tmp_path: Path) -> None:
    body = """
    def build_model():
        return nn.Linear(4, -3)
    """
    with pytest.raises(ModelLoadError) as info:
        load_model(str(write(tmp_path, body)))
    message = str(info.value)
    assert "calling build_model()" in message and "model.py, line 6" in message, message
    assert "nn.Linear(4, -3)" in message


def test_no_model_found_lists_names_looked_for_and_defined(tmp_path: Path) -> None:
    body = """
    class Net(nn.Module):
        def forward(self, x):
            return x
    def make_net():
        return Net()
    def loss_fn(output, batch):
        return output.sum()
    """
    with pytest.raises(ModelLoadError, match="no model found") as info:
        load_model(str(write(tmp_path, body)))
    message = str(info.value)
    for name in ("build_model", "get_model", "model", "Net", "make_net"):
        assert name in message
    assert "loss_fn" not in message.split("found:")[1], "loss_fn is a role, not a model candidate"
    assert "model.py:Net" in message


def test_unknown_colon_name_lists_available(tmp_path: Path) -> None:
    body = """
    def build_model():
        return nn.Linear(1, 1)
    def make_small():
        return nn.Linear(1, 1)
    """
    path = write(tmp_path, body)
    with pytest.raises(ModelLoadError, match="'make_smal' not found") as info:
        load_model(f"{path}:make_smal")
    message = str(info.value)
    assert "build_model" in message and "make_small" in message
    assert "did you mean 'make_small'" in message


def test_module_not_importable() -> None:
    with pytest.raises(ModelLoadError, match="cannot import module 'pa_no_such_pkg.models'") as info:
        load_model("pa_no_such_pkg.models:factory")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_missing_dependency_in_a_file_is_an_import_failure(tmp_path: Path) -> None:
    path = write(tmp_path, "import pa_definitely_missing_dep\nmodel = nn.Linear(1, 1)\n")
    with pytest.raises(ModelLoadError, match="ModuleNotFoundError") as info:
        load_model(str(path))
    assert "line 4" in str(info.value)


def test_factory_needing_arguments_names_them(tmp_path: Path) -> None:
    body = """
    def build_model(vocab_size, d_model, n_layers=2):
        return nn.Linear(d_model, vocab_size)
    """
    with pytest.raises(ModelLoadError, match="needs arguments") as info:
        load_model(str(write(tmp_path, body)))
    message = str(info.value)
    assert "vocab_size" in message and "d_model" in message and "n_layers" not in message


def test_factory_returning_a_non_module_names_the_type(tmp_path: Path) -> None:
    body = """
    def build_model():
        return (nn.Linear(1, 1), "optimizer")
    """
    with pytest.raises(ModelLoadError, match="did not return an nn.Module") as info:
        load_model(str(write(tmp_path, body)))
    assert "tuple" in str(info.value)


def test_model_attribute_that_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a model") as info:
        load_model(str(write(tmp_path, "model = {'weights': 1}\n")))
    assert "dict" in str(info.value)


# --- BATCH conventions -----------------------------------------------------------------------------------------


def test_tensor_batch(tmp_path: Path) -> None:
    model, source = linear_source(tmp_path)
    x = torch.randn(8, 4)
    batch = load_batch(save(tmp_path, x), model, source)
    assert len(batch.args) == 1 and torch.equal(batch.args[0], x)
    assert batch.kwargs == {} and batch.target is None
    assert batch.source.endswith("batch.pt")
    assert batch.describe() == [{"name": "args[0]", "shape": [8, 4], "dtype": "float32"}]


def test_tuple_of_all_inputs(tmp_path: Path) -> None:
    model, source = load_model(str(write(tmp_path, TWO_INPUTS)))
    batch = load_batch(save(tmp_path, (torch.randn(2, 4), torch.randn(2, 4))), model, source)
    assert len(batch.args) == 2 and batch.target is None
    model(*batch.args, **batch.kwargs)


def test_inputs_then_target(tmp_path: Path) -> None:
    model, source = linear_source(tmp_path)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    batch = load_batch(save(tmp_path, [x, y]), model, source)
    assert len(batch.args) == 1 and torch.equal(batch.target, y)
    assert isinstance(batch.raw, list), "raw is the object exactly as loaded"
    assert batch.describe() == [
        {"name": "args[0]", "shape": [8, 4], "dtype": "float32"},
        {"name": "target", "shape": [8], "dtype": "int64"},
    ]


def test_nested_inputs_then_target(tmp_path: Path) -> None:
    model, source = load_model(str(write(tmp_path, TWO_INPUTS)))
    a, b, y = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 3)
    batch = load_batch(save(tmp_path, ((a, b), y)), model, source)
    assert len(batch.args) == 2 and torch.equal(batch.args[1], b) and torch.equal(batch.target, y)


def test_dict_batch_is_keyword_inputs(tmp_path: Path) -> None:
    model, source = load_model(str(write(tmp_path, TWO_INPUTS)))
    raw = {"x": torch.randn(2, 4), "y": torch.randn(2, 4)}
    batch = load_batch(save(tmp_path, raw), model, source)
    assert batch.args == () and set(batch.kwargs) == {"x", "y"} and batch.target is None
    assert [d["name"] for d in batch.describe()] == ["x", "y"]
    model(*batch.args, **batch.kwargs)


def test_dict_then_target(tmp_path: Path) -> None:
    model, source = load_model(str(write(tmp_path, TWO_INPUTS)))
    raw = ({"x": torch.randn(2, 4), "y": torch.randn(2, 4)}, torch.randn(2, 3))
    batch = load_batch(save(tmp_path, raw), model, source)
    assert set(batch.kwargs) == {"x", "y"} and batch.target.shape == (2, 3)


def test_dict_batch_with_non_tensor_values_and_var_kwargs(tmp_path: Path) -> None:
    body = """
    class HF(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)
        def forward(self, input_ids=None, return_dict=True, **kwargs):
            return {"logits": self.fc(input_ids)}
    model = HF()
    """
    model, source = load_model(str(write(tmp_path, body)))
    batch = load_batch(save(tmp_path, {"input_ids": torch.randn(1, 4), "return_dict": True}), model, source)
    assert batch.kwargs["return_dict"] is True
    assert [d["name"] for d in batch.describe()] == ["input_ids"]


def test_forward_with_var_args_takes_everything(tmp_path: Path) -> None:
    body = """
    class Any(nn.Module):
        def forward(self, *xs):
            return sum(xs)
    model = Any()
    """
    model, source = load_model(str(write(tmp_path, body)))
    batch = load_batch(save(tmp_path, (torch.ones(2), torch.ones(2), torch.ones(2))), model, source)
    assert len(batch.args) == 3 and batch.target is None


def test_sample_batch_is_used_without_a_path(tmp_path: Path) -> None:
    body = ONE_INPUT + "\ndef sample_batch():\n    return torch.ones(2, 4), torch.zeros(2, dtype=torch.long)\n"
    model, source = load_model(str(write(tmp_path, body)))
    batch = load_batch(None, model, source)
    assert batch.source == "sample_batch() in model.py"
    assert batch.target is not None and batch.target.dtype == torch.long


def test_batch_to_moves_every_tensor_and_keeps_sharing(tmp_path: Path) -> None:
    model, source = linear_source(tmp_path)
    batch = load_batch(save(tmp_path, (torch.randn(2, 4), torch.randint(0, 3, (2,)))), model, source)
    moved = batch.to("meta")
    assert moved.args[0].device.type == "meta" and moved.target.device.type == "meta"
    assert all(t.device.type == "meta" for t in moved.raw)
    assert moved.raw[0] is moved.args[0] and moved.raw[1] is moved.target
    assert batch.args[0].device.type == "cpu", "to() returns a copy"
    assert isinstance(moved.raw, tuple) and moved.source == batch.source


# --- BATCH errors ----------------------------------------------------------------------------------------------


def test_batch_required_without_sample_batch(tmp_path: Path) -> None:
    model, source = linear_source(tmp_path)
    with pytest.raises(BatchError, match="--batch is required"):
        load_batch(None, model, source)


def test_missing_batch_file(tmp_path: Path) -> None:
    model, source = linear_source(tmp_path)
    with pytest.raises(BatchError, match="not found") as info:
        load_batch(tmp_path / "missing.pt", model, source)
    assert "missing.pt" in str(info.value)


def test_batch_directory(tmp_path: Path) -> None:
    model, source = linear_source(tmp_path)
    with pytest.raises(BatchError, match="directory"):
        load_batch(tmp_path, model, source)


@pytest.mark.parametrize(
    ("content", "kind"),
    [
        (b"x,y\n1,2\n", "a text file"),
        (bytes(range(256)) * 4, "binary data"),
        (b"", "an empty file"),
        (b"PK\x03\x04truncated", "zip archive"),
    ],
    ids=["text", "random-bytes", "empty", "truncated-zip"],
)
def test_not_a_torch_file(tmp_path: Path, content: bytes, kind: str) -> None:
    model, source = linear_source(tmp_path)
    path = tmp_path / "batch.pt"
    path.write_bytes(content)
    with pytest.raises(BatchError, match="not a torch.save file") as info:
        load_batch(path, model, source)
    assert kind in str(info.value)


def test_random_bytes_from_urandom(tmp_path: Path) -> None:
    model, source = linear_source(tmp_path)
    path = tmp_path / "noise.pt"
    path.write_bytes(os.urandom(300))
    with pytest.raises(BatchError, match="not a torch.save file"):
        load_batch(path, model, source)


def test_custom_objects_are_refused_with_the_class_name(tmp_path: Path) -> None:
    model, source = linear_source(tmp_path)
    path = save(tmp_path, (torch.ones(2, 4), Opaque()))
    with pytest.raises(BatchError) as info:
        load_batch(path, model, source)
    message = str(info.value)
    assert "weights_only" in message and "Opaque" in message
    assert "other than tensors" in message and "never unpickles" in message
    assert info.value.__cause__ is not None


@pytest.mark.parametrize("raw", [(), {}, torch.empty(0, 4)], ids=["tuple", "dict", "zero-element-tensor"])
def test_empty_batch(tmp_path: Path, raw: object) -> None:
    model, source = linear_source(tmp_path)
    with pytest.raises(BatchError, match="empty"):
        load_batch(save(tmp_path, raw), model, source)


def test_non_finite_values_name_the_element_and_count(tmp_path: Path) -> None:
    model, source = load_model(str(write(tmp_path, TWO_INPUTS)))
    a = torch.randn(2, 4)
    b = torch.randn(2, 4)
    b[0, 0] = float("nan")
    b[1, 1] = float("nan")
    b[1, 2] = float("inf")
    with pytest.raises(BatchError, match="non-finite") as info:
        load_batch(save(tmp_path, (a, b)), model, source)
    message = str(info.value)
    assert "args[1]: 2 NaN, 1 Inf" in message and "args[0]" not in message


def test_batch_without_tensors(tmp_path: Path) -> None:
    model, source = linear_source(tmp_path)
    with pytest.raises(BatchError, match="holds no tensor"):
        load_batch(save(tmp_path, [1, 2]), model, source)
    with pytest.raises(BatchError, match="holds no tensor"):
        load_batch(save(tmp_path, "x"), model, source)


def test_tuple_too_long_for_forward(tmp_path: Path) -> None:
    model, source = load_model(str(write(tmp_path, TWO_INPUTS)))
    raw = tuple(torch.ones(2, 4) for _ in range(4))
    with pytest.raises(BatchError, match="takes 2 positional inputs") as info:
        load_batch(save(tmp_path, raw), model, source)
    assert "holds 4 elements" in str(info.value)


def test_dict_keys_the_forward_does_not_take(tmp_path: Path) -> None:
    model, source = load_model(str(write(tmp_path, TWO_INPUTS)))
    with pytest.raises(BatchError, match="does not take: z") as info:
        load_batch(save(tmp_path, {"x": torch.ones(1, 4), "z": torch.ones(1, 4)}), model, source)
    assert "valid choices: x, y" in str(info.value)


def test_single_tensor_for_a_two_input_forward(tmp_path: Path) -> None:
    model, source = load_model(str(write(tmp_path, TWO_INPUTS)))
    with pytest.raises(BatchError, match="single tensor"):
        load_batch(save(tmp_path, torch.ones(2, 4)), model, source)


# --- loss resolution -------------------------------------------------------------------------------------------


def _batch(args: tuple = (), target: object = None, kwargs: dict | None = None, raw: object = None) -> Batch:
    return Batch(args=args, kwargs=kwargs or {}, target=target, raw=raw if raw is not None else args, source="test")


def test_loss_fn_from_the_model_file(tmp_path: Path) -> None:
    body = ONE_INPUT + "\ndef loss_fn(output, batch):\n    x, y = batch\n    return (output - y).abs().mean()\n"
    model, source = load_model(str(write(tmp_path, body)))
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    batch = load_batch(save(tmp_path, (x, y)), model, source)
    output = model(*batch.args)
    spec = resolve_loss(source, output, batch)
    assert spec.kind == "loss_fn" and spec.kind is LossKind.LOSS_FN
    assert spec.description == "loss_fn(output, batch) defined in model.py"
    loss = spec(output, batch)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, (output - y).abs().mean())


@pytest.mark.parametrize(
    ("returned", "found"),
    [("output.abs()", "shape [8, 3]"), ("output.sum().item()", "float"), ("None", "NoneType")],
    ids=["non-scalar", "python-float", "none"],
)
def test_loss_fn_must_return_a_scalar_tensor(tmp_path: Path, returned: str, found: str) -> None:
    body = ONE_INPUT + f"\ndef loss_fn(output, batch):\n    return {returned}\n"
    model, source = load_model(str(write(tmp_path, body)))
    batch = _batch((torch.randn(8, 4),))
    with pytest.raises(LossError, match="scalar floating tensor") as info:
        resolve_loss(source, model(*batch.args), batch)
    assert found in str(info.value)


def test_loss_fn_raising_points_at_its_line(tmp_path: Path) -> None:
    body = ONE_INPUT + "\ndef loss_fn(output, batch):\n    return output[batch['missing']]\n"
    model, source = load_model(str(write(tmp_path, body)))
    batch = _batch((torch.randn(8, 4),))
    with pytest.raises(LossError, match="raised TypeError") as info:
        resolve_loss(source, model(*batch.args), batch)
    assert "model.py, line 9" in str(info.value)


def test_output_loss_from_a_mapping_and_an_attribute(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    batch = _batch((torch.randn(2, 4),))
    mapping = {"logits": torch.randn(2, 3), "loss": torch.tensor(1.5, dtype=torch.bfloat16)}
    spec = resolve_loss(source, mapping, batch)
    assert spec.kind == "output.loss"
    loss = spec(mapping, batch)
    assert loss.dtype == torch.float32 and loss.item() == 1.5

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        loss: torch.Tensor

    obj = Out(torch.randn(2, 3), torch.tensor(0.25))
    assert resolve_loss(source, obj, batch).kind == LossKind.OUTPUT_LOSS
    assert resolve_loss(source, obj, batch)(obj, batch).item() == 0.25


def test_output_loss_none_falls_through(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    output = {"logits": torch.randn(2, 3), "loss": None}
    spec = resolve_loss(source, output, _batch((torch.randn(2, 4),)))
    assert spec.kind == "surrogate"


def test_a_tuples_one_scalar_is_the_models_own_loss(tmp_path: Path) -> None:
    """nanoGPT's ``return logits, loss``: the loss is output[1], not a surrogate over the logits and the loss.
    Two scalars would be a guess (a surrogate then); a target still comes first."""
    _, source = linear_source(tmp_path)
    batch = _batch((torch.randn(2, 4),))
    logits, loss = torch.randn(2, 3), torch.tensor(2.5)
    spec = resolve_loss(source, (logits, loss), batch)
    assert spec.kind == LossKind.OUTPUT_LOSS and "output[1]" in spec.description
    assert spec((logits, loss), batch).item() == 2.5
    assert resolve_loss(source, [loss, logits], batch)([loss, logits], batch).item() == 2.5
    with pytest.raises(LossError, match="no longer has its one scalar"):
        spec((logits, loss, torch.tensor(1.0)), batch)
    assert resolve_loss(source, (logits, loss, torch.tensor(1.0)), batch).kind == "surrogate"
    assert resolve_loss(source, (logits,), batch).kind == "surrogate"
    target = _batch((torch.randn(2, 4),), torch.randint(0, 3, (2,)))
    assert resolve_loss(source, (logits, loss), target).kind == "cross_entropy"  # the target, as before


def test_cross_entropy_for_class_indices(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    logits, target = torch.randn(32, 10), torch.randint(0, 10, (32,))
    batch = _batch((torch.randn(32, 4),), target)
    spec = resolve_loss(source, logits, batch)
    assert spec.kind == "cross_entropy"
    assert spec.description.startswith("cross-entropy inferred from an integer target of shape [32]")
    torch.testing.assert_close(spec(logits, batch), F.cross_entropy(logits, target))


def test_cross_entropy_for_sequence_logits(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    logits, target = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    target[0, 0] = -100  # Hugging Face padding label, ignored
    batch = _batch((torch.randn(2, 4),), target)
    spec = resolve_loss(source, logits, batch)
    assert spec.kind == "cross_entropy" and "last dimension" in spec.description
    expected = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1))
    torch.testing.assert_close(spec(logits, batch), expected)


def test_cross_entropy_for_segmentation(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    logits, target = torch.randn(2, 4, 6, 7), torch.randint(0, 4, (2, 6, 7))
    batch = _batch((torch.randn(2, 4),), target)
    spec = resolve_loss(source, logits, batch)
    assert spec.kind == "cross_entropy" and "dim 1" in spec.description
    torch.testing.assert_close(spec(logits, batch), F.cross_entropy(logits, target))


def test_cross_entropy_uses_hugging_face_logits(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    output = {"logits": torch.randn(4, 3), "hidden": torch.randn(4, 8)}
    target = torch.tensor([0, 2, 1, 1])
    batch = _batch((torch.randn(4, 4),), target)
    spec = resolve_loss(source, output, batch)
    assert spec.kind == "cross_entropy" and "output['logits']" in spec.description
    torch.testing.assert_close(spec(output, batch), F.cross_entropy(output["logits"], target))


def test_cross_entropy_on_low_precision_logits_returns_float32(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    logits, target = torch.randn(8, 5).bfloat16(), torch.randint(0, 5, (8,))
    batch = _batch((torch.randn(8, 4),), target)
    loss = resolve_loss(source, logits, batch)(logits, batch)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits, target).float())


def test_out_of_range_class_indices_fall_back_to_the_surrogate(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    logits, target = torch.randn(4, 3), torch.tensor([0, 1, 2, 7])
    spec = resolve_loss(source, logits, _batch((torch.randn(4, 4),), target))
    assert spec.kind == "surrogate" and "0..7" in spec.description


def test_mse_for_a_floating_target_of_the_output_shape(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    output, target = torch.randn(16, 3), torch.randn(16, 3)
    batch = _batch((torch.randn(16, 4),), target)
    spec = resolve_loss(source, output, batch)
    assert spec.kind == "mse" and "[16, 3]" in spec.description
    torch.testing.assert_close(spec(output, batch), F.mse_loss(output, target))


def test_floating_target_of_another_shape_falls_back_to_the_surrogate(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    spec = resolve_loss(source, torch.randn(4, 3), _batch((torch.randn(4, 4),), torch.randn(4)))
    assert spec.kind == "surrogate" and "shape" in spec.description


def test_surrogate_matches_the_formula_and_is_deterministic(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    output = (torch.randn(4, 3), {"hidden": torch.randn(2, 5), "ids": torch.arange(3)})
    batch = _batch((torch.randn(4, 4),))
    first = resolve_loss(source, output, batch)
    torch.manual_seed(999)  # the global RNG must not matter
    second = resolve_loss(source, output, batch)
    assert first.kind == "surrogate"
    assert first.description.startswith(
        "surrogate: mean of <y, r> over the floating outputs with a fixed random r (no target and no loss defined"
    )
    expected = torch.zeros(())
    for y in (output[0], output[1]["hidden"]):
        r = torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
        expected = expected + (y * r).sum() / y.numel()
    torch.testing.assert_close(first(output, batch), expected)
    assert torch.equal(first(output, batch), second(output, batch))
    assert torch.equal(first(output, batch), first(output, batch))


def test_surrogate_upcasts_and_gives_gradients(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    y = torch.randn(3, 4, dtype=torch.float16, requires_grad=True)
    batch = _batch((torch.randn(3, 4),))
    loss = resolve_loss(source, y, batch)(y, batch)
    assert loss.dtype == torch.float32
    loss.backward()
    r = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(y.grad.float(), (r / 12).half().float())


def test_output_without_floating_tensors_is_a_loss_error(tmp_path: Path) -> None:
    _, source = linear_source(tmp_path)
    with pytest.raises(LossError, match="no floating-point tensor") as info:
        resolve_loss(source, (torch.arange(3), None), _batch((torch.randn(3, 4),)))
    assert "tuple(Tensor[3], None)" in str(info.value)


def test_loss_spec_kind_accepts_strings_and_rejects_unknown() -> None:
    assert str(LossKind.CROSS_ENTROPY) == "cross_entropy"
    with pytest.raises(ValueError):
        from precision_audit.loading import LossSpec

        LossSpec("hinge", "?", lambda output, batch: torch.zeros(()))


# --- output_structure ------------------------------------------------------------------------------------------


def test_output_structure() -> None:
    assert output_structure(torch.zeros(4, 32, 257)) == "Tensor[4,32,257]"
    assert (
        output_structure({"logits": torch.zeros(2, 3), "loss": torch.tensor(1.0)})
        == "dict(logits: Tensor[2,3], loss: Tensor[])"
    )
    kv = tuple((torch.zeros(1, 2), torch.zeros(1, 2)) for _ in range(24))
    assert output_structure((torch.zeros(5), kv)) == "tuple(Tensor[5], tuple(24 x tuple(2 x Tensor[1,2])))"
    assert output_structure([None, 3]) == "list(None, int)"
    assert output_structure(torch.zeros(2)) != output_structure(torch.zeros(3))
    assert output_structure(torch.zeros(2)) == output_structure(torch.zeros(2, dtype=torch.bfloat16))
