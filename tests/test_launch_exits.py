"""The launcher's account of failed workers: every rank's own exit record completes what
the agent saw, and the line names the rank that failed first."""

from __future__ import annotations

import types

from dynpipe.runtime.health import OutOfMemory, StageFailure
from dynpipe.runtime.launch import _failures, _report


def _exc(**failures: tuple[float, int]):
    return types.SimpleNamespace(
        failures={
            int(r[4:]): types.SimpleNamespace(timestamp=t, exitcode=c)
            for r, (t, c) in failures.items()
        }
    )


def test_exit_records_complete_what_the_agent_saw(tmp_path) -> None:
    # The agent saw rank 0's echo of a failure; rank 1 recorded its own, earlier.
    (tmp_path / "rank1-attempt0").write_text(f"{OutOfMemory.exit_code} 10.0")
    (tmp_path / "rank0-attempt0").write_text(f"{StageFailure.peer_exit_code} 10.5")
    got = _failures(_exc(rank0=(11.0, StageFailure.peer_exit_code)), tmp_path)
    assert got == {0: (10.5, StageFailure.peer_exit_code), 1: (10.0, OutOfMemory.exit_code)}


def test_only_the_last_attempt_counts(tmp_path) -> None:
    (tmp_path / "rank1-attempt0").write_text("1 10.0")  # failed, then relaunched
    (tmp_path / "rank1-attempt1").write_text("0 20.0")
    (tmp_path / "rank0-attempt1").write_text("1 21.0")
    got = _failures(_exc(rank0=(22.0, 1)), tmp_path)
    assert got == {0: (21.0, 1)}


def test_the_first_real_failure_is_named(tmp_path, capsys) -> None:
    failures = {0: (10.5, StageFailure.peer_exit_code), 1: (10.0, 1), 2: (11.0, -15)}
    assert _report(failures, nproc=3, max_restarts=0) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "first: rank 1 exited with code 1" in err[0], err


def test_an_out_of_memory_or_an_echo_alone_adds_no_line(capsys) -> None:
    assert (
        _report(
            {0: (1.0, StageFailure.peer_exit_code), 1: (2.0, OutOfMemory.exit_code)},
            nproc=2,
            max_restarts=0,
        )
        == 1
    )
    assert _report({0: (1.0, StageFailure.peer_exit_code)}, nproc=2, max_restarts=0) == 1
    assert _report({0: (1.0, 2), 1: (1.5, -15)}, nproc=2, max_restarts=0) == 2
    assert capsys.readouterr().err == ""


def test_a_killed_worker_is_named_with_its_signal(capsys) -> None:
    assert _report({1: (3.0, -9), 0: (4.0, 143)}, nproc=2, max_restarts=0) == 1
    err = capsys.readouterr().err
    assert "rank 1 was killed by SIGKILL" in err and "--max-restarts" in err
