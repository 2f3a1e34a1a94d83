"""Which environment variables a job's tasks may be given, and by whom.

A job's ``env`` reaches every task's process, and many variables run code there before any script
does: the interpreter's (``PYTHONSTARTUP``, ``PYTHONPATH``, ``PYTHONWARNINGS`` naming a module to
import), the dynamic linker's (``LD_PRELOAD``), libraries' (``BROWSER``, ``OPENSSL_CONF``,
``NCCL_NET_PLUGIN``, ``GCONV_PATH``). Code run so runs as the service's user: it can read the
service's database and every running job's token. A list of what is refused would always miss one,
so the rule is a list of what is allowed:

* a user who is not an admin may set only the variables of ``ALLOWED`` (thread counts, Python's
  harmless switches, gRPC's and NCCL's logging and interface choices, CUDA's determinism switches,
  tensorfleet's own tuning), each name as written here;
* an admin, who can run anything on the service's machine anyway, may set any variable but those
  the service sets for every task itself (``RESERVED``).

It holds wherever a job's settings come from (the form, the API, a job file, ``tensorfleet jobs
submit``) and for whoever makes the job: a restart or a clone is checked against the rights of the
user who asks for it, not of the job's first owner.
"""

from __future__ import annotations

import re
from typing import Mapping

from tensorfleet.errors import ConfigError
from tensorfleet.launch.config import check_env_strings

ALLOWED: frozenset[str] = frozenset({
    # threads of the math libraries
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
    "OMP_PROC_BIND", "OMP_PLACES",
    # Python switches that run nothing
    "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE",
    # logging and interfaces of gRPC, NCCL and gloo
    "GRPC_VERBOSITY", "GRPC_TRACE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "GLOO_SOCKET_IFNAME",
    # CUDA and torch determinism and debugging
    "CUBLAS_WORKSPACE_CONFIG", "CUDA_LAUNCH_BLOCKING", "TORCH_SHOW_CPP_STACKTRACES",
    # tensorfleet's own tuning
    "TENSORFLEET_BUSY_POLL_US", "TENSORFLEET_SHARED_MEMORY", "TENSORFLEET_PS_MEMORY_BUDGET",
})
RESERVED: frozenset[str] = frozenset({
    "TF_CONFIG", "TENSORFLEET_TOKEN", "TENSORFLEET_TOKEN_FILE", "TENSORFLEET_STATUS_DIR", "TENSORFLEET_LOGDIR",
    "TENSORFLEET_MODE", "TENSORFLEET_DENSE", "CUDA_VISIBLE_DEVICES",
})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def check_job_env(env: Mapping[str, object], *, admin: bool) -> None:
    """Raise ConfigError naming every variable of ``env`` that this user may not give a job's tasks, or that no
    process can be given (a NUL byte, a string over the kernel's 128 KiB)."""
    bad_names = [name for name in env if not isinstance(name, str) or not _NAME.fullmatch(name)]
    if bad_names:
        raise ConfigError(f"env: {', '.join(repr(n)[:60] for n in bad_names)} is not a variable name "
                          "(letters, digits and _, not starting with a digit)")
    check_env_strings({name: str(value) for name, value in env.items()})  # a NUL, over 128 KiB: no task could start
    reserved = sorted(name for name in env if name in RESERVED)
    if reserved:
        raise ConfigError(f"env: {', '.join(reserved)} {'is' if len(reserved) == 1 else 'are'} set by the service "
                          "for every task and cannot be given")
    if admin:
        return
    refused = sorted(name for name in env if name not in ALLOWED)
    if refused:
        raise ConfigError(f"env: {', '.join(refused)} may not be set by a user who is not an admin (a variable "
                          f"can run code in every task, as the service's user); allowed: {', '.join(sorted(ALLOWED))}")
