"""Shared fixtures: fixed seeds, the repository root, and audits of the sample models run once per session."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ("mlp", "cnn", "tiny_gpt", "fp16_trouble")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _tf32_switches():
    """The process's TF32 switches as every test found them: the exported snippets (tests/policy/test_exporters.py)
    set them, as they must in a user's training script, and a test that reads the defaults after them (tests/capture/
    test_tf32.py) read conv TF32 off. Tests of the tool's own restoring assert inside their body."""
    from precision_audit.tf32_switches import restore, snapshot

    saved = snapshot()
    yield
    restore(saved)


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory):
    """An empty compiled-kernel cache and no automatic build, so that a developer's built kernels never change
    which kernels the tests use and no test pays for a compile it does not test: tests run the Python kernels
    and statistics unless they ask for ``built_kernels`` (tests/emulation/test_compiled_kernels.py,
    test_fused_stats.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PRECISION_AUDIT_KERNEL_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
        mp.setenv("PRECISION_AUDIT_AUTO_BUILD", "0")
        # report.html's compiled template (precision_audit/report/template_cache.py): the session's own cache,
        # not the developer's ~/.cache
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture(scope="session")
def built_kernels(tmp_path_factory):
    """The compiled library, built once per test session by the automatic build of ``--kernels auto`` (into its
    own cache; about 20-40 s). Yields (cache folder, the build's log messages). A test that uses it loads it with
    PRECISION_AUDIT_KERNEL_DIR set to that folder (tests/emulation/test_compiled_kernels.py, ``kernel_dir``); a library
    path loaded twice in one process is the same library, never a second registration."""
    import logging

    from precision_audit.emulation import compiled

    d = tmp_path_factory.mktemp("kernels")
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    logger = logging.getLogger(compiled.__name__)
    logger.addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PRECISION_AUDIT_KERNEL_DIR", str(d))
            mp.setenv("PRECISION_AUDIT_AUTO_BUILD", "1")
            kind = compiled.resolve("auto")
    finally:
        logger.removeHandler(handler)
    if kind != "compiled":
        pytest.skip(f"the compiled kernels cannot be built here: {messages[-1] if messages else '?'}")
    compiled._loaded = None  # loaded again, from the same path, by the tests that ask for it
    yield d, messages


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


class SampleAudits:
    """Runs `run_audit` on a sample model once per (sample, options) and caches the result."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._cache: dict[tuple, tuple] = {}

    def get(self, name: str, **options):
        from precision_audit.audit import AuditOptions, run_audit

        key = (name, tuple(sorted(options.items())))
        if key not in self._cache:
            out = self.base / f"{name}-{len(self._cache)}"
            opts = AuditOptions(model=str(ROOT / "sample_models" / name / "model.py"),
                                batch=str(ROOT / "sample_models" / name / "sample.pt"), out=out, **options)
            t0 = time.perf_counter()
            result = run_audit(opts)
            elapsed = time.perf_counter() - t0
            self._cache[key] = (result, out, elapsed)
        return self._cache[key]

    def audit_json(self, name: str, **options) -> dict:
        _, out, _ = self.get(name, **options)
        return json.loads((out / "audit.json").read_text())


@pytest.fixture(scope="session")
def sample_audits(tmp_path_factory) -> SampleAudits:
    return SampleAudits(tmp_path_factory.mktemp("sample-audits"))


def layer(audit: dict, name: str) -> dict:
    for L in audit["layers"]:
        if L["name"] == name:
            return L
    raise KeyError(f"no layer {name!r} in audit.json; have {[L['name'] for L in audit['layers']]}")
