import os
import re
import shlex

import pytest

from tensorfleet.launch.cli import main


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


def test_script_args_after_double_dash_are_the_scripts_verbatim(capsys):
    assert main(["launch", "--dry-run", "examples/hello_cluster.py", "--last_step", "5", "--", "--sync",
                 "--dry-run"]) == 0
    command = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("command of every task"))
    assert command.endswith("examples/hello_cluster.py --last_step 5 --sync --dry-run")


@pytest.mark.parametrize("argv, fixed", [
    (["launch", "examples/hello_cluster.py", "--ps", "1", "--workers", "1", "--dry-run"],
     "tensorfleet launch --ps 1 --workers 1 --dry-run examples/hello_cluster.py"),
    (["launch", "--ps", "1", "examples/hello_cluster.py", "--last_step", "5", "--workers=1", "--sync", "--",
      "--log_device_placement"],
     "tensorfleet launch --ps 1 --workers=1 --sync examples/hello_cluster.py -- --last_step 5 --log_device_placement"),
    (["k8s", "render", "--ps", "1", "--workers", "1", "--image", "repo/t:1", "examples/mnist_mlp.py", "-o",
      "fleet.yaml"],
     "tensorfleet k8s render --ps 1 --workers 1 --image repo/t:1 -o fleet.yaml examples/mnist_mlp.py"),
])
def test_our_flags_after_the_script_are_refused_with_the_corrected_command(argv, fixed, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)  # a --dry-run here must not start anything: it never gets past the argument line
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and fixed in err, err


def test_the_corrected_command_does_what_was_meant(tmp_path, capsys):
    out = tmp_path / "fleet.yaml"
    with pytest.raises(SystemExit):
        main(["k8s", "render", "--ps", "1", "--workers", "1", "--image", "repo/t:1", "train.py", "-o", str(out)])
    fixed = capsys.readouterr().err.split("flags before it: ")[1].split(" (script flags")[0]
    assert main(shlex.split(fixed)[1:]) == 0
    rendered = out.read_text()
    assert "kind: Job" in rendered and "-o" not in rendered and capsys.readouterr().out == ""


@pytest.mark.parametrize("argv, says", [
    (["launch", "--worker", "2", "x.py"], "--worker (did you mean --workers?)"),
    (["launch", "--max-restart", "2", "x.py"], "--max-restart (did you mean --max-restarts?)"),
    (["k8s", "render", "--imag", "i", "x.py"], "--imag (did you mean --image?)"),
])
def test_flags_are_never_abbreviated_and_an_unknown_one_lists_the_valid_ones(argv, says, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "valid flags: " in err and len(err.strip().splitlines()) == 1, err
    valid = err.split("valid flags: ")[1]
    assert ("--workers" in valid) if argv[0] == "launch" else ("--image" in valid)


def test_version(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0 and re.fullmatch(r"tensorfleet \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_launch_help_names_its_positional_arguments_as_the_usage_line_does(capsys):
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    text = capsys.readouterr().out
    usage = text.splitlines()[0]
    assert "SCRIPT|JOBFILE" in usage and "SCRIPT_ARGS" in usage
    positionals = text.split("positional arguments:")[1].split("options:")[0]
    assert "SCRIPT|JOBFILE" in positionals and "SCRIPT_ARGS" in positionals
    assert "TARGET" not in text and "script_args" not in text


def test_ps_help_has_no_markup(capsys):
    from tensorfleet.ps.__main__ import main as ps_main
    with pytest.raises(SystemExit):
        ps_main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and "--ps_hosts" in text


def test_the_launchers_own_grpc_is_silent_and_the_tasks_log_their_errors(monkeypatch, capsys):
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    assert main(["launch", "--dry-run", "examples/hello_cluster.py"]) == 0
    assert os.environ["GRPC_VERBOSITY"] == "NONE"  # no unprefixed C-core line between the task lines
    assert capsys.readouterr().out.count("GRPC_VERBOSITY=ERROR") == 3  # each task: errors, into its log
