import pytest

from tensorfleet.launch.cli import build_parser, main, script_args


def test_missing_script_is_exit_2(capsys):
    assert main(["launch", "--ps", "1", "--workers", "1", "no/such/script.py"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["launch", "--ps", "0", "x.py"], ["launch", "--workers", "two", "x.py"],
                                  ["launch"], ["fly"]])
def test_bad_flags_are_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert "error" in capsys.readouterr().err


def test_script_args_after_double_dash_and_env_defaults(monkeypatch):
    monkeypatch.setenv("TENSORFLEET_WORKERS", "3")
    args = build_parser().parse_args(["launch", "train.py", "--", "--train_steps", "5"])
    assert args.workers == 3 and args.ps == 1
    assert args.script == "train.py" and script_args(args) == ["--train_steps", "5"]
    without_separator = build_parser().parse_args(["launch", "train.py", "--train_steps", "5"])
    assert script_args(without_separator) == ["--train_steps", "5"]
