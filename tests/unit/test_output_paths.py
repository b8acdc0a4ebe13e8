"""A file option whose path runs through a file (sched.png/x.png, with sched.png a file)
is refused as such, not as a folder that does not exist (partita.commands)."""

import pytest

from partita.commands import check_output_file
from partita.errors import PartitaError


def test_a_file_in_place_of_the_folder_is_named_a_file(tmp_path):
    (tmp_path / "sched.png").write_bytes(b"png")
    for path in (tmp_path / "sched.png" / "x.png", tmp_path / "sched.png" / "sub" / "x.png"):
        with pytest.raises(PartitaError) as refused:
            check_output_file(str(path), "--png", ("png",))
        assert str(refused.value) == (f"--png {path}: {tmp_path / 'sched.png'} is a file, "
                                      "not a folder. Choose a file in an existing folder.")
    assert (tmp_path / "sched.png").read_bytes() == b"png"


def test_a_missing_folder_is_still_said_to_be_missing(tmp_path):
    path = tmp_path / "nowhere" / "x.png"
    with pytest.raises(PartitaError, match=f"the folder {tmp_path / 'nowhere'} does not exist"):
        check_output_file(str(path), "--png", ("png",))
    check_output_file(str(tmp_path / "x.png"), "--png", ("png",))
    assert not (tmp_path / "x.png").exists()
