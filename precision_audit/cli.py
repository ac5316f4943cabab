"""Command line: ``precision-audit MODEL --batch BATCH [options]`` and ``precision-audit targets``.

Exit codes (README.md, "Exit codes"):

- 0: done (the audit found a safe format, or the command succeeded);
- 1: done, but the model is unsafe as is in every audited low-precision format;
- 2: a user error: bad input, a bad option, or a model that failed or called ``sys.exit()`` (one message
  saying what was expected, what was found and the fix; no traceback);
- 3: an internal error, a bug in precision-audit (one line; ``--verbose`` adds the traceback);
- 130: interrupted (Ctrl-C / SIGINT at any moment): one line, and ``--out`` holds either the previous
  results untouched or the complete new ones.

This module imports no torch at the top: the Ctrl-C handling is in place before torch's import starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn, Sequence

from . import __version__
from .errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USAGE, AuditError, OptionError

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

Exit codes: 0 done; 1 unsafe as is in every audited format; 2 bad input or a failing model (message only);
3 internal error (a bug: one line, --verbose shows the traceback); 130 interrupted (Ctrl-C; --out holds the
previous results untouched or the complete new ones).
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
    p.add_argument("--steps", type=_steps, default=None, metavar="N",
                   help="timed steps per format under torch.profiler, after one warm-up step; traces go to "
                        "DIR/tb (default: 1 on a GPU, 0 in emulated mode, where CPU timings say nothing about the "
                        f"target GPU; 0 skips timing and traces; at most {MAX_STEPS})")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed for every pass (default: 0)")
    p.add_argument("--kernels", choices=("auto", "python", "compiled"), default="auto",
                   help="emulated mode's autocast kernels: compiled C++ ones are bit-identical and faster on small "
                        "models, and must be built once with `precision-audit build-kernels`; auto uses them when "
                        "built (default: auto)")
    p.add_argument("--budget", metavar="SPEC", default="",
                   help="error budget, e.g. loss=0.01,output=0.05, each key at most once (defaults: relative "
                        "loss change 0.01, output relative L2 error 0.05)")
    from .distributed import add_options as add_distributed_options  # --nproc, --shard (issue 15)

    add_distributed_options(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--verbose", "-v", action="store_true", help="log details to stderr")
    p.add_argument("--version", action="version", version=f"precision-audit {__version__}")
    return p


INTERRUPTED_LINE = ("precision-audit: interrupted; no half-written file was left in --out (it holds the previous "
                    "results untouched, or the complete new ones)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit code (module docstring).

    Called with no arguments, as the console script and ``python -m precision_audit`` do, it ends the process
    itself (:func:`_end_process`), so that a Ctrl-C even during interpreter shutdown still gives exit 130
    rather than a death by signal. Called with ``argv`` (tests, other programs) it returns, and argparse's own
    exits (``--help``, usage errors) raise ``SystemExit`` as usual.
    """
    ctrl_c = _CtrlC()  # first: a SIGINT from here on takes the interrupt path
    as_process = argv is None
    own_exit: SystemExit | None = None
    try:
        try:
            args = list(sys.argv[1:] if argv is None else argv)
            code = _guarded(args)
        except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2, message already printed)
            own_exit, code = e, _exit_status(e)
    except KeyboardInterrupt:
        own_exit, code = None, ctrl_c.interrupted()
    if as_process:
        _end_process(code, ctrl_c)
    ctrl_c.restore()
    if own_exit is not None:
        raise own_exit
    return code


def _guarded(argv: list[str]) -> int:
    """The command, with every failure turned into its exit code and one message on stderr."""
    try:
        return _dispatch(argv)
    except AuditError as e:
        print(f"precision-audit: error: {e.message}", file=sys.stderr)
        return e.exit_code
    except SystemExit as e:
        if _exit_is_ours(e):
            raise
        from .loading import model_exit_error  # the user's code called sys.exit() (verify's forward, ...)

        err = model_exit_error(e)
        print(f"precision-audit: error: {err.message}", file=sys.stderr)
        return err.exit_code
    except Exception as e:  # a bug: one line, the traceback only with --verbose
        if _verbose(argv):
            traceback.print_exc(file=sys.stderr)
        text = " ".join(str(e).split())
        text = text if len(text) <= 300 else text[:297] + "..."
        print(f"precision-audit: internal error (exit {EXIT_INTERNAL}): {type(e).__name__}"
              + (f": {text}" if text else "")
              + ("; this is a bug in precision-audit, please report it" if _verbose(argv)
                 else "; run again with --verbose to see the traceback, and please report it"),
              file=sys.stderr)
        return EXIT_INTERNAL


def _dispatch(argv: list[str]) -> int:
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


def _verbose(argv: list[str]) -> bool:
    return any(a == "--verbose" or re.fullmatch(r"-[a-zA-Z]*v[a-zA-Z]*", a) for a in argv if a != "--")


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _exit_is_ours(e: SystemExit) -> bool:
    """True for a ``SystemExit`` raised by precision-audit itself or by the argparse parser it called; False
    when it comes from anything precision-audit called into (the user's model, through torch or not)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frames = traceback.extract_tb(e.__traceback__)
    ours = [i for i, f in enumerate(frames) if os.path.abspath(f.filename).startswith(package)]
    if not ours or ours[-1] == len(frames) - 1:
        return True
    return os.path.basename(frames[ours[-1] + 1].filename) == "argparse.py"


class _CtrlC:
    """The command line's SIGINT handling (main thread only; elsewhere Python's own applies).

    The first SIGINT raises ``KeyboardInterrupt`` and from then on SIGINT is ignored: the interrupt path
    (removing the staging folder, putting the model back, printing the one line) runs to its end whatever the
    user presses. precision_audit/outputs.py holds a SIGINT back while it moves files into place and hands it
    to this handler afterwards.
    """

    def __init__(self) -> None:
        self._old: object = None
        self._active = threading.current_thread() is threading.main_thread()
        self.late: list[int] = []
        if self._active:
            self._old = signal.signal(signal.SIGINT, self._first)

    @staticmethod
    def _first(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    def ignore(self) -> None:
        if not self._active:
            return
        while True:  # a SIGINT landing between the except clause and this call raises once more
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                return
            except KeyboardInterrupt:
                continue

    def interrupted(self) -> int:
        self.ignore()
        print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED

    def record_late(self) -> None:
        """From now on a SIGINT is only noted (the process is ending): :func:`_end_process` turns it into 130."""
        if self._active:
            signal.signal(signal.SIGINT, lambda signum, frame: self.late.append(signum))

    def restore(self) -> None:
        if self._active:
            signal.signal(signal.SIGINT, self._old if self._old is not None else signal.default_int_handler)


def _end_process(code: int, ctrl_c: _CtrlC) -> NoReturn:
    """End the process with ``code`` (130 if a Ctrl-C arrived meanwhile), without the interpreter's shutdown,
    where a SIGINT would kill the process by the signal or print a traceback from an atexit callback."""
    ctrl_c.record_late()
    if code != EXIT_INTERRUPTED:
        import atexit

        try:
            atexit._run_exitfuncs()  # logging's flush, tensorboard's writers...
        except BaseException:  # noqa: BLE001 - the command's own result stands
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if ctrl_c.late and code != EXIT_INTERRUPTED:
        try:
            print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        code = EXIT_INTERRUPTED
    os._exit(code)


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
    from . import distributed  # torchrun / --nproc (precision_audit/distributed/, README.md "Distributed")

    distributed.check_options(args)
    if args.nproc and not distributed.launched_by_torchrun():
        return distributed.launch(argv, args.nproc, args.verbose, INTERRUPTED_LINE)
    ranked = distributed.launched_by_torchrun()
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
        with Progress(quiet=args.quiet or (ranked and os.environ.get("RANK") != "0")) as progress, _stdout_to_stderr():
            result = (distributed.run_rank(opts, args.shard, progress, args.verbose) if ranked
                      else run_audit(opts, progress))
        if isinstance(result, int):  # a rank other than 0: rank 0 prints and writes
            return result
    except torch.OutOfMemoryError as e:
        raise AuditError("the device ran out of memory during the audit", found=str(e).splitlines()[0][:200],
                         hint="use a smaller batch, or run with --device cpu") from e
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


if __name__ == "__main__":  # pragma: no cover
    main()
