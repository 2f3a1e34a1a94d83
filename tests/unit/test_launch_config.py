"""Launch settings from job files, environment and flags; GPU assignment; the console and progress line."""

import io
from pathlib import Path

import pytest

from tensorfleet.dashboard.picture import FleetPicture
from tensorfleet.errors import ConfigError
from tensorfleet.launch.config import JobConfig, job_config, load_job_file
from tensorfleet.launch.console import CLEAR_LINE, Console
from tensorfleet.cluster.machine import gpu_assignment
from tensorfleet.launch.monitor import format_seconds, progress_line

NO_FLAGS = {"ps": None, "workers": None, "mode": None}


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("print('hi')\n")
    return "train.py"


def test_yaml_and_toml_job_files_give_the_same_job(script):
    Path("job.yaml").write_text("script: train.py\nargs: [--train_steps, 2000]\nps: 2\nworkers: 3\nmode: sync\n"
                                "max-restarts: 5\nenv: {OMP_NUM_THREADS: 1}\n")
    Path("job.toml").write_text('script = "train.py"\nargs = ["--train_steps", "2000"]\nps = 2\nworkers = 3\n'
                                'mode = "sync"\nmax_restarts = 5\nenv = { OMP_NUM_THREADS = "1" }\n')
    from_yaml, from_toml = (job_config(name, None, NO_FLAGS, environ={}) for name in ("job.yaml", "job.toml"))
    assert from_yaml == from_toml
    assert from_yaml.args == ["--train_steps", "2000"] and from_yaml.env == {"OMP_NUM_THREADS": "1"}
    assert (from_yaml.ps, from_yaml.workers, from_yaml.mode, from_yaml.max_restarts) == (2, 3, "sync", 5)
    assert from_yaml.restart_policy.max_restarts == 5 and from_yaml.job_name == "train"


def test_flags_beat_environment_which_beats_the_job_file(script):
    Path("job.yaml").write_text("script: train.py\nworkers: 3\nps: 2\nrestart: never\n")
    config = job_config("job.yaml", None, {"workers": 5, "ps": None},
                        environ={"TENSORFLEET_WORKERS": "4", "TENSORFLEET_PS": "3", "TENSORFLEET_MODE": "sync"})
    assert (config.workers, config.ps, config.mode, config.restart) == (5, 3, "sync", "never")


@pytest.mark.parametrize("text, says", [
    ("script: train.py\nworker: 2\n", "unknown field(s) worker (did you mean workers?); valid fields: args, backend, "
                                     "coordinator, dashboard"),
    ("script: train.py\nworkers: 0\n", "workers must be at least 1, got 0"),
    ("script: train.py\nworkers: two\n", "workers must be an integer, got 'two'"),
    ("script: train.py\nmode: semi\n", "mode 'semi' is not valid: use 'sync' or 'async'"),
    ("script: train.py\nrestart: always\n", "restart 'always' is not valid: use one of on-failure, never"),
    ("script: missing.py\n", "script 'missing.py' does not exist"),
    ("ps: 1\n", "names no script"),
    ("script: train.py\nargs: --steps 5\n", "args must be a list of strings"),
    ("script: train.py\nenv: [A]\n", "env must map names to strings"),
    ("- a\n- b\n", "must be a mapping of fields"),
    ("script: [unclosed\n", "is not valid YAML"),
])
def test_bad_job_files_say_what_is_wrong_and_what_is_valid(script, text, says):
    Path("job.yaml").write_text(text)
    with pytest.raises(ConfigError) as caught:
        job_config("job.yaml", None, NO_FLAGS, environ={})
    assert says in str(caught.value)


@pytest.mark.parametrize("name, text, says", [
    ("job.yaml", "script: train.py\nworkers: [1, 2\n", "job file 'job.yaml' is not valid YAML: job.yaml:3:1: expected "
     "',' or ']', but got '<stream end>' (while parsing a flow sequence at line 2, column 10)"),
    ("job.yaml", "script: train.py\n  ps: 1\n", "job file 'job.yaml' is not valid YAML: job.yaml:2:5: mapping values "
     "are not allowed here"),
    ("job.yaml", "script: train.py\nname: \x07\n", "job.yaml:2:7: unacceptable character #x0007"),
    ("job.toml", 'script = "train.py"\nps = 1\nps = 2\n', "job file 'job.toml' is not valid TOML: job.toml:3:7: "
     "Cannot overwrite a value"),
    ("job.toml", 'script = "train.py"\nps = [\n', "job file 'job.toml' is not valid TOML: job.toml:3:1: Invalid value"),
])
def test_a_job_file_that_does_not_parse_says_where_as_file_line_column(script, name, text, says, capsys):
    """Issue 44: pyyaml's line and column were lost (only 'while parsing a flow sequence' was left)."""
    from tensorfleet.cli import main
    Path(name).write_text(text)
    assert main(["launch", "--dry-run", name]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("text, says", [
    ("script: train.py\nwokers: 3\nmax-restart: 2\n", "unknown field(s) max_restart (did you mean max_restarts?), "
                                                       "wokers (did you mean workers?); valid fields: args,"),
    ("script: train.py\nzzz: 1\n", "unknown field(s) zzz; valid fields: args,"),  # nothing close: no guess
])
def test_an_unknown_job_file_field_suggests_the_closest_valid_one(script, text, says):
    """Issue 44: an unknown flag got 'did you mean'; an unknown job-file field did not."""
    Path("job.yaml").write_text(text)
    with pytest.raises(ConfigError) as caught:
        job_config("job.yaml", None, NO_FLAGS, environ={})
    assert says in str(caught.value)


@pytest.mark.parametrize("value, dashboard", [("true", 0), ("false", None), ("8080", 8080), ("0", 0)])
def test_a_job_files_dashboard_is_true_for_a_free_port_or_a_port(script, value, dashboard):
    """Issue 29: the bare '--dashboard' (a free port) has its job-file form, 'dashboard: true'."""
    Path("job.yaml").write_text(f"script: train.py\ndashboard: {value}\n")
    Path("job.toml").write_text(f'script = "train.py"\ndashboard = {value}\n')
    assert job_config("job.yaml", None, NO_FLAGS, environ={}).dashboard == dashboard
    assert job_config("job.toml", None, NO_FLAGS, environ={}).dashboard == dashboard


def test_a_job_files_dashboard_that_is_neither_says_what_is_valid(script):
    Path("job.yaml").write_text("script: train.py\ndashboard: somewhere\n")
    with pytest.raises(ConfigError, match=r"dashboard must be a port \(0..65535; 0 or true: a free one\), "
                                          r"got 'somewhere'"):
        job_config("job.yaml", None, NO_FLAGS, environ={})


def test_bad_environment_and_missing_job_file_are_config_errors(script):
    with pytest.raises(ConfigError, match="TENSORFLEET_WORKERS='many' must be an integer"):
        job_config(None, "train.py", NO_FLAGS, environ={"TENSORFLEET_WORKERS": "many"})
    with pytest.raises(ConfigError, match="job file 'nope.yaml' does not exist"):
        load_job_file("nope.yaml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Path("bad.toml").write_text("ps = [\n")
        load_job_file("bad.toml")


def test_cli_with_a_bad_job_file_exits_2_and_starts_nothing(script, capsys):
    from tensorfleet.cli import main
    Path("job.yaml").write_text("script: train.py\nlogdir: logs\nworkers: -1\n")
    assert main(["launch", "job.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "tensorfleet launch: error: workers must be at least 1, got -1"
    assert not Path("logs").exists()


@pytest.mark.parametrize("coordinator", [True, "outside"])
def test_a_coordinator_job_tells_its_tasks_and_a_between_graph_script_refuses_it(script, coordinator, monkeypatch,
                                                                                capsys):
    """Issue 44: a between-graph script (run_task) under --coordinator trained on every worker by itself, silently."""
    import argparse

    from tensorfleet.cluster.environment import IN_GRAPH_ENV
    from tensorfleet.backends.local import local_launcher
    from tensorfleet.launch.task import run_task
    launcher = local_launcher(JobConfig("train.py", ps=1, workers=1, coordinator=coordinator).validate())
    assert {launcher.task_env(task).get(IN_GRAPH_ENV) for task in launcher.tasks} == {"1"}
    assert IN_GRAPH_ENV not in local_launcher(JobConfig("train.py", ps=1, workers=1).validate()).task_env(
        launcher.tasks[0])
    monkeypatch.setenv(IN_GRAPH_ENV, "1")
    trained = []
    assert run_task(argparse.Namespace(), lambda *task: trained.append(task)) == 2  # 2: the launcher never retries
    err = capsys.readouterr().err
    assert not trained and len(err.strip().splitlines()) == 1, err
    assert "this script is between-graph" in err and "launch it without --coordinator, or write it with " \
        "tfl.run_coordinated" in err


def test_gpus_are_split_into_disjoint_blocks_or_refused():
    assert gpu_assignment(2, 3, available=8) == ["0,1", "2,3", "4,5"]
    assert gpu_assignment(1, 2, available=2) == ["0", "1"]
    with pytest.raises(ConfigError, match="needs 4 GPU\\(s\\); this machine has 0"):
        gpu_assignment(2, 2, available=0)


def test_dry_run_lists_gpus_per_worker(script, capsys):
    from tensorfleet.backends.local import local_launcher
    config = JobConfig("train.py", ps=1, workers=2, gpus_per_worker=2).validate()
    text = local_launcher(config, gpus_available=4).dry_run_text()
    assert "CUDA_VISIBLE_DEVICES=0,1" in text and "CUDA_VISIBLE_DEVICES=2,3" in text
    assert "CUDA_VISIBLE_DEVICES=''" in text  # the ps sees no GPU


@pytest.mark.parametrize("cores, expected", [(2, "2000"), (3, "2000"), (1, "0")])
def test_data_connections_poll_only_when_every_task_has_a_core(script, monkeypatch, cores, expected):
    from tensorfleet.backends.local import local_launcher
    from tensorfleet.cluster import machine
    monkeypatch.delenv("TENSORFLEET_BUSY_POLL_US", raising=False)
    monkeypatch.setattr(machine, "usable_cores", lambda: cores)
    launcher = local_launcher(JobConfig("train.py", ps=1, workers=1).validate())
    assert {launcher.task_env(task)["TENSORFLEET_BUSY_POLL_US"] for task in launcher.tasks} == {expected}
    monkeypatch.setenv("TENSORFLEET_BUSY_POLL_US", "50")  # the user's own choice is left alone
    assert all("TENSORFLEET_BUSY_POLL_US" not in launcher.task_env(task) for task in launcher.tasks)


@pytest.mark.parametrize("text", ["-1", "fast", "1e9"])
def test_a_bad_busy_poll_setting_says_what_to_give(monkeypatch, text):
    from tensorfleet.wire.rpc import WireOptions
    monkeypatch.setenv("TENSORFLEET_BUSY_POLL_US", text)
    with pytest.raises(ConfigError, match=r"TENSORFLEET_BUSY_POLL_US=.*: give microseconds in 0\.\.100000"):
        WireOptions()


def snapshot(**job):
    base = {"global_step": 4200, "target_step": 10000, "steps_per_sec": 513.0, "examples_per_sec": 51300.0,
            "eta_s": 11.3, "restarts": 1, "mode": "async", "dropped_stale": 0}
    tasks = [{"state": "running"}, {"state": "running"}, {"state": "restarting"}]
    return FleetPicture.read({"job": {**base, **job}, "tasks": tasks})


def test_progress_line_has_step_target_rates_eta_and_task_states():
    assert progress_line(snapshot()) == ("step 4,200/10,000 (42%) | 51,300 ex/s | 513 steps/s | ETA 11s | "
                                         "2/3 tasks running | 1 restarting | 1 restart")
    line = progress_line(snapshot(target_step=None, examples_per_sec=None, eta_s=None, restarts=0,
                                  mode="sync", dropped_stale=7))
    assert line == "step 4,200 | 513 steps/s | 2/3 tasks running | 1 restarting | 7 stale dropped"
    assert [format_seconds(s) for s in (9.6, 75, 3725)] == ["10s", "1m15s", "1h02m"]


def test_console_keeps_the_progress_line_at_the_bottom_of_a_terminal():
    out = io.StringIO()
    console = Console(out, interactive=True)
    console.progress("step 1")
    console.line("[worker:0] hello")
    console.close()
    assert out.getvalue() == (f"{CLEAR_LINE}[launch] step 1{CLEAR_LINE}[worker:0] hello\n[launch] step 1\n")


def test_console_prints_progress_at_most_every_interval_in_a_log():
    out = io.StringIO()
    console = Console(out, interactive=False, every_s=3600)
    console.progress("step 1")
    console.progress("step 2")
    assert out.getvalue() == "[launch] step 1\n"


def test_a_jobs_dense_setting_reaches_every_task_and_the_slurm_script_and_a_bad_one_is_refused(script, monkeypatch):
    """Issue 40: `dense: allreduce` in a job file (or --dense, TENSORFLEET_DENSE) is the default of the scripts'
    --dense; the launch side's choices are the Replica's."""
    import argparse

    from tensorfleet.launch.config import DENSE_HOMES
    from tensorfleet.backends.local import local_launcher
    from tensorfleet.backends.slurm import rendered_script
    from tensorfleet.worker import options
    from tensorfleet.worker.flags import add_training_flags
    assert DENSE_HOMES == options.DENSE_HOMES
    Path("job.yaml").write_text("script: train.py\ndense: allreduce\n")
    config = job_config("job.yaml", None, NO_FLAGS, environ={})
    launcher = local_launcher(config)
    assert {launcher.task_env(task).get("TENSORFLEET_DENSE") for task in launcher.tasks} == {"allreduce"}
    assert "export TENSORFLEET_DENSE=allreduce" in rendered_script(config)
    monkeypatch.setenv("TENSORFLEET_DENSE", "allreduce")  # what the task finds in its environment
    parser = argparse.ArgumentParser()
    add_training_flags(parser)
    assert parser.parse_args([]).dense == "allreduce"
    with pytest.raises(ConfigError, match="dense 'ring' is not valid: use 'ps'"):
        JobConfig("train.py", dense="ring").validate()


def test_launch_and_slurm_render_take_dense_on_the_command_line(script, capsys):
    from tensorfleet.cli import main
    assert main(["launch", "--dry-run", "--dense", "allreduce", "--ps", "1", "--workers", "1", "train.py"]) == 0
    assert "TENSORFLEET_DENSE=allreduce" in capsys.readouterr().out
    assert main(["slurm", "render", "--dense", "allreduce", "train.py"]) == 0
    assert "export TENSORFLEET_DENSE=allreduce" in capsys.readouterr().out


def test_every_backend_a_job_may_name_has_an_engine_and_only_those():
    """``launch --backend`` and a job file's ``backend:`` name an engine of backends/__init__.py, the one registry."""
    from tensorfleet.backends import ENGINES
    from tensorfleet.launch.config import BACKENDS

    assert set(ENGINES) == set(BACKENDS)
