"""A job's environment cannot run code (issue 28, item 1): a signed-in user who is not an admin ran a shell command
as the service's user with PYTHONWARNINGS=ignore::antigravity.X and BROWSER=...; LD_PRELOAD, PYTHONPATH and
PYTHONSTARTUP were taken too. Now such a user may set only the allowed variables, wherever the settings come from
(the API, a job file, `jobs submit`, the form) and for a restart or clone of anyone's job."""

from __future__ import annotations

import http.cookiejar
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tensorfleet.errors import TensorfleetError
from tensorfleet.testing.service import running_service

pytestmark = pytest.mark.cluster
PACED = Path(__file__).resolve().parent / "paced_job.py"
BOB_PASSWORD = "bob-password-for-tests"
CODE_RUNNING = [{"PYTHONWARNINGS": "ignore::antigravity.X"}, {"BROWSER": "sh -c 'touch /tmp/owned'"},
                {"LD_PRELOAD": "/tmp/evil.so"}, {"PYTHONPATH": "/tmp"}, {"PYTHONSTARTUP": "/tmp/evil.py"}]


@pytest.fixture
def served(tmp_path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    shutil.copy(PACED, workspace / "paced_job.py")
    with running_service(tmp_path / "home", workspace) as service:
        service.service.accounts.add_user("bob", BOB_PASSWORD)
        bob = service.client(service.service.accounts.new_api_token("bob"))
        yield service, bob


def fields(env: dict) -> dict:
    return {"script": "paced_job.py", "args": ["--last_step", "100000"], "workers": 1, "env": env}


@pytest.mark.parametrize("env", CODE_RUNNING, ids=lambda env: next(iter(env)))
def test_a_user_cannot_give_a_job_a_variable_that_runs_code(served, env):
    service, bob = served
    name = next(iter(env))
    with pytest.raises(TensorfleetError, match=f"env: {name} may not be set by a user who is not an admin"):
        bob.call("POST", "/api/jobs", fields(env))
    job_file = f"script: paced_job.py\nenv: {{{name}: x}}\n"
    with pytest.raises(TensorfleetError, match=f"env: {name} may not be set"):
        bob.call("POST", "/api/jobs", {"job_file": {"name": "job.yaml", "text": job_file}})
    assert bob.call("GET", "/api/jobs")["jobs"] == []  # nothing stored, nothing started


def test_allowed_variables_are_taken_and_an_admin_may_set_others_but_not_the_services_own(served):
    service, bob = served
    job = bob.call("POST", "/api/jobs", fields({"OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR"}))
    assert job["config"]["env"]["OMP_NUM_THREADS"] == "1"
    admin = service.client()
    assert admin.call("POST", "/api/jobs", fields({"MY_DATA_DIR": "/data"}))["config"]["env"] == {
        "MY_DATA_DIR": "/data"}
    with pytest.raises(TensorfleetError, match="TF_CONFIG is set by the service for every task"):
        admin.call("POST", "/api/jobs", fields({"TF_CONFIG": "{}"}))
    with pytest.raises(TensorfleetError, match="is not a variable name"):
        admin.call("POST", "/api/jobs", fields({"A B": "1"}))
    for job_id in (job["id"], job["id"] + 1):
        admin.call("POST", f"/api/jobs/{job_id}/stop", {})


def test_a_restart_or_clone_is_checked_against_the_rights_of_who_asks(served):
    service, bob = served
    admin = service.client()
    theirs = admin.call("POST", "/api/jobs", fields({"MY_DATA_DIR": "/data"}))["id"]
    with pytest.raises(TensorfleetError, match="MY_DATA_DIR may not be set"):
        bob.call("POST", f"/api/jobs/{theirs}/restart", {})
    with pytest.raises(TensorfleetError, match="MY_DATA_DIR may not be set"):
        bob.call("POST", f"/api/jobs/{theirs}/clone", {})
    clone = bob.call("POST", f"/api/jobs/{theirs}/clone", {"env": {}})  # without it: bob's own job
    assert clone["owner"] == "bob" and clone["config"]["env"] == {}
    for job_id in (theirs, clone["id"]):
        admin.call("POST", f"/api/jobs/{job_id}/stop", {})


def test_jobs_submit_and_the_form_say_the_same(served, tmp_path):
    service, bob = served
    job_file = tmp_path / "job.yaml"
    job_file.write_text("script: paced_job.py\nenv: {PYTHONSTARTUP: /tmp/evil.py}\n")
    token = service.service.accounts.new_api_token("bob")
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "jobs", "submit", str(job_file),
                           "--url", service.url, "--token", token], capture_output=True, text=True, timeout=60,
                          env={**os.environ})
    assert done.returncode != 0 and "PYTHONSTARTUP may not be set" in done.stderr, done.stderr

    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    browser.open(service.url + "/login", urllib.parse.urlencode({"user": "bob", "password": BOB_PASSWORD}).encode())
    page = browser.open(service.url + "/jobs/new").read().decode()
    csrf = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
    form = {"csrf": csrf, "script": "paced_job.py", "ps": "1", "workers": "1", "mode": "async",
            "restart": "on-failure", "max_restarts": "3", "backend": "local", "env": "LD_PRELOAD=/tmp/evil.so"}
    with pytest.raises(urllib.error.HTTPError) as refused:
        browser.open(service.url + "/jobs/new", urllib.parse.urlencode(form).encode())
    assert refused.value.code == 400 and "LD_PRELOAD may not be set" in refused.value.read().decode()
    assert bob.call("GET", "/api/jobs")["jobs"] == []


def test_a_script_name_with_a_nul_is_a_400_not_a_500(served):
    _, bob = served
    with pytest.raises(TensorfleetError, match="cannot hold a NUL"):
        bob.call("POST", "/api/jobs", {"script": "paced\x00job.py"})
