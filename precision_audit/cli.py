"""Command line: ``precision-audit MODEL --batch BATCH [options]`` and ``precision-audit targets``.

Exit codes: 0 done; 1 done, but the model is unsafe as is in every audited low-precision format;
2 a user error (message only, no traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

from . import __version__
from .errors import AuditError, OptionError

EPILOG = """\
MODEL is a .py file defining build_model(), get_model() or a module-level `model` (model.py:name picks
another), or an importable package.module:name. The file may define loss_fn(output, batch) and
sample_batch(). BATCH is a torch.save file: a tensor, a tuple (inputs..., or (inputs, target)), or a dict
of keyword arguments; it is loaded with weights_only=True.

Other commands:
  precision-audit targets        the GPU table (--target names and aliases)
  precision-audit verify MODEL --batch BATCH --policy POLICY [--steps N] [--out DIR]
                                 A/B short training: FP32 vs the policy vs plain BF16 / FP16
  precision-audit report AUDIT_JSON [--out DIR]
                                 re-render report.html from a saved audit.json (no model run)
  precision-audit export POLICY --to deepspeed|lightning|accelerate|fsdp [--out FILE]
                                 the policy as another stack's precision settings
  precision-audit build-kernels [--verbose]
                                 compile the emulation's C++ autocast kernels once (needs a C++ compiler
                                 and ninja; ~15 s); later emulated audits use them (--kernels)

Exit codes: 0 done; 1 unsafe as is in every audited format; 2 bad input (message only).
"""


def _budget(text: str):
    from .analysis.findings import Budget

    keys = {"loss": "max_loss_rel_change", "output": "max_output_rel_error"}
    values: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        k, sep, v = part.partition("=")
        k = k.strip()
        if not sep or k not in keys:
            raise OptionError(f"cannot read --budget {text!r}", expected="KEY=VALUE pairs, e.g. loss=0.01,output=0.05",
                              choices=keys)
        if keys[k] in values:  # which one was meant? Taking the last one silently would hide a typo
            raise OptionError(f"--budget gives {k} twice: {text!r}", hint=f"give {k}=VALUE once")
        try:
            values[keys[k]] = float(v)
        except ValueError:
            raise OptionError(f"--budget {k} must be a number", found=repr(v)) from None
    try:
        return Budget(**values)
    except ValueError as e:
        raise OptionError(f"bad --budget: {e}") from None


#: The most timed steps ``--steps`` accepts (each one runs every format under torch.profiler; README.md).
MAX_STEPS = 1000


def _steps(text: str) -> int:
    """``--steps``: a whole number, at most :data:`MAX_STEPS` (a negative one is refused by the audit's options)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if n > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"{n} is more than the maximum, {MAX_STEPS} (each timed step runs "
                                         "every format under the profiler; a few are enough)")
    return n


def _target(text: str) -> str:
    """``--target``: a GPU name; an empty one is refused rather than read as "the default"."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the GPU name is empty: name one (e.g. h100; see `precision-audit targets`), "
                                         "or leave --target out for the detected GPU")
    return text


def _audit_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="precision-audit",
        description="Measure where FP16/BF16 mixed precision loses accuracy in a PyTorch model, per layer, "
                    "and write report.html, policy.json and audit.json.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="model.py[:name] or package.module:name")
    p.add_argument("--batch", metavar="BATCH", help="sample batch written by torch.save (default: sample_batch() "
                   "from the model file)")
    p.add_argument("--out", metavar="DIR", default="audit", help="output folder (default: ./audit)")
    p.add_argument("--target", metavar="GPU", type=_target, help="target GPU name or alias, e.g. h100, a100, v100 "
                   "(default: the detected GPU, else H100 SXM; see `precision-audit targets`)")
    p.add_argument("--formats", metavar="LIST", help="comma-separated formats to audit (default: fp16,bf16 where "
                   "the target supports them)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where the model runs (default: cuda when available)")
    p.add_argument("--emulate", action="store_true", help="emulate CUDA numerics on the CPU even when a GPU is present")
    p.add_argument("--steps", type=_steps, default=1, metavar="N",
                   help="timed steps per format under torch.profiler, after one warm-up step; traces go to "
                        f"DIR/tb (default: 1; 0 skips timing and traces; at most {MAX_STEPS})")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed for every pass (default: 0)")
    p.add_argument("--kernels", choices=("auto", "python", "compiled"), default="auto",
                   help="emulated mode's autocast kernels: compiled C++ ones are bit-identical and faster on small "
                        "models, and must be built once with `precision-audit build-kernels`; auto uses them when "
                        "built (default: auto)")
    p.add_argument("--budget", metavar="SPEC", default="",
                   help="error budget, e.g. loss=0.01,output=0.05, each key at most once (defaults: relative "
                        "loss change 0.01, output relative L2 error 0.05)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--verbose", "-v", action="store_true", help="log details to stderr")
    p.add_argument("--version", action="version", version=f"precision-audit {__version__}")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "targets":
            from .gpus import format_targets_table

            if len(argv) > 1 and argv[1] in ("-h", "--help"):
                print("usage: precision-audit targets\n\nPrint the table of target GPUs (names, aliases, dense peaks).")
                return 0
            print(format_targets_table())
            return 0
        if argv and argv[0] == "report":
            from .cli_report import report_main

            return report_main(argv[1:])
        if argv and argv[0] == "export":
            from .cli_export import export_main

            return export_main(argv[1:])
        if argv and argv[0] == "build-kernels":
            return _build_kernels(argv[1:])
        if argv and argv[0] == "verify":
            from .cli_verify import verify_main

            return verify_main(argv[1:])
        return _run_audit(argv)
    except AuditError as e:
        print(f"precision-audit: error: {e.message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("precision-audit: interrupted; no half-written file was left in --out", file=sys.stderr)
        return 130


def _build_kernels(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="precision-audit build-kernels",
        description="Compile the emulation's autocast kernels in C++ against the installed torch (a C++ compiler "
                    "and ninja are needed). They give bit-identical results to the Python kernels with less "
                    "overhead per op; emulated audits use them once built (--kernels auto). The library is cached "
                    "per torch and Python version in $PRECISION_AUDIT_KERNEL_DIR, else "
                    "~/.cache/precision-audit/kernels.")
    p.add_argument("--verbose", "-v", action="store_true", help="show the compiler's output")
    args = p.parse_args(argv)
    import torch

    from .capture import compiled

    if compiled.is_built():
        print(f"compiled kernels already built: {compiled.library_path()}")
        return 0
    print(f"building the compiled kernels for torch {torch.__version__} (about 15 s on 2 cores)...",
          file=sys.stderr, flush=True)
    path, seconds = compiled.build(verbose=args.verbose)
    print(f"built {path} in {seconds:.1f} s")
    return 0


def _run_audit(argv: list[str]) -> int:
    parser = _audit_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from .audit import AuditOptions, run_audit
    from .formats import parse_formats

    import torch

    opts = AuditOptions(
        model=args.model, batch=args.batch, out=Path(args.out), target=args.target,
        formats=parse_formats(args.formats) if args.formats is not None else None, device=args.device,
        emulate=args.emulate, steps=args.steps, seed=args.seed, budget=_budget(args.budget), kernels=args.kernels,
    )
    from .report.terminal import Progress, summary_text

    try:
        with Progress(quiet=args.quiet) as progress:
            result = run_audit(opts, progress)
    except torch.OutOfMemoryError as e:
        raise AuditError("the device ran out of memory during the audit", found=str(e).splitlines()[0][:200],
                         hint="use a smaller batch, or run with --device cpu") from e
    if args.json:
        print(json.dumps({"summary": result.audit["summary"], "verdict": result.audit["verdict"],
                          "loss_scale": result.audit["loss_scale"], "plan": result.audit["plan"],
                          "files": [str(f) for f in result.files]}, indent=1))
    else:
        print(summary_text(result.audit))
        print(f"  wrote: {', '.join(str(f) for f in result.files)}")
    return result.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
