import os
import re
import shlex

import pytest

from tensorfleet.cli import main


def test_missing_script_is_exit_2_with_one_line(capsys):
    assert main(["launch", "--ps", "1", "--workers", "1", "no/such/script.py"]) == 2
    err = capsys.readouterr().err
    assert "script 'no/such/script.py' does not exist" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, says", [
    (["launch", "--ps", "0", "x.py"], "argument --ps: 0 must be at least 1"),
    (["launch", "--workers", "two", "x.py"], "argument --workers: 'two' is not an integer"),
    (["launch", "--restart", "always", "x.py"], "invalid choice: 'always' (choose from 'on-failure', 'never')"),
    (["launch", "--dashboard", "70000", "x.py"], "70000 is not a port"),
    (["launch"], "a SCRIPT or a job file (job.yaml / job.toml) is needed; usage: tensorfleet launch [FLAGS] "
                 "SCRIPT|JOBFILE [-- SCRIPT_ARGS ...]"),
    (["launch", "--dashboard"], "a SCRIPT or a job file (job.yaml / job.toml) is needed"),
    (["launch", "--dashboard=x.py", "examples/hello_cluster.py"], "argument --dashboard: 'x.py' is not an integer"),
    (["k8s", "render"], "the following arguments are required: SCRIPT "),
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


def test_a_missing_script_does_not_say_its_arguments_are_required(capsys):
    """Issue 29: 'tensorfleet launch' alone said SCRIPT_ARGS was required; none are ever needed."""
    for argv in (["launch"], ["launch", "--workers", "1"], ["k8s", "render", "--ps", "1"]):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert "SCRIPT_ARGS" not in err.split("usage:")[0] and "required: SCRIPT_ARGS" not in err, err


def dry_run(argv, capsys):
    """(what every task runs after the python executable, the dashboard line) of ``launch --dry-run ARGV``."""
    assert main(["launch", "--dry-run", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    command = next(line for line in lines if line.startswith("command of every task"))
    return command.split(": ", 1)[1].split(maxsplit=1)[1], next(line for line in lines if line.startswith("dashboard:"))


@pytest.mark.parametrize("argv, command, dashboard", [
    # Issue 29: '--dashboard SCRIPT' took the script as the port ("... is not an integer").
    (["--workers", "1", "--dashboard", "examples/hello_cluster.py"], "examples/hello_cluster.py",
     "dashboard: http://127.0.0.1:FREE_PORT/"),
    (["--dashboard", "examples/hello_cluster.py", "--last_step", "5"], "examples/hello_cluster.py --last_step 5",
     "dashboard: http://127.0.0.1:FREE_PORT/"),
    (["--dashboard", "examples/hello_cluster.py", "--", "8080"], "examples/hello_cluster.py 8080",
     "dashboard: http://127.0.0.1:FREE_PORT/"),
    (["--dashboard", "8123", "examples/hello_cluster.py"], "examples/hello_cluster.py",
     "dashboard: http://127.0.0.1:8123/"),
    (["--dashboard", "--workers", "1", "examples/hello_cluster.py"], "examples/hello_cluster.py",
     "dashboard: http://127.0.0.1:FREE_PORT/"),
    (["--dashboard=8124", "examples/hello_cluster.py"], "examples/hello_cluster.py",
     "dashboard: http://127.0.0.1:8124/"),
    (["examples/hello_cluster.py"], "examples/hello_cluster.py", "dashboard: off"),
])
def test_dashboard_takes_a_port_only_when_one_is_given(argv, command, dashboard, capsys):
    assert dry_run(argv, capsys) == (command, dashboard)


def test_dashboard_without_port_before_the_script_keeps_the_rule_for_flags_after_it(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["launch", "--dashboard", "examples/hello_cluster.py", "--workers", "1", "--dry-run"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    fixed = "tensorfleet launch --dashboard --workers 1 --dry-run examples/hello_cluster.py"
    assert fixed in err and "--dashboard=" not in err, err


def test_a_job_file_turns_the_dashboard_on_with_true(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "job.yaml").write_text("script: train.py\ndashboard: true\n")
    assert main(["launch", "--dry-run", "job.yaml"]) == 0
    assert "dashboard: http://127.0.0.1:FREE_PORT/" in capsys.readouterr().out


@pytest.mark.parametrize("cores, argv, warned", [
    (2, ["--workers", "50"], "tensorfleet launch: warning: 51 tasks (1 ps + 50 workers) on 2 core(s): they would "
                             "share the cores and the job would be slow\n"),
    (2, ["--ps", "1", "--workers", "3"], "warning: 4 tasks (1 ps + 3 workers) on 2 core(s)"),
    (2, ["--ps", "3", "--workers", "2"], "warning: 5 tasks (3 ps + 2 workers) on 2 core(s)"),
    (2, ["--ps", "1", "--workers", "2"], None),  # the quickstart's fleet on this machine: fine
    (4, ["--ps", "2", "--workers", "3"], None),
    (64, ["--workers", "50"], None),
])
def test_more_tasks_than_cores_is_a_warning_once_and_the_job_still_starts(cores, argv, warned, monkeypatch, capsys):
    from tensorfleet.cluster import machine
    monkeypatch.setattr(machine, "usable_cores", lambda: cores)
    assert main(["launch", "--dry-run", *argv, "examples/hello_cluster.py"]) == 0
    out, err = capsys.readouterr()
    assert "command of every task" in out  # what would start: it is not refused
    if warned is None:
        assert "warning" not in err, err
    else:
        assert err.count("warning") == 1 and warned in err, err
        assert "start" not in err, err  # issue 44: a dry run said "starting it anyway"


def test_more_tasks_than_cores_says_a_real_run_starts_anyway(monkeypatch, capsys):
    from tensorfleet.backends import launcher
    from tensorfleet.cluster import machine
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    monkeypatch.setattr(launcher, "launch", lambda config, **options: 0)  # what would start: nothing here
    assert main(["launch", "--workers", "50", "examples/hello_cluster.py"]) == 0
    assert capsys.readouterr().err == ("tensorfleet launch: warning: 51 tasks (1 ps + 50 workers) on 2 core(s): they "
                                       "will share the cores and the job will be slow; starting it anyway\n")
