"""A job's environment that no process can be given is refused when the job is submitted (issue 41): a value with a
NUL byte, or a variable over the kernel's 128 KiB, was accepted, and every task then failed to start (the job ended
"lost"). Now a 400 naming the variable and why, from the API, a job file, ``tensorfleet jobs submit`` and the form,
for an admin (who may set any variable) as for a user; nothing is stored."""

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

from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.launch.config import MAX_ENV_STRING_BYTES, JobConfig
from tensorfleet.testing.service import ADMIN_PASSWORD, running_service

PACED = Path(__file__).resolve().parent / "paced_job.py"
NUL = "its value holds a NUL byte, which no environment variable can hold: remove it"
LONG = "over the 128 KiB the kernel lets one variable hold"
TOO_LONG = "x" * MAX_ENV_STRING_BYTES  # with "NAME=" and its NUL: past the limit
CASES = [({"MY_SETTING": "a\x00b"}, f"env: MY_SETTING: {NUL}"), ({"OMP_NUM_THREADS": "1\x00"}, "env: OMP_NUM_THREADS: "
         + NUL), ({"MY_SETTING": TOO_LONG}, f"env: MY_SETTING: NAME=VALUE is 131,083 bytes, {LONG}"),
         ({"MY\x00NAME": "1"}, "env: 'MY\\x00NAME' is not a variable name"),
         ({"A=B": "1"}, "env: 'A=B' is not a variable name")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("env-values")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    shutil.copy(PACED, workspace / "paced_job.py")
    with running_service(tmp_path / "home", workspace) as service:
        yield service


@pytest.mark.parametrize("env, said", CASES, ids=["nul", "nul-allowed-name", "over-128k", "nul-in-name", "equals"])
def test_the_api_and_a_job_file_refuse_at_submit(served, env, said):
    admin = served.client()
    with pytest.raises(TensorfleetError, match=re.escape(said)):
        admin.call("POST", "/api/jobs", {"script": "paced_job.py", "workers": 1, "env": env})
    (name, value), = env.items()
    job_file = "script = \"paced_job.py\"\n[env]\n" + f"{_toml(name)} = {_toml(value)}\n"
    if len(job_file) > 64 * 1024:  # a job file is at most 64 KiB: such a value never fits in one
        said = "job file 'job.toml' is larger than 64 KiB"
    with pytest.raises(TensorfleetError, match=re.escape(said)):
        admin.call("POST", "/api/jobs", {"job_file": {"name": "job.toml", "text": job_file}})
    assert admin.call("GET", "/api/jobs")["jobs"] == []  # nothing stored, nothing to end "lost"


def _toml(text: str) -> str:
    return '"' + "".join(f"\\u{ord(c):04x}" if c in '\x00"\\' else c for c in text) + '"'


def test_jobs_submit_and_the_form_say_the_same(served, tmp_path):
    job_file = tmp_path / "job.toml"
    job_file.write_text('script = "paced_job.py"\n[env]\nMY_SETTING = "a\\u0000b"\n')
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "jobs", "submit", str(job_file), "--url",
                           served.url, "--token", served.token], capture_output=True, text=True, timeout=60,
                          env={**os.environ})
    assert done.returncode == 2 and f"env: MY_SETTING: {NUL}" in done.stderr, done.stderr

    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    browser.open(served.url + "/login", urllib.parse.urlencode({"user": "admin", "password": ADMIN_PASSWORD}).encode())
    page = browser.open(served.url + "/jobs/new").read().decode()
    csrf = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
    form = {"csrf": csrf, "script": "paced_job.py", "ps": "1", "workers": "1", "restart": "on-failure",
            "max_restarts": "3", "backend": "local", "env": "MY_SETTING=" + "x" * (200 * 1024)}
    with pytest.raises(urllib.error.HTTPError) as refused:
        browser.open(served.url + "/jobs/new", urllib.parse.urlencode(form).encode())
    assert refused.value.code == 400 and LONG in refused.value.read().decode()
    assert served.client().call("GET", "/api/jobs")["jobs"] == []


def test_launch_refuses_them_too_and_takes_the_largest_that_fits(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("")
    for env, said in CASES:
        with pytest.raises(ConfigError, match=re.escape(said)):
            JobConfig(str(script), env=env).validate()
    largest = {"MY_SETTING": "x" * (MAX_ENV_STRING_BYTES - len("MY_SETTING=") - 1)}
    JobConfig(str(script), env=largest).validate()
    assert subprocess.run([sys.executable, "-c", "pass"], env={**os.environ, **largest}, timeout=60).returncode == 0
