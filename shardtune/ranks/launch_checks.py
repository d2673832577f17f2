"""Launch environment checks, run on every rank before the process group exists.

Rule: a launch that would hang, or leave ranks running after a peer died, is refused here with
an error that names the variable and the fix; a setting that only fails across machines is
warned about. Every check reads the environment (and the hostname's address) only, so each
rank decides alone and the same launch gives the same verdict on every rank of a node.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping

from shardtune.ranks.errors import ShardtuneError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
# Launchers that start every rank themselves: (their rank variable, their world-size variables).
FOREIGN_LAUNCHERS = {
    "srun": ("SLURM_PROCID", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")),
    "mpirun (Open MPI)": ("OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",)),
    "mpirun (MPICH/Intel MPI, PMI)": ("PMI_RANK", ("PMI_SIZE",)),
}
ASYNC_ERROR_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")  # torch reads them in this order


class LaunchError(ShardtuneError):
    """The launch cannot work as configured; the message names the variable and the fix."""


def check_launch(env: Mapping[str, str], *, backend: str | None) -> list[str]:
    """Refuse a broken launch (raises :class:`LaunchError`); returns warnings for this rank to log.

    ``env`` is the process environment as torchrun (or another launcher) left it, before any
    defaults are filled in; ``backend`` the one ``init_process_group`` will get.
    """
    _refuse_foreign_launcher(env)
    backend = backend or ""
    _refuse_nccl_without_watchdog(env, backend)
    return _loopback_hostname_warnings(env, backend)


def _refuse_foreign_launcher(env: Mapping[str, str]) -> None:
    """srun/mpirun started this process as one of several ranks, but without torchrun's
    variables the process group would be a separate one-rank job on every process."""
    if all(env.get(name) for name in TORCHRUN_VARS):
        return
    for launcher, (rank_var, size_vars) in FOREIGN_LAUNCHERS.items():
        if rank_var not in env:
            continue
        size = next((env[v] for v in size_vars if env.get(v)), None)
        if size is not None and size.isdigit() and int(size) <= 1:
            continue  # one task: a plain single-process run, as with python
        missing = [name for name in TORCHRUN_VARS if not env.get(name)]
        raise LaunchError(
            f"this process was started by {launcher} ({rank_var}={env[rank_var]}) but {', '.join(missing)} "
            "is not set, so every process would train alone. Launch one `shardtune run` (torchrun) per node "
            "from the job script (e.g. `srun --ntasks-per-node=1 shardtune run --nnodes $SLURM_NNODES "
            "--nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint <first node>:29400 ...`), or export "
            "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process from the launcher's "
            "variables."
        )


def _refuse_nccl_without_watchdog(env: Mapping[str, str], backend: str) -> None:
    """With async error handling off, NCCL's watchdog cannot end ranks whose peer died: they
    would wait in the collective forever instead of failing after ``process_group_timeout_s``."""
    if "nccl" not in backend:
        return
    name = next((v for v in ASYNC_ERROR_VARS if env.get(v, "").strip()), None)
    if name is not None and env[name].strip() == "0":
        raise LaunchError(
            f"{name}=0 turns off NCCL's async error handling: when a rank dies, the others would hang in "
            f"their next collective instead of ending after process_group_timeout_s. Unset {name} (or set it "
            "to 3, the default) so NCCL's watchdog ends the job."
        )


def _loopback_hostname_warnings(env: Mapping[str, str], backend: str) -> list[str]:
    """gloo binds to the address this host's name resolves to; a loopback address there (a
    common /etc/hosts default) is unreachable from other nodes, so their gloo groups hang."""
    if "gloo" not in backend or env.get("GLOO_SOCKET_IFNAME") or not _several_nodes(env):
        return []
    master = _address_of(env.get("MASTER_ADDR", ""))
    if master is None or _is_loopback(master):  # the nodes meet on this host: they all are on it
        return []
    hostname = socket.gethostname()
    address = _address_of(hostname)
    if address is None or not _is_loopback(address):  # unresolvable: gloo picks an interface and says so
        return []
    warning = (
        f"this host's name {hostname!r} resolves to the loopback address {address}, which gloo binds to: other "
        "nodes cannot reach it and the job will hang at startup. Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) "
        "to the network interface the nodes share (e.g. GLOO_SOCKET_IFNAME=eth0), or map the hostname to that "
        "interface's address in /etc/hosts."
    )
    return [warning]


def _several_nodes(env: Mapping[str, str]) -> bool:
    """True when torchrun's variables say the ranks span more than one node."""
    groups = env.get("GROUP_WORLD_SIZE", "")
    if groups.isdigit() and int(groups) > 1:
        return True
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    return world.isdigit() and local.isdigit() and int(world) > int(local)


def _address_of(name: str) -> str | None:
    """The address ``name`` (a hostname or an address) resolves to; None when it does not."""
    try:
        return socket.gethostbyname(name) if name else None
    except OSError:
        return None


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
