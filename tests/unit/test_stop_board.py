"""The stop board: stop requests posted by one instance, taken by the instance that holds the request."""
from __future__ import annotations

import os
import stat
import time

import pytest

from specguide.triton import stop_board
from specguide.triton.stop_board import StopBoard, UnsafeBoardError


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


def test_the_board_is_a_private_directory(tmp_path):
    old = os.umask(0o022)  # a usual umask: a plain mkdir would make it readable by all
    try:
        board = StopBoard("specguide", 7, tmp_path)
        board.post("r")
    finally:
        os.umask(old)
    st = os.lstat(board.dir)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert stat.S_IMODE(os.lstat(board.dir / stop_board._key("r")).st_mode) & 0o077 == 0


def test_a_planted_symlink_is_neither_followed_nor_removed(tmp_path):
    """Another user plants the board's (predictable) name as a symlink to a directory of their
    choosing: posting must not create files there, taking must not read or delete there."""
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (target / stop_board._key("r")).touch()
    board = StopBoard("specguide", 8, tmp_path)
    board.dir.symlink_to(target)
    with pytest.raises(UnsafeBoardError, match="not a directory of ours"):
        board.post("x")
    assert board.take({"r"}) == []  # refused (logged once), read as empty
    board.close()
    assert sorted(p.name for p in target.iterdir()) == [stop_board._key("r")]
    assert board.dir.is_symlink()


def test_a_preexisting_directory_open_to_others_is_refused(tmp_path):
    board = StopBoard("specguide", 9, tmp_path)
    board.dir.mkdir()
    os.chmod(board.dir, 0o777)  # anyone could plant or read stops there
    (board.dir / stop_board._key("r")).touch()
    with pytest.raises(UnsafeBoardError, match="not private"):
        board.post("x")
    assert board.take({"r"}) == []
    board.close()
    assert (board.dir / stop_board._key("r")).exists() and not (board.dir / stop_board._key("x")).exists()


def test_a_preexisting_file_or_another_users_directory_is_refused(tmp_path, monkeypatch):
    board = StopBoard("specguide", 10, tmp_path)
    board.dir.write_text("")
    with pytest.raises(UnsafeBoardError):
        board.post("x")
    other = StopBoard("specguide", 11, tmp_path)
    other.dir.mkdir(mode=0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.lstat(other.dir).st_uid + 1)  # as if made by another user
    with pytest.raises(UnsafeBoardError, match="owner uid"):
        other.post("x")
    assert other.take({"x"}) == [] and list(other.dir.iterdir()) == []
