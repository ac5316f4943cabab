"""The ranks' failure channel (precision_audit/distributed/failure.py) and the launcher's reading of how ranks
ended (launch.py), in one process: the store is an in-memory HashStore shared by "ranks" that are threads.

The same mechanisms run for real, across processes, in tests/distributed/test_hostile_ranks.py.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import torch.distributed as dist

from precision_audit.distributed import failure
from precision_audit.distributed.failure import Board, hang_message, raised_by_collective
from precision_audit.distributed.launch import _failed
from precision_audit.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_UNSAFE, EXIT_USAGE


def _boards(world: int) -> list[Board]:
    store = dist.HashStore()
    return [Board(store, r, world) for r in range(world)]


def test_ranks_that_raised_alike_agree_and_go_on():
    """Every rank posts the same (part, module, exception type): all see it and carry on, as one process would."""
    boards = _boards(3)
    got: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda b=b: got.__setitem__(b.rank, b.agree("forward|fc|ValueError")))
               for b in boards]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [got[r][0] for r in range(3)] == [True, True, True]
    assert all(b.seq == 1 for b in boards)


def test_a_rank_that_raised_elsewhere_or_waits_is_not_an_agreement():
    boards = _boards(2)
    boards[1].answer_blocked(1, "model.py, line 3, in forward")  # rank 1's watchdog: waiting in a collective
    t0 = time.monotonic()
    same, posted = boards[0].agree("forward|fc|ValueError")
    assert not same and time.monotonic() - t0 < 1.0, "a peer waiting in a collective decides at once"
    assert posted[1].startswith("waiting in a collective")
    boards = _boards(2)
    threading.Thread(target=lambda: boards[1].agree("forward|out|KeyError")).start()
    same, posted = boards[0].agree("forward|fc|ValueError")
    assert not same and posted[1] == "forward|out|KeyError"


def test_a_silent_peer_ends_the_agreement_at_its_timeout(monkeypatch):
    monkeypatch.setattr(failure, "AGREE_S", 0.3)
    boards = _boards(2)
    t0 = time.monotonic()
    same, posted = boards[0].agree("forward|fc|ValueError")
    assert not same and list(posted) == [0]
    assert 0.3 <= time.monotonic() - t0 < 2.0


def test_the_watchdog_answers_a_pending_agreement_only_when_its_rank_waits():
    boards = _boards(2)
    assert boards[1].pending_agreement() is None
    boards[0]._post("agree/1/0", "forward|fc|ValueError")
    boards[0]._count("agree/1/count", 1)
    assert boards[1].pending_agreement() == 1
    boards[1].answer_blocked(1, "somewhere")
    assert boards[1].pending_agreement() is None


def test_the_first_failure_is_kept_and_its_code_given_to_the_others(monkeypatch, tmp_path, capsys):
    """fail(): the first rank registers, prints one message naming the rank it is about and tells the launcher;
    a later one prints nothing and ends with the first one's code."""
    ended: list[int] = []

    def fake_end(code: int) -> None:
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(failure, "end", fake_end)
    monkeypatch.setenv(failure.LAUNCH_DIR_ENV, str(tmp_path))
    boards = _boards(2)
    with pytest.raises(SystemExit):
        boards[1].fail("the model raised ValueError: boom", 2)
    with pytest.raises(SystemExit):
        boards[0].fail("a collective failed", 3, internal=True)
    assert ended == [2, 2]
    err = capsys.readouterr().err
    assert err.splitlines() == ["precision-audit: error (rank 1 of 2): the model raised ValueError: boom"]
    assert (tmp_path / failure.REPORT_FILE).read_text() == '{"rank": 1, "code": 2}'
    assert boards[0].failure() == {"rank": 1, "code": 2}


def test_hang_message_names_the_rank_that_is_not_waiting():
    where = {0: {"waiting": True, "where": "distributed_c10d.py, line 1, in all_reduce"},
             1: {"waiting": False, "where": "model.py, line 9, in forward: time.sleep(1e6)"}}
    message, code, rank, internal = hang_message(where, 2, 5.0)
    assert (code, rank, internal) == (EXIT_USAGE, 1, False)
    assert "the rank hangs" in message and "model.py, line 9" in message and "5 s" in message
    assert failure.RANK_TIMEOUT_ENV in message
    message, code, rank, _ = hang_message({0: where[0]}, 2, 5.0)
    assert (code, rank) == (EXIT_USAGE, 1) and "does not answer" in message
    both = {0: where[0], 1: {"waiting": True, "where": "fsdp.py, line 2"}}
    message, code, _, internal = hang_message(both, 2, 5.0)
    assert (code, internal) == (EXIT_INTERNAL, True) and "different collectives" in message


def test_rank_timeout_from_the_environment(monkeypatch):
    for text, want in (("5", 5.0), ("0.5", 0.5), ("0", 600.0), ("-1", 600.0), ("abc", 600.0), ("1e400", 600.0),
                       ("nan", 600.0)):
        monkeypatch.setenv(failure.RANK_TIMEOUT_ENV, text)
        assert failure.rank_timeout_s() == want, text


def test_an_exception_out_of_a_collective_is_not_the_models():
    """A collective that broke (a peer gone) is told apart from the model's own exception by where it came from."""
    store = dist.HashStore()
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            dist.all_reduce(object())  # type: ignore[arg-type]
        except Exception as e:
            assert raised_by_collective(e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    try:
        raise ValueError("the model's")
    except ValueError as e:
        assert not raised_by_collective(e)


@dataclass
class _Failure:
    exitcode: int
    timestamp: int = 0


def test_the_launcher_reads_how_the_ranks_ended(capsys):
    """launch.py's _failed: a reported failure gives its code (its rank printed the message); the verdict 1 on
    every rank is the verdict; a rank that ended on its own without a message is named from its exit status; ranks the
    launcher stopped (SIGTERM, 130) are not the cause."""
    stopped = _Failure(EXIT_INTERRUPTED)
    assert _failed({0: _Failure(2), 1: stopped}, {"rank": 0, "code": 2}, 2, "") == 2
    assert _failed({0: _Failure(1), 1: _Failure(1)}, None, 2, "") == EXIT_UNSAFE
    assert capsys.readouterr().err == ""
    code = _failed({0: stopped, 1: _Failure(-signal.SIGKILL, 5), 2: _Failure(-signal.SIGTERM, 4)}, None, 3, "")
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.startswith("precision-audit: error (rank 1 of 3): the rank was killed by SIGKILL")
    assert err.count("precision-audit:") == 1
    assert _failed({0: _Failure(5, 7), 1: stopped}, None, 2, "") == EXIT_USAGE
    assert "ended with exit code 5 without a message" in capsys.readouterr().err
    if sys.platform.startswith("linux"):
        assert _failed({0: stopped, 1: _Failure(-signal.SIGTERM)}, None, 2, "") == EXIT_INTERRUPTED
        signal.signal(signal.SIGINT, signal.default_int_handler)  # _interrupted ignores further Ctrl-Cs
