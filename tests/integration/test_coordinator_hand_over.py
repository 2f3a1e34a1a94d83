"""The files ``launch --coordinator-outside`` hands the coordinator cannot be planted nor hijacked (issue 41, item 4):
the token file was opened without ``O_EXCL|O_NOFOLLOW`` (another user's pre-made file received the token; a planted
symlink overwrote a victim's file), and ``join_fleet`` accepted a planted ``coordinator.json`` naming another fleet
and token. Now both files are new 0600 files renamed into a logdir only this user can write (refused otherwise, exit
2, nothing started), and ``join_fleet`` reads them only from such a logdir, owned by this user and private.

Other users are simulated by modes, ACLs (written as the ``system.posix_acl_access`` attribute, as setfacl does) and,
as root, files given to another uid."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet.backends.launcher import Launcher
from tensorfleet.backends.local import local_launcher
from tensorfleet.cluster.environment import COORDINATOR_FILE, COORDINATOR_TOKEN_FILE
from tensorfleet.coordinator.outside import join_fleet
from tensorfleet.errors import ConfigError
from tensorfleet.launch.config import JobConfig
from tensorfleet.testing.local_cluster import REPO
from tensorfleet.testing.acl import set_access_acl
from tensorfleet.wire import auth

SCRIPT = REPO / "examples" / "mnist_coordinator.py"
OTHER_UID = 54321
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")


def grant_write_by_acl(path: Path, uid: int = OTHER_UID) -> None:
    """What ``setfacl -m u:UID:rwx PATH`` does: an access ACL with a named user who may write (mask rwx)."""
    try:
        set_access_acl(path, uid)
    except OSError as exc:
        pytest.skip(f"this file system takes no POSIX ACL ({exc.strerror})")


def shared(logdir: Path, how: str) -> None:
    """Make ``logdir`` writable by others in one of the ways the check must see."""
    if how == "every user (sticky, as /tmp)":
        logdir.chmod(0o1777)
    elif how == "its group":
        logdir.chmod(0o770)
    elif how == "an ACL":
        grant_write_by_acl(logdir)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user takes root")
        os.chown(logdir, OTHER_UID, -1)


WAYS = ["every user (sticky, as /tmp)", "its group", "an ACL", "another user's folder"]
SAID = {"every user (sticky, as /tmp)": "every user can write it (mode 1777)", "its group": "its group (gid",
        "an ACL": f"an ACL lets user {OTHER_UID} write it", "another user's folder": "belongs to another user"}


def launch(logdir: Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorfleet.cli", "launch", "--coordinator-outside", "--ps", "1",
                           "--workers", "1", "--logdir", str(logdir), str(SCRIPT)],
                          capture_output=True, text=True, timeout=timeout_s, cwd=REPO)


def launcher_of(logdir: Path) -> Launcher:
    config = JobConfig(script=str(SCRIPT), ps=1, workers=1, coordinator="outside", logdir=str(logdir)).validate()
    return local_launcher(config, out=open(os.devnull, "w"))


def outside_record(launcher: Launcher):
    return next(record for record in launcher.supervisor.records if record.outside)


@pytest.mark.parametrize("how", WAYS)
def test_a_token_file_another_user_made_beforehand_never_receives_the_token(tmp_path, how):
    """The attack: in a logdir others can write, another user makes coordinator.token (mode 0666, theirs) before the
    launcher starts; the launcher wrote the token into it. Now: refused in one line, exit 2, before anything starts."""
    logdir = tmp_path / "logs"
    logdir.mkdir()
    planted = logdir / COORDINATOR_TOKEN_FILE
    planted.write_text("")
    planted.chmod(0o666)
    shared(logdir, how)
    done = launch(logdir)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"tensorfleet launch: error: --coordinator-outside: the logdir {logdir} is not "
                               "private: "), lines
    assert SAID[how] in lines[0] and ("use a folder of your own" if "another" in how else "chmod go-w") in lines[0]
    assert planted.read_text() == ""  # the token never reached their file
    assert sorted(p.name for p in logdir.iterdir()) == [COORDINATOR_TOKEN_FILE]  # nothing else written or started


def test_planted_links_are_replaced_never_followed_and_the_files_are_new_and_private(tmp_path):
    """The attack: a symlink at coordinator.token (or coordinator.json) pointing at a victim's file; the launcher
    wrote through it. Now each file is made new (O_EXCL|O_NOFOLLOW, 0600) under a random name and renamed over
    the link, which is replaced, not followed."""
    logdir, victim = tmp_path / "logs", tmp_path / "victim"
    logdir.mkdir()
    victim.write_text("precious")
    for name in (COORDINATOR_TOKEN_FILE, COORDINATOR_FILE):
        (logdir / name).symlink_to(victim)
    launcher = launcher_of(logdir)
    launcher._hand_over(outside_record(launcher))
    assert victim.read_text() == "precious"
    for name in (COORDINATOR_TOKEN_FILE, COORDINATOR_FILE):
        info = os.lstat(logdir / name)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, name
    assert (logdir / COORDINATOR_TOKEN_FILE).read_text() == launcher.token
    assert json.loads((logdir / COORDINATOR_FILE).read_text())["launcher_pid"] == os.getpid()
    assert not [p for p in logdir.iterdir() if ".tmp-" in p.name]  # nothing left over
    launcher._withdraw_hand_over()
    assert list(logdir.iterdir()) == []


def test_a_coordinator_json_that_cannot_be_written_is_one_line_and_exit_2(tmp_path):
    """It died with a traceback (PermissionError); now one line saying what to do, exit 2, nothing started and
    nothing left behind (the token file written before it is withdrawn)."""
    logdir = tmp_path / "logs"
    (logdir / COORDINATOR_FILE).mkdir(parents=True)  # in the way, and cannot be replaced by a file
    (logdir / COORDINATOR_FILE / "x").write_text("")
    done = launch(logdir)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (f"tensorfleet launch: error: --coordinator-outside: cannot write "
                                   f"{logdir / COORDINATOR_FILE} (Is a directory): give --logdir a folder of your own "
                                   "that you can write"), done.stderr
    assert sorted(p.name for p in logdir.iterdir()) == [COORDINATOR_FILE]


# --- join_fleet ---------------------------------------------------------------------------------------------------

def plant(logdir: Path, token: str = "their-token") -> None:
    """What another user leaves for a victim's join_fleet: their fleet (a live launcher: this test's pid) and token."""
    tf_config = {"cluster": {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:3"]},
                 "task": {"type": "chief", "index": 0}}
    (logdir / COORDINATOR_TOKEN_FILE).write_text(token)
    (logdir / COORDINATOR_TOKEN_FILE).chmod(0o600)
    (logdir / COORDINATOR_FILE).write_text(json.dumps({"tf_config": json.dumps(tf_config), "launcher_pid": os.getpid(),
                                                       "token_file": str(logdir / COORDINATOR_TOKEN_FILE)}))


@pytest.fixture
def no_token(monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    yield
    assert auth.TOKEN_ENV not in os.environ  # a refused join took no token


@pytest.mark.parametrize("how", WAYS)
def test_join_fleet_refuses_a_logdir_other_users_can_write(tmp_path, how, no_token):
    """The attack: another user plants coordinator.json (their fleet, their token) in a logdir they can write; the
    session joined it. Now refused, saying what is wrong and what to run."""
    logdir = tmp_path / "logs"
    logdir.mkdir()
    plant(logdir)
    shared(logdir, how)
    with pytest.raises(ConfigError, match=f"not joining: the logdir {logdir} is not private: .*another user could "
                                          "have planted a coordinator.json naming their fleet and token") as refused:
        join_fleet(logdir, timeout_s=5)
    assert SAID[how] in str(refused.value)


@pytest.mark.parametrize("which", [COORDINATOR_FILE, COORDINATOR_TOKEN_FILE])
@pytest.mark.parametrize("how, said", [
    ("group-writable", "is not private: its group (gid"), ("writable by everyone", "every user can write it"),
    ("an ACL", f"an ACL lets user {OTHER_UID} write it"), ("a symlink", "it is a symbolic link"),
    pytest.param("another user's", f"belongs to another user (uid {OTHER_UID})", marks=AS_ROOT)])
def test_join_fleet_refuses_files_that_are_not_this_users_alone(tmp_path, which, how, said, no_token):
    logdir = tmp_path / "logs"
    logdir.mkdir()
    plant(logdir)
    path = logdir / which
    if how == "group-writable":
        path.chmod(0o620)
    elif how == "writable by everyone":
        path.chmod(0o602)
    elif how == "an ACL":
        grant_write_by_acl(path)
    elif how == "a symlink":
        target = tmp_path / which
        path.rename(target)
        path.symlink_to(target)
    else:
        os.chown(path, OTHER_UID, -1)
    with pytest.raises(ConfigError, match=f"not joining: {path}") as refused:
        join_fleet(logdir, timeout_s=5)
    assert said in str(refused.value), refused.value


def test_join_fleet_refuses_a_token_file_others_can_read(tmp_path, no_token):
    logdir = tmp_path / "logs"
    logdir.mkdir()
    plant(logdir)
    (logdir / COORDINATOR_TOKEN_FILE).chmod(0o644)
    with pytest.raises(ConfigError, match=r"coordinator.token is not private: every user can read it \(mode 644\)"):
        join_fleet(logdir, timeout_s=5)


def test_what_the_launcher_hands_over_passes_join_fleets_checks(tmp_path):
    from tensorfleet.coordinator.outside import _read_own_file, private_logdir

    logdir = tmp_path / "logs"
    logdir.mkdir()
    launcher = launcher_of(logdir)
    launcher._hand_over(outside_record(launcher))
    with private_logdir(logdir) as directory:
        assert _read_own_file(directory, logdir / COORDINATOR_TOKEN_FILE, secret=True) == launcher.token
        assert json.loads(_read_own_file(directory, logdir / COORDINATOR_FILE, secret=False))["tf_config"]
    launcher._withdraw_hand_over()
