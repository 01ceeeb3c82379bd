"""`qmill serve`'s flags → ServerConfig: the calibration expiry (0 keeps calibrations; a negative
or non-number is refused naming the flag), and its default said in --help."""

from __future__ import annotations

import argparse

import pytest

from qmill.server import command
from qmill.server import config as config_lib


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="qmill serve")
    command.add_arguments(parser)
    return parser.parse_args(argv)


def _expiry(*argv: str) -> float:
    return command.config_from_args(_parse(*argv)).calibration_expiry_seconds


def test_the_calibration_expiry_flag_sets_the_config():
    assert _expiry() == config_lib.ServerConfig().calibration_expiry_seconds == 7 * 24 * 3600
    assert _expiry("--calibration-expiry-seconds", "0") == 0  # kept forever
    assert _expiry("--calibration-expiry-seconds", "3600") == 3600


@pytest.mark.parametrize("value", ["-1", "nan", "week"])
def test_a_bad_calibration_expiry_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        _parse("--calibration-expiry-seconds", value)
    err = capsys.readouterr().err
    assert f"--calibration-expiry-seconds: {value!r}: give a number of seconds, 0 or more" in err


def test_help_says_the_calibration_expiry_and_its_default():
    parser = argparse.ArgumentParser(prog="qmill serve")
    command.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "--calibration-expiry-seconds" in text and "7 days; 0: kept" in text
