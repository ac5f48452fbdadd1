"""`chunkserve loadtest`'s flags are checked before anything is written or started."""

from __future__ import annotations

import pytest

from chunkserve.tools import loadtest


@pytest.mark.parametrize("argv", [
    ["--users", "0"],  # used to become 8 silently
    ["--duration", "0"],  # used to become 60 s silently
    ["--users", "-3"],
    ["--tenants", "0"],
    ["--protocols", "grcp"],
    ["--engine", "[1]"],
    ["--engine", "{nope"],
])
def test_bad_flags_exit_2_with_a_message_before_anything_starts(argv, capsys, tmp_path):
    assert loadtest.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert "chunkserve loadtest" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # no tenants file or keys written


def test_unset_users_and_duration_take_the_defaults():
    spec = loadtest.spec_from_args(loadtest.parse_args([]))
    assert (spec.users, spec.duration_s) == (8, 60.0)
    soak = loadtest.spec_from_args(loadtest.parse_args(["--soak"]))
    assert soak.duration_s == 600.0
