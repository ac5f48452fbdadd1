"""`chunkserve bench cluster`'s flags are checked before anything starts."""

from __future__ import annotations

import pytest

from chunkserve.tools import bench_cluster


def test_systems_takes_both_or_a_list_of_on_and_off():
    assert bench_cluster.systems("both") == ["off", "on"]  # the help's "both" used to raise KeyError
    assert bench_cluster.systems("on") == ["on"] and bench_cluster.systems("off,on") == ["off", "on"]
    for bad in ("", "all", "on,tpp"):
        with pytest.raises(ValueError, match="--systems"):
            bench_cluster.systems(bad)


@pytest.mark.parametrize("argv", [["--systems", "all"], ["--n", "1,x"], ["--engine", "{nope"]])
def test_bad_flags_exit_2_with_a_message_before_anything_starts(argv, capsys, tmp_path):
    assert bench_cluster.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert "chunkserve bench cluster" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # no key files written
