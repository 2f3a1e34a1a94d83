import pytest

from tensorfleet.launch.cli import build_parser, main, script_args


def test_missing_script_is_exit_2_with_one_line(capsys):
    assert main(["launch", "--ps", "1", "--workers", "1", "no/such/script.py"]) == 2
    err = capsys.readouterr().err
    assert "script 'no/such/script.py' does not exist" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, says", [
    (["launch", "--ps", "0", "x.py"], "argument --ps: 0 must be at least 1"),
    (["launch", "--workers", "two", "x.py"], "argument --workers: 'two' is not an integer"),
    (["launch", "--restart", "always", "x.py"], "invalid choice: 'always' (choose from 'on-failure', 'never')"),
    (["launch", "--dashboard", "70000", "x.py"], "70000 is not a port"),
    (["launch"], "the following arguments are required: SCRIPT|JOBFILE"),
    (["fly"], "invalid choice: 'fly'"),
])
def test_bad_flags_are_exit_2_with_one_line_saying_what_is_valid(argv, says, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "--help" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_script_args_after_double_dash():
    args = build_parser().parse_args(["launch", "train.py", "--", "--train_steps", "5"])
    assert args.target == "train.py" and script_args(args) == ["--train_steps", "5"]
    without_separator = build_parser().parse_args(["launch", "train.py", "--train_steps", "5"])
    assert script_args(without_separator) == ["--train_steps", "5"]
