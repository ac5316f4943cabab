"""How a distributed audit ends when one rank fails, exits, is killed or hangs (docs/distributed.md, "Failures").

Collectives cannot carry a failure: a rank that stops calling them leaves its peers waiting in theirs, and a rank
that calls another one than its peers pairs unrelated buffers (gloo aborts the process in C++). So the ranks tell
each other through torch.distributed's store (the launcher's TCP store, which outlives the ranks), never through
a collective:

- :class:`Board` keeps the first failure (its rank and exit code); the rank that registers it first prints the
  one message, every other rank ends quietly with the same code, and a launcher started by ``--nproc`` reads
  the same report from its folder (precision_audit/distributed/launch.py);
- :meth:`Board.agree`: a rank whose model raised posts where and what, and learns within seconds whether every
  rank raised there too (one process's audit would record that as a finding, so the audit goes on) or whether a
  peer went on (it is then waiting in a collective: the audit ends, naming the rank that raised);
- :class:`Watchdog`, a thread in every rank, does what a rank blocked in a collective cannot: it ends the rank
  when the board holds a failure, when SIGTERM or Ctrl-C arrived (Python runs signal handlers only between
  bytecodes, never inside a blocking collective), when the launcher died (parent-death signal, and the parent
  checked), and it answers its peers' questions about where this rank's main thread is. When its own rank has
  waited in one collective for longer than the rank timeout, it asks every rank where it is and reports the
  ranks that are not waiting (a hang in the model's code) as the failure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any, NoReturn

from ..errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USAGE

log = logging.getLogger(__name__)

#: Seconds a rank may wait in one collective before its peers are asked where they are (a hang). The gloo and
#: NCCL timeout of the process group is this plus :data:`BACKSTOP_S`.
RANK_TIMEOUT_ENV = "PRECISION_AUDIT_RANK_TIMEOUT"
DEFAULT_RANK_TIMEOUT_S = 600.0
BACKSTOP_S = 60.0
#: The folder where a ``--nproc`` launcher finds the failure its ranks reported (set by launch.py)
LAUNCH_DIR_ENV = "PRECISION_AUDIT_LAUNCH_DIR"
LAUNCHER_PID_ENV = "PRECISION_AUDIT_LAUNCHER_PID"
REPORT_FILE = "failure.json"
#: How long a rank whose model raised waits for its peers to say they raised there too (a peer that will raise there
#: is at most one module's computation behind: the audit's checks keep the ranks in step module by module)
AGREE_S = 5.0
#: How long a rank stays in a collective before its watchdog calls it waiting there (and not passing through)
BLOCKED_S = 0.3
_POLL_S = 0.1
#: After SIGTERM or Ctrl-C, how long the main thread gets to end through its own interrupt path
_GRACE_S = 1.0
_PREFIX = "precision_audit/"


def rank_timeout_s() -> float:
    """The rank timeout from ``PRECISION_AUDIT_RANK_TIMEOUT`` (seconds, > 0), else 600."""
    text = os.environ.get(RANK_TIMEOUT_ENV, "")
    try:
        value = float(text)
    except ValueError:
        return DEFAULT_RANK_TIMEOUT_S
    return value if 0 < value < 1e7 else DEFAULT_RANK_TIMEOUT_S


def say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def end(code: int) -> NoReturn:
    """End this process now, from any thread (a peer may be gone: no collective, no cleanup that could wait)."""
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            s.flush()
    os._exit(code)


# -- where a thread is ---------------------------------------------------------------------------------------
_TORCH_DIST = os.path.join("torch", "distributed") + os.sep
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.join("site-packages", "torch") + os.sep


def in_collective(frame: Any) -> bool:
    """Whether the innermost Python frame of a thread is torch.distributed's (a collective, or its wait)."""
    return frame is not None and _TORCH_DIST in frame.f_code.co_filename


def describe_frame(frame: Any) -> str:
    """``model.py, line 23, in forward: time.sleep(1e6)``: the innermost frame of the user's code (outside torch
    and precision-audit), else the innermost frame."""
    if frame is None:
        return "(no Python frame)"
    stack = traceback.extract_stack(frame)
    user = [f for f in stack if not f.filename.startswith(_PACKAGE) and _TORCH not in f.filename
            and _TORCH_DIST not in f.filename and not f.filename.startswith("<")]
    f = (user or stack)[-1]
    return f"{os.path.basename(f.filename)}, line {f.lineno}, in {f.name}" + (f": {f.line.strip()}" if f.line else "")


def main_frame() -> Any:
    return sys._current_frames().get(threading.main_thread().ident or -1)


# -- the board ----------------------------------------------------------------------------------------------
class Board:
    """The ranks' failure channel in the store (module docstring). ``store``: torch.distributed's store; each
    thread talks to it through a connection of its own (``Store.clone()``)."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self._store, self.rank, self.world = store, rank, world
        self._local = threading.local()
        self.seq = 0  # agreements this rank took part in
        self.collectives = 0  # the audit's own checked collectives this rank completed (lockstep.py)

    @property
    def store(self) -> Any:
        s = getattr(self._local, "store", None)
        if s is None:
            s = self._local.store = self._store.clone()
        return s

    def _key(self, name: str) -> str:
        return _PREFIX + name

    def _count(self, name: str, add: int = 0) -> int:
        return int(self.store.add(self._key(name), add))

    def _get(self, name: str) -> str | None:
        key = self._key(name)
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode(errors="replace")

    def _post(self, name: str, value: str) -> str:
        """Set ``name`` unless it is set; returns what it holds."""
        return self.store.compare_set(self._key(name), "", value).decode(errors="replace")

    def events(self) -> int:
        return self._count("events")

    def count_collective(self) -> None:
        self.collectives += 1

    def _event(self) -> None:
        self._count("events", 1)

    # failures
    def failure(self) -> dict | None:
        """The first failure registered ({"rank", "code"}), or None."""
        if self._count("failed") == 0:
            return None
        for _ in range(50):  # registered, its record follows within microseconds
            text = self._get("failure")
            if text is not None:
                return dict(json.loads(text))
            time.sleep(0.02)
        return {"rank": -1, "code": EXIT_INTERNAL}

    def fail(self, message: str, code: int, about: int | None = None, internal: bool = False) -> NoReturn:
        """Register this failure and end the process: the first rank to fail prints ``message`` (naming ``about``,
        by default this rank) and reports it to the launcher; a later one ends quietly with the first one's code."""
        about = self.rank if about is None else about
        try:
            first = self._count("failed", 1) == 1
            if first:
                self.store.set(self._key("failure"), json.dumps({"rank": about, "code": code}))
                self._event()
            else:
                code = int((self.failure() or {}).get("code", code))
        except Exception:  # the store is gone with the launcher: say it, this rank cannot know more
            first = True
        if first:
            report_to_launcher(about, code)
            say(rank_message(message, about, self.world, code, internal))
        end(code)

    # agreeing on an exception of the model
    def agree(self, what: str) -> tuple[bool, dict[int, str]]:
        """Post ``what`` (where and what this rank's model raised) as this rank's next agreement, then wait until
        every rank posted (True when all posted the same) or one posted something else or stopped to wait in a
        collective (False); at most :data:`AGREE_S`. Returns the verdict and what each rank posted."""
        self.seq += 1
        n = self.seq
        self._post(f"agree/{n}/{self.rank}", what)
        self._count(f"agree/{n}/count", 1)
        self._event()
        deadline = time.monotonic() + AGREE_S
        while True:
            seen = {q: self._get(f"agree/{n}/{q}") for q in range(self.world)}
            posted = {q: v for q, v in seen.items() if v is not None}
            if any(v != what for v in posted.values()):
                return False, posted
            if len(posted) == self.world:
                return True, posted
            failed = self.failure()
            if failed is not None:  # another rank decided: its message is the one
                end(int(failed["code"]))
            if time.monotonic() > deadline:
                return False, posted
            time.sleep(0.05)

    def pending_agreement(self) -> int | None:
        """The agreement a peer asked for that this rank has not answered (the next one after its own), or None."""
        n = self.seq + 1
        if self._count(f"agree/{n}/count") == 0 or self._get(f"agree/{n}/{self.rank}") is not None:
            return None
        return n

    def answer_blocked(self, n: int, where: str) -> None:
        self._post(f"agree/{n}/{self.rank}", f"waiting in a collective ({where})")

    # where every rank is (a hang)
    def ask_where(self) -> int:
        k = self._count("where/asked", 1)
        self._event()
        return k

    def where_asked(self) -> int:
        return self._count("where/asked")

    def post_where(self, k: int, waiting: bool, where: str) -> None:
        self._post(f"where/{k}/{self.rank}", json.dumps({"waiting": waiting, "where": where}))

    def where(self, k: int) -> dict[int, dict]:
        got = {q: self._get(f"where/{k}/{q}") for q in range(self.world)}
        return {q: json.loads(v) for q, v in got.items() if v is not None}

    def diagnose_first(self) -> bool:
        return self._post("diagnosing", str(self.rank)) == str(self.rank)


def rank_message(message: str, rank: int, world: int, code: int, internal: bool = False) -> str:
    if internal:
        return f"precision-audit: internal error (rank {rank} of {world}, exit {code}): {message}"
    return f"precision-audit: error (rank {rank} of {world}): {message}"


def report_to_launcher(rank: int, code: int) -> None:
    """Tell a ``--nproc`` launcher which rank failed with which code, and that its message is printed."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if not folder:
        return
    try:
        fd = os.open(os.path.join(folder, REPORT_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # another rank reported first, or the launcher's folder is gone
        return
    with os.fdopen(fd, "w") as f:
        json.dump({"rank": rank, "code": code}, f)


# -- the watchdog ---------------------------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1


def _parent_death_signal(sig: int) -> bool:
    """Linux: ``sig`` to this process when its parent (the launcher) ends (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Watchdog(threading.Thread):
    """This rank's watchdog thread (module docstring). Start it from the main thread, first thing in a rank:
    ``wd = Watchdog(rank, world); wd.start()``, then ``wd.attach(board)`` once the process group exists."""

    def __init__(self, rank: int, world: int, timeout_s: float | None = None) -> None:
        super().__init__(name="precision-audit-watchdog", daemon=True)
        self.rank, self.world = rank, world
        self.timeout_s = rank_timeout_s() if timeout_s is None else timeout_s
        self.board: Board | None = None
        self.armed = True  # False while rank 0 writes the outputs: its own interrupt path keeps them whole
        self._signalled: float | None = None
        launcher = os.environ.get(LAUNCHER_PID_ENV, "")
        self._ppid = int(launcher) if launcher.isdigit() else os.getppid()
        _parent_death_signal(signal.SIGTERM)
        self._wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        self._old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        self._wake_w = wake_w
        self._blocked: tuple[Any, ...] | None = None  # (frame, lasti, collectives done, since)
        self._events, self._answered_where = 0, 0
        self._stopped = False

    def attach(self, board: Board) -> None:
        self._answered_where = board.where_asked()
        self.board = board

    def stop(self) -> None:
        """From the main thread, once the audit is over: the thread ends, signals are Python's alone again."""
        self._stopped = True
        signal.set_wakeup_fd(self._old_wakeup)

    @contextlib.contextmanager
    def disarmed(self) -> Iterator[None]:
        self.armed = False
        try:
            yield
        finally:
            self.armed = True

    def run(self) -> None:
        while not self._stopped:
            try:
                self._tick()
            except Exception as e:  # the store went away with the launcher: the parent check ends this rank
                log.debug("watchdog: %s", e)
                time.sleep(_POLL_S)

    def _tick(self) -> None:
        ready, _, _ = select.select([self._wake_r], [], [], _POLL_S)
        if ready:
            got = os.read(self._wake_r, 64)
            if any(b in (signal.SIGINT, signal.SIGTERM) for b in got) and self._signalled is None:
                self._signalled = time.monotonic()
        if os.getppid() != self._ppid:  # the launcher is gone (and the parent-death signal did not come)
            self._ppid = os.getppid()
            os.kill(os.getpid(), signal.SIGTERM)
        if self._signalled is not None and self.armed and time.monotonic() - self._signalled > _GRACE_S:
            end(EXIT_INTERRUPTED)  # the main thread is in a collective or C++ code: it cannot run its handler
        board = self.board
        if board is None:
            return
        self._track_blocked(board)
        events = board.events()
        if events != self._events:
            self._events = events
            self._on_event(board)
        if self._blocked is not None and time.monotonic() - self._blocked[3] > self.timeout_s:
            self._diagnose_hang(board)

    def _track_blocked(self, board: Board) -> None:
        f = main_frame()
        if not in_collective(f):
            self._blocked = None
            return
        key = (f, f.f_lasti, board.collectives)
        if self._blocked is None or self._blocked[:3] != key:
            self._blocked = (*key, time.monotonic())

    def blocked_for(self) -> float:
        return 0.0 if self._blocked is None else time.monotonic() - self._blocked[3]

    def _on_event(self, board: Board) -> None:
        failed = board.failure()
        if failed is not None and self.armed:
            end(int(failed["code"]))
        asked = board.where_asked()
        while self._answered_where < asked:
            self._answered_where += 1
            f = main_frame()
            board.post_where(self._answered_where, in_collective(f), describe_frame(f))
        n = board.pending_agreement()
        if n is not None:
            time.sleep(BLOCKED_S)  # waiting there, or passing through?
            self._track_blocked(board)
            if self.blocked_for() >= BLOCKED_S:
                board.answer_blocked(n, describe_frame(main_frame()))

    def _diagnose_hang(self, board: Board) -> None:
        """This rank waited in one collective for the rank timeout: ask every rank where it is; the ranks that
        are not waiting in a collective are the failure (one rank diagnoses, the others answer)."""
        if not board.diagnose_first():
            self._blocked = None  # another rank is asking; this one answers (_on_event)
            return
        k = board.ask_where()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and len(board.where(k)) < self.world:
            self._on_event(board)  # answers its own question too
            time.sleep(0.05)
        board.fail(*hang_message(board.where(k), self.world, self.timeout_s))


def hang_message(where: dict[int, dict], world: int, timeout_s: float) -> tuple[str, int, int, bool]:
    """(message, exit code, the rank it names, internal) for ranks that waited ``timeout_s`` in a collective."""
    silent = [q for q in range(world) if q not in where]
    running = [q for q in range(world) if q in where and not where[q]["waiting"]]
    waited = f"the other ranks waited {timeout_s:g} s for it in a collective"
    tune = f"{RANK_TIMEOUT_ENV} sets the timeout (seconds; default {DEFAULT_RANK_TIMEOUT_S:g})"
    if running:
        q = running[0]
        return (f"the rank hangs: it did not reach the audit's next collective ({waited}); it is at "
                f"{where[q]['where']}. A hang in the model's code, or a step slower than the timeout: {tune}",
                EXIT_USAGE, q, False)
    if silent:
        q = silent[0]
        return (f"the rank does not answer: {waited}, and its Python is stuck (a C extension holding the GIL, "
                f"or a process that is gone). {tune}", EXIT_USAGE, q, False)
    places = "; ".join(f"rank {q} at {where[q]['where']}" for q in range(world))
    return (f"the ranks waited {timeout_s:g} s for each other in different collectives: {places}",
            EXIT_INTERNAL, 0, True)


# -- what a rank does when the model raised, or a collective broke ---------------------------------------------
def raised_by_collective(e: BaseException) -> bool:
    """Whether ``e`` came out of a torch.distributed collective (a peer gone, a timeout), not the model's code."""
    tb = e.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and _TORCH_DIST in last.tb_frame.f_code.co_filename


def model_raised(board: Board, e: BaseException, part: str, where: str | None, model_file: str | None) -> None:
    """The model raised ``e`` on this rank in ``part`` (in module ``where``). Returns when every rank raised the
    same there (the audit goes on as one process's would); else ends the audit with this rank's own error."""
    if raised_by_collective(e):
        collective_broke(board, e)
    same, posted = board.agree(f"{part}|{where}|{type(e).__name__}")
    if same:
        return
    err = one_rank_error(e, part, where, model_file)
    others = "; ".join(f"rank {q}: {v.split('|')[-1] if '|' in v else v}" for q, v in sorted(posted.items())
                       if q != board.rank)
    if others:
        err.found = f"{err.found}; meanwhile {others}" if err.found else f"meanwhile {others}"
    board.fail(err.message, err.exit_code)


def one_rank_error(e: BaseException, part: str, where: str | None, model_file: str | None) -> Any:
    """The user error for an exception of the model on one rank (an AuditError: exit 2)."""
    from ..errors import AuditError, ModelRunError
    from ..loading.failures import model_exit_error, raise_site

    if isinstance(e, AuditError):
        return e
    if isinstance(e, SystemExit):
        return model_exit_error(e)
    oom = getattr(sys.modules.get("torch"), "OutOfMemoryError", None)
    if isinstance(oom, type) and isinstance(e, oom):
        return AuditError(f"the device ran out of memory in the {part} on this rank",
                          found=str(e).splitlines()[0][:200] if str(e) else type(e).__name__,
                          hint="use a smaller batch, or run with --device cpu")
    site = raise_site(e, model_file) if model_file else None
    found = "; ".join(x for x in (f"in module '{where}'" if where else None, site) if x)
    return ModelRunError(
        f"the model raised {type(e).__name__} in the {part} on this rank, where the other ranks went on: {e}",
        found=found or None,
        hint="a distributed audit needs every rank to take the same path; an exception on some ranks only ends it "
             "(one process's audit records an exception in a pass as that pass's failure: audit in one process "
             "to see it there)")


def collective_broke(board: Board, e: BaseException) -> NoReturn:
    """A collective raised: another rank ended. Its failure is on the board within moments, or the launcher is
    stopping every rank (SIGTERM, which ends this one): wait for either, then say what this rank knows."""
    text = " ".join(str(e).split())[:300]
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        failed = board.failure()
        if failed is not None:
            end(int(failed["code"]))
        time.sleep(0.1)
    board.fail(f"a collective failed ({type(e).__name__}: {text}): another rank ended without a message (killed, "
               "for instance by the out-of-memory killer, or os._exit() in the model's code), or the network "
               "between the ranks failed", EXIT_USAGE)
