"""A rank that fails before a collective does not hang the others past the process group's timeout.

Two ranks train a tiny Llama under FSDP2 (the head in its own unit) through ``kltriton.heads``; rank 1 raises just
before its head's forward (the unshard all-gather) and, as a trainer that caught the error would, stays alive with
its sockets open. Rank 0 goes on into the collective: gloo gives up at the group's timeout (8 s here) and rank 0
exits with that error, well before rank 1 does. (When the failing rank exits instead, its peers see the closed
connection at once.)
"""
import pytest

pytest.importorskip("deepspeed")

import launch  # noqa: E402

TIMEOUT, LINGER = 8, 40


def test_a_failing_rank_does_not_hang_the_others(models, tmp_path):
    jobs = [dict(job="heads", layout="fsdp2_head", fail_rank=1, linger=LINGER, timeout=TIMEOUT, **models)]
    procs, logs = launch.start(jobs, tmp_path, world_size=2)
    codes, seconds = launch.wait(procs, logs, timeout=LINGER + 120)
    assert codes[0] not in (0, None) and codes[1] not in (0, None), codes
    failed = logs[1].read_text()
    assert "fails on purpose and lingers" in failed, launch.tail(logs[1])
    blocked = logs[0].read_text()
    assert "Timed out" in blocked or "timed out" in blocked, launch.tail(logs[0])
    # rank 0 left on its own, at the timeout, not when rank 1 finally exited
    assert seconds[0] < seconds[1] - (LINGER - TIMEOUT) / 2, seconds
