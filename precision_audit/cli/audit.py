"""``precision-audit MODEL --batch BATCH [options]``: the audit's options, and the run that writes report.html,
policy.json and audit.json into ``--out``.

What the user's code prints while it runs goes to stderr (:class:`_stdout_to_stderr`), so that stdout holds only
the summary (``--json`` parses as JSON). Exit codes: 0 safe, 1 unsafe as is in every audited format; errors take
the one path in precision_audit/cli/main.py.

Example::

    >>> args = _audit_parser().parse_args(["model.py", "--budget", "loss=0.02"])
    >>> _budget(args.budget).max_loss_rel_change
    0.02
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from ..errors import OptionError
from ..version import __version__
from .commands import help_text

EPILOG = f"""\
MODEL is a .py file defining build_model(), get_model() or a module-level `model` (model.py:name picks
another), or an importable package.module:name. The file may define loss_fn(output, batch) and
sample_batch(). BATCH is a torch.save file: a tensor, a tuple (inputs..., or (inputs, target)), or a dict
of keyword arguments; it is loaded with weights_only=True.

Other commands:
{help_text()}

Exit codes: 0 done; 1 unsafe as is in every audited format; 2 bad input or a failing model (message only);
3 internal error (a bug: one line, --verbose shows the traceback); 130 interrupted (Ctrl-C; --out holds the
previous results untouched or the complete new ones); 141 output pipe closed by its reader (| head).
"""


def _budget(text: str):
    from ..options import Budget

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


#: The most timed steps ``--steps`` accepts (each one runs every format, twice, three times with --trace; README.md).
MAX_STEPS = 1000


def _steps(text: str) -> int:
    """``--steps``: a whole number, at most :data:`MAX_STEPS` (a negative one is refused by the audit's options)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if n > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"{n} is more than the maximum, {MAX_STEPS} (each timed step runs "
                                         "every format; a few are enough)")
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
                   "the target supports them; add tf32 to measure TF32, fp8_e4m3 for the FP8 stage)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where the model runs (default: cuda when available)")
    p.add_argument("--emulate", action="store_true", help="emulate CUDA numerics on the CPU even when a GPU is present")
    p.add_argument("--steps", type=_steps, default=None, metavar="N",
                   help="timed steps per format, after one warm-up step, timed with CUDA events on a GPU (default: "
                        "1 on a GPU, 0 in emulated mode, where CPU timings say nothing about the target GPU; 0 skips "
                        f"timing; at most {MAX_STEPS})")
    p.add_argument("--trace", action="store_true",
                   help="also run the timed steps under torch.profiler and write its traces to DIR/tb/<format>/ "
                        "(one profiler for every format; its start-up takes seconds on a GPU; default: no trace)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed for every pass (default: 0)")
    p.add_argument("--kernels", choices=("auto", "python", "compiled"), default="auto",
                   help="emulated mode's autocast kernels: compiled C++ ones are bit-identical and faster on small "
                        "models; auto uses them, building them once at first use (one progress line; "
                        "PRECISION_AUDIT_AUTO_BUILD=0 turns that off) and falling back to python with a one-line "
                        "note when no compiler is there; compiled requires them built (`precision-audit "
                        "build-kernels`) (default: auto)")
    p.add_argument("--budget", metavar="SPEC", default="",
                   help="error budget, e.g. loss=0.01,output=0.05, each key at most once (defaults: relative "
                        "loss change 0.01, output relative L2 error 0.05)")
    p.add_argument("--tokens-per-step", type=int, default=None, metavar="N",
                   help="with an FP8 format: the rows (batch x sequence) one training step feeds each linear, for "
                        "the FP8 plan's cost, at most 2**40 (default: the audited batch's; docs/fp8.md)")
    from ..distributed import add_options as add_distributed_options  # --nproc, --shard (issue 15)

    add_distributed_options(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--verbose", "-v", action="store_true", help="log details to stderr")
    p.add_argument("--version", action="version", version=f"precision-audit {__version__}")
    return p


def audit_main(argv: list[str]) -> int:
    """Run ``precision-audit MODEL ...`` (``argv`` is everything after the program name); returns the exit code:
    0 safe, 1 unsafe as is in every audited format (module docstring of precision_audit/cli)."""
    parser = _audit_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from .. import distributed  # torchrun / --nproc (precision_audit/distributed/, README.md "Distributed")

    distributed.check_options(args)
    if args.nproc and not distributed.launched_by_torchrun():
        from .main import INTERRUPTED_LINE

        return distributed.launch(argv, args.nproc, args.verbose, INTERRUPTED_LINE)
    ranked = distributed.launched_by_torchrun()
    from ..audit import AuditOptions, run_audit
    from ..formats import parse_formats

    opts = AuditOptions(
        model=args.model, batch=args.batch, out=Path(args.out), target=args.target,
        formats=parse_formats(args.formats) if args.formats is not None else None, device=args.device,
        emulate=args.emulate, steps=args.steps, seed=args.seed, budget=_budget(args.budget), kernels=args.kernels,
        fp8_tokens_per_step=args.tokens_per_step, trace=args.trace,
    )
    from ..report.terminal import Progress, summary_text

    # The device running out of memory becomes a user error (a smaller batch) in precision_audit/cli/main.py.
    with Progress(quiet=args.quiet or (ranked and os.environ.get("RANK") != "0")) as progress, _stdout_to_stderr():
        result = (distributed.run_rank(opts, args.shard, progress, args.verbose) if ranked
                  else run_audit(opts, progress))
    if isinstance(result, int):  # a rank other than 0: rank 0 prints and writes
        return result
    try:
        if args.json:
            print(json.dumps({"summary": result.audit["summary"], "verdict": result.audit["verdict"],
                              "loss_scale": result.audit["loss_scale"], "plan": result.audit["plan"],
                              "files": [str(f) for f in result.files]}, indent=1))
        else:
            print(summary_text(result.audit))
            print(f"  wrote: {', '.join(str(f) for f in result.files)}")
        sys.stdout.flush()
    except BrokenPipeError:  # stdout's reader went away (`| head`): the audit is written, its verdict stands
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return result.exit_code


class _stdout_to_stderr:
    """While the user's code runs (importing the model file, its forward, loss_fn...), what it prints goes to
    stderr: stdout carries only precision-audit's own result (the --json summary must parse as JSON).

    Both ``sys.stdout`` and, when it is a real file, file descriptor 1 are redirected, so C extensions and
    child processes are caught too.
    """

    def __enter__(self) -> None:
        self._saved_fd: int | None = None
        self._saved = sys.stdout
        try:
            sys.stdout.flush()
            if sys.stdout.fileno() == 1 and sys.stderr.fileno() != 1:
                self._saved_fd = os.dup(1)
                os.dup2(sys.stderr.fileno(), 1)
        except (AttributeError, OSError, ValueError):  # no real stdout (a test's capture, a closed stream)
            self._saved_fd = None
        sys.stdout = sys.stderr

    def __exit__(self, *exc: object) -> None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        sys.stdout = self._saved
        if self._saved_fd is not None:
            os.dup2(self._saved_fd, 1)
            os.close(self._saved_fd)
