"""Global flags anywhere on the command line (issue 31): `-v`/`--verbose` and `--quiet` before the command's
name or after it, also for commands that do not define them; after `--` nothing is a flag."""

from __future__ import annotations

import pytest

from testbed.cli import main, split_global_flags


def test_split_takes_the_flags_from_anywhere_before_a_double_dash():
    assert split_global_flags(["campaign", "-v", "--sweep", "devices=2", "--quiet"]) == (
        ["campaign", "--sweep", "devices=2"], {"verbose", "quiet"})
    assert split_global_flags(["run", "--", "-v"]) == (["run", "--", "-v"], set())


@pytest.mark.parametrize("argv", [
    ["campaign", "-v", "--print-config"],          # was: unrecognized arguments: -v
    ["campaign", "--print-config", "--verbose"],
    ["-v", "campaign", "--print-config"],
    ["--quiet", "campaign", "--print-config"],     # --quiet before the name of a command that has it
    ["plan", "--quiet"],                           # and after the name of one that does not
])
def test_global_flags_are_accepted_before_and_after_the_command(argv, monkeypatch, capsys):
    for var in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.setenv(var, "")
    assert main(argv) == 0, capsys.readouterr().err
    import os

    quiet = "--quiet" in argv
    assert (os.environ["TQDM_DISABLE"] == "1") == quiet  # quiet mode took effect, and only with --quiet


def test_an_unknown_flag_is_still_an_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["campaign", "--verbosity"])
    assert exit_.value.code == 2 and "unrecognized arguments: --verbosity" in capsys.readouterr().err
