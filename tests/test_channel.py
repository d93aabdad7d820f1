"""The runtime's channel to its ranks (`runtime/channel.py`) on a real TCPStore: stop, a turn given once
(the first word wins, go or cancel), the hand-over to the phase started ahead, a failure fired, and a rank
whose runtime is gone told so in one line instead of waiting forever."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from tenplex.runtime.channel import Channel, ChannelError, RankChannel, put, stop_word


@pytest.fixture(scope="module")
def channel() -> Channel:
    c = Channel("127.0.0.1")
    c.serve()
    return c


def test_stop_is_seen_by_the_phase_it_names_only(channel) -> None:
    one, two = RankChannel(channel.address, 1), RankChannel(channel.address, 2)
    assert not one.stop_asked()
    channel.stop(1)
    assert one.stop_asked() and not two.stop_asked()


def test_a_stop_at_a_step_waits_for_it_and_the_newest_word_counts(channel) -> None:
    """An agent's stop for a planned change at step 8 (`--at-step`) ends the round after step 8 only; a
    rank already past it stops at once (late, not lost); a later word replaces it (a broken round: now)."""
    rank = RankChannel(channel.address, 21)
    put(channel.store, "stop/21", stop_word("devices [0] -> [0, 1]", 8))
    assert [rank.stop_asked(s) for s in (6, 7, 8, 9)] == [False, False, True, True]
    assert rank.stop_asked()  # asked without a step: a stop was said
    put(channel.store, "stop/21", stop_word("worker 1: exit code 1", None))
    assert rank.stop_asked(3)


def test_a_put_is_seen_at_once_on_every_other_connection(channel) -> None:
    """torch's `set` returns before the store applied it: a reader on another connection that asks right
    after could miss it (this test's reads did, many times in each run, until `put` waited)."""
    reader = RankChannel(channel.address, 0).store
    missed = [
        i for i in range(3000) if not (put(channel.store, f"seen/{i}", "1") or reader.check([f"seen/{i}"]))
    ]
    assert not missed, f"{len(missed)} keys were not seen right after their put"


def test_a_turn_is_given_once_the_first_word_wins(channel) -> None:
    assert channel.go(11) and not channel.cancel(11) and channel.went(11)  # a late cancel cannot undo go
    assert channel.cancel(12) and not channel.go(12) and not channel.went(12)  # nor a late go a cancel
    assert (
        RankChannel(channel.address, 11).wait_turn()[0]
        and not RankChannel(channel.address, 12).wait_turn()[0]
    )


def test_a_rank_waits_for_its_turn_and_learns_when_it_was_given(channel) -> None:
    threading.Timer(0.3, channel.go, args=(21,)).start()
    t = time.time()
    goes, told = RankChannel(channel.address, 21).wait_turn()
    assert goes and t + 0.25 < told <= time.time()


def test_the_old_phases_rank_0_gives_the_turn_of_the_phase_named_next(channel) -> None:
    RankChannel(channel.address, 30).hand_over()  # none named: nothing happens
    assert not channel.went(31)
    channel.name_next(31, after=30)
    RankChannel(channel.address, 30).hand_over()
    assert channel.went(31) and not channel.cancel(31)


def test_a_failure_is_waited_for_until_fired_and_not_forever(channel) -> None:
    rank = RankChannel(channel.address, 40)
    with pytest.raises(ChannelError, match="failure due at step 6 was never injected"):
        rank.await_fired(6, 0.2)
    channel.fire(40, 6)
    rank.await_fired(6, 0.2)  # fired: goes on at once


def test_a_rank_whose_runtime_is_gone_is_told_in_one_line() -> None:
    serve = (
        "from tenplex.runtime.channel import Channel\n"
        "c = Channel('127.0.0.1')\nc.serve()\nprint(c.address, flush=True)\ninput()"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", serve], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        rank = RankChannel(p.stdout.readline().strip(), 1)
        assert not rank.stop_asked()
        p.kill()
        p.wait()
        with pytest.raises(ChannelError, match="lost the runtime's store") as e:
            rank.stop_asked()
        assert "\n" not in str(e.value)
    finally:
        p.kill()


def test_a_closed_channel_serves_no_more_and_says_so() -> None:
    """The controller closes its channel when its ranks are gone: the store's server ends then, not in the
    interpreter's teardown (where one kept alive by a traceback aborted the process, exit -6 for 1)."""
    c = Channel("127.0.0.1")
    c.serve()
    rank = RankChannel(c.address, 1)
    assert not rank.stop_asked()
    c.close()
    with pytest.raises(ChannelError, match="is closed"):
        c.stop(1)
    host, _, port = c.address.rpartition(":")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()
