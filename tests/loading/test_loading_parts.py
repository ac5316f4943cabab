"""The parts of precision_audit/loading/ that tests/loading/test_loading.py does not reach through load_model /
load_batch / resolve_loss: the package's re-exports, how a failure in a package module (no user file) is told,
the sys.exit() error, and the nested-value walkers."""

from __future__ import annotations

import collections
import dataclasses
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

import precision_audit.loading as loading
from precision_audit.errors import ModelLoadError, ModelRunError
from precision_audit.loading import batch, failures, loss, model, nested

# --- the package keeps the old module's names ------------------------------------------------------------------


def test_every_public_name_of_the_parts_imports_from_the_package():
    for part in (model, batch, loss, failures, nested):
        for name in part.__all__:
            if name in loading.__all__:
                assert getattr(loading, name) is getattr(part, name), f"loading.{name} is {part.__name__}.{name}"
    assert set(loading.__all__) == {
        "DEFAULT_MODEL_NAMES", "Batch", "LossKind", "LossSpec", "ModelSource", "check_trainable", "load_batch",
        "load_model", "model_exit_error", "output_structure", "resolve_loss"}, "the names of the old loading.py"
    assert loading._interpret is batch._interpret, "precision_audit.api splits in-memory batches with it"


# --- failures: a package module has no user file ---------------------------------------------------------------


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A package ``pa_parts_pkg`` on sys.path; ``write(name, source)`` adds a module to it."""
    root = tmp_path / "pa_parts_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> None:
        (root / f"{name}.py").write_text(source)

    yield write
    for name in [n for n in sys.modules if n.startswith("pa_parts_pkg")]:
        del sys.modules[name]


def test_a_factory_raising_in_a_package_module_names_its_line_not_the_loader(package):
    package("zoo", "from torch import nn\n\ndef factory():\n    return nn.Linear(3, -1)\n")
    with pytest.raises(ModelLoadError) as info:
        model.load_model("pa_parts_pkg.zoo:factory")
    assert info.value.found == "zoo.py, line 4: return nn.Linear(3, -1)"


def test_an_import_failure_in_a_package_module_names_its_line(package):
    package("broken", "x = 1\nraise ValueError('no config')\n")
    with pytest.raises(ModelLoadError) as info:
        model.load_model("pa_parts_pkg.broken:build_model")
    assert info.value.found == "broken.py, line 2: raise ValueError('no config')"
    assert "ValueError: no config" in info.value.problem


def test_raise_site_skips_frames_of_the_loading_package():
    try:
        model.load_model("x:1bad")  # raised inside loading/model.py, called from this line
    except ModelLoadError as e:
        site = failures.raise_site(e, None)
    assert site is not None and site.startswith("test_loading_parts.py, line "), "never the loader's own frame"
    assert site.endswith('model.load_model("x:1bad")  # raised inside loading/model.py, called from this line')


def test_model_exit_error_names_the_sys_exit_call():
    def forward():
        sys.exit(4)

    try:
        forward()
    except SystemExit as e:
        err = failures.model_exit_error(e, "model.py")
    assert isinstance(err, ModelRunError) and err.exit_code == 2
    assert "sys.exit(4)" in err.problem and err.hint == failures.EXIT_HINT
    assert err.found is not None and err.found.startswith("test_loading_parts.py, line ") and "sys.exit(4)" in err.found
    assert err.expected == "the code of MODEL model.py to return or raise"


@pytest.mark.parametrize("value, text", [
    (3, "a int"), (None, "a NoneType"), (torch.zeros(1), "a torch.Tensor"), (Path("x"), "a pathlib.PosixPath"),
], ids=["int", "none", "tensor", "path"])
def test_type_name(value, text):
    if isinstance(value, Path) and sys.platform == "win32":  # pragma: no cover
        pytest.skip("WindowsPath")
    assert failures.type_name(value) == text


def test_exception_text():
    assert failures.exception_text(ValueError("bad")) == "ValueError: bad"
    assert failures.exception_text(KeyboardInterrupt()) == "KeyboardInterrupt"


# --- nested values ---------------------------------------------------------------------------------------------


Pair = collections.namedtuple("Pair", "a b")


class FrozenMapping(Mapping):
    """A Mapping that cannot be built from a dict: map_tensors falls back to a plain dict."""

    def __init__(self, items: dict, *, tag: str) -> None:
        self._items, self.tag = items, tag

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_map_tensors_rebuilds_containers_and_moves_a_shared_tensor_once():
    shared = torch.ones(2)
    value = {"p": Pair(shared, [shared, 3]), "f": FrozenMapping({"x": shared}, tag="t"), "s": "text"}
    memo: dict[int, torch.Tensor] = {}
    moved = nested.map_tensors(value, torch.device("meta"), memo)
    assert type(moved["p"]) is Pair and type(moved["p"].b) is list and moved["p"].b[1] == 3
    assert moved["p"].a.is_meta and moved["p"].a is moved["p"].b[0] is moved["f"]["x"], "moved once, still shared"
    assert type(moved["f"]) is dict, "a Mapping that takes no dict comes back as a dict"
    assert moved["s"] == "text" and len(memo) == 1
    assert not shared.is_meta, "the original is left alone"


def test_named_tensors_names_by_path():
    value = {"x": (torch.zeros(1), [torch.zeros(2)]), "n": 3}
    assert [name for name, _ in nested.named_tensors(value, "batch")] == ["batch['x'][0]", "batch['x'][1][0]"]


def test_floating_leaves_walks_dataclasses_and_skips_integer_tensors():
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        ids: torch.Tensor
        extra: tuple

    out = Out(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), (torch.zeros(1, dtype=torch.float16),))
    assert [name for name, _ in nested.floating_leaves(out, "output")] == ["output.logits", "output.extra[0]"]


def test_dtype_name():
    assert nested.dtype_name(torch.bfloat16) == "bfloat16" and nested.dtype_name(torch.int64) == "int64"


def test_output_structure_collapses_runs_and_names_types():
    cache = tuple((torch.zeros(1, 2), torch.zeros(1, 2)) for _ in range(24))
    text = nested.output_structure({"logits": torch.zeros(2, 5), "past": cache, "aux": None,
                                    "ns": types.SimpleNamespace()})
    assert text == ("dict(logits: Tensor[2,5], past: tuple(24 x tuple(2 x Tensor[1,2])), aux: None, "
                    "ns: SimpleNamespace)")


def test_frozen_low_precision_parameters_beside_float32_trained_ones_are_accepted(tmp_path):
    """The boundary of the low-precision refusal: a frozen bf16 base under float32 adapters is the model as trained
    (its reference runs the base in bf16, as training does); only a model that trains no float32 parameter has no
    FP32 pass and is refused."""
    from precision_audit.loading import check_trainable, load_model

    src = tmp_path / "adapters.py"
    src.write_text(
        "import torch\n"
        "def build_model():\n"
        "    base = torch.nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)\n"
        "    return torch.nn.ModuleDict({'base': base, 'adapter': torch.nn.Linear(8, 8)})\n")
    check_trainable(*load_model(str(src)))  # accepted
    model, source = load_model(str(src))
    model["adapter"].to(torch.float16)
    with pytest.raises(ModelLoadError, match="trains float16 parameters only"):
        check_trainable(model, source)
