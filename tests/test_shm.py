"""One-process checks of the shared-memory files (the exchange itself runs on 3 ranks in
tests/collectives_script.py)."""

import os
from pathlib import Path

import pytest

from autopart import shm


def test_a_file_that_cannot_be_reserved_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        shm._map(str(tmp_path / "too-big"), 1 << 62, create=True)
    assert os.listdir(tmp_path) == []


def test_mapped_files_share_their_bytes(tmp_path: Path) -> None:
    owner = shm._map(str(tmp_path / "f"), 4096, create=True)
    peer = shm._map(str(tmp_path / "f"), 0, create=False)  # 0: the whole file
    owner[100:104] = b"abcd"
    assert len(peer) == 4096 and peer[100:104] == b"abcd"
