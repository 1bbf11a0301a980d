"""Both command lines refuse an argument they cannot use before doing anything: argparse's exit
status 2 and a message naming the argument, the value and what was expected."""

from __future__ import annotations

import argparse
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpu_agent import cli as agent_cli
from dpu_offload.cli_args import MAX_SECONDS, integer, non_negative, seconds
from host_client import cli as client_cli


@pytest.mark.parametrize("main,argv,named", [
    (client_cli.main, ["top", "--interval", "-1"], "--interval: must be above 0"),
    (client_cli.main, ["top", "--interval", "nan"], "--interval: must be above 0"),
    (client_cli.main, ["top", "--iterations", "-3"], "--iterations: must be 0 or more"),
    (client_cli.main, ["status", "--timeout", "inf"], "--timeout: must be above 0"),
    (client_cli.main, ["status", "--timeout", "soon"], "--timeout: must be a number of seconds"),
    (client_cli.main, ["flows", "add", "--session", "s", "--action", "drop", "--expert",
                       str(2**31)], "--expert: must be from -1 to 2147483647"),
    (client_cli.main, ["flows", "add", "--session", "s", "--action", "forward", "--queue",
                       "-1"], "--queue: must be from 0 to 4294967295"),
    (client_cli.main, ["flows", "delete", "--session", "s", "0"],
     "rule_ids: must be from 1 to"),
    (client_cli.main, ["serve-experts", "--checkpoint", "c", "--model", "m", "--ordinal", "-1"],
     "--ordinal: must be 0 or more"),
    (client_cli.main, ["make-checkpoint", "d", "--arch", "mixtral", "--seed", "-1"],
     "--seed: must be 0 or more"),
    (agent_cli.main, ["plan", "--load", "x.npy", "--gpus", "2", "--replicas", "-1"],
     "--replicas: must be 0 or more"),
    (agent_cli.main, ["cluster", "--etcd", "127.0.0.1:1", "--timeout", "0", "status"],
     "--timeout: must be above 0"),
])
def test_a_bad_argument_is_refused_by_name(main, argv: list[str], named: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                 st.text(max_size=12)))
def test_seconds_takes_exactly_the_durations_it_bounds(text: str) -> None:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and 0 < value <= MAX_SECONDS:
        assert seconds(text) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            seconds(text)


@given(st.integers(-2**70, 2**70))
def test_integer_bounds_are_inclusive(value: int) -> None:
    parse = integer(-1, 2**31 - 1)
    if -1 <= value <= 2**31 - 1:
        assert parse(str(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=str(value)):
            parse(str(value))
    if value >= 0:
        assert non_negative(str(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            non_negative(str(value))
