"""The stop board: stop requests posted by one instance, taken by the instance that holds the request."""
from __future__ import annotations

import os
import time

from specguide.triton import stop_board
from specguide.triton.stop_board import StopBoard


def test_a_posted_stop_is_taken_once_by_the_instance_holding_the_request(tmp_path):
    a, b = StopBoard("specguide", 123, tmp_path), StopBoard("specguide", 123, tmp_path)
    assert a.take({"r1", "r2"}) == []  # nothing posted: no board yet
    b.post("r2")  # b got the stop of a request it does not hold
    b.post("odd id / with: ünïcode")
    assert b.take({"r9"}) == []  # b holds neither
    assert a.take({"r1", "r2"}) == ["r2"]
    assert a.take({"r1", "r2"}) == []  # taken once
    assert a.take({"odd id / with: ünïcode"}) == ["odd id / with: ünïcode"]
    assert a.take({"", "r1"}) == []  # an empty id never matches


def test_boards_are_per_server_and_model_and_expire_and_close(tmp_path, monkeypatch):
    mine, other_server, other_model = (StopBoard("specguide", 1, tmp_path), StopBoard("specguide", 2, tmp_path),
                                       StopBoard("my model", 1, tmp_path))
    other_server.post("r")
    other_model.post("r")
    assert mine.take({"r"}) == []
    assert other_model.dir.name == "specguide-stops-1-my_model"
    mine.post("late")  # a stop for a request that had already ended: nobody takes it
    old = time.time() - stop_board.STOP_TTL_S - 1
    entry = next(mine.dir.iterdir())
    os.utime(entry, (old, old))
    mine.post("fresh")
    assert mine.take({"x"}) == [] and [p.name for p in mine.dir.iterdir()] == [stop_board._key("fresh")]
    mine.close()
    assert not mine.dir.exists()
    mine.close()  # twice, or never posted: no error
