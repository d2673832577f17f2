"""Launch checks (no process group is created): srun/mpirun without torchrun's variables,
NCCL without async error handling, a hostname on loopback across nodes; and what
``init_distributed`` hands ``init_process_group`` on CUDA."""

from __future__ import annotations

import socket

import pytest
import torch

from shardtune.ranks import process
from shardtune.ranks.launch_checks import LaunchError, check_launch

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "node0"}
NCCL = "cpu:gloo,cuda:nccl"


@pytest.fixture
def hostname_on(monkeypatch):
    """Make this host's name resolve to the given address."""

    def set_address(address: str) -> None:
        monkeypatch.setattr(socket, "gethostname", lambda: "node1")
        table = {"node1": address, "node0": "10.0.0.1", "127.0.0.1": "127.0.0.1"}

        def resolve(name: str) -> str:
            if name not in table:
                raise socket.gaierror(f"unknown host {name}")
            return table[name]

        monkeypatch.setattr(socket, "gethostbyname", resolve)

    return set_address


@pytest.mark.parametrize(
    "launcher",
    [
        {"SLURM_PROCID": "2", "SLURM_NTASKS": "16"},
        {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "1"},
        {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8"},
        {"PMI_RANK": "5", "PMI_SIZE": "8"},
        {"PMI_RANK": "0"},  # size unknown: several tasks may be running
    ],
)
def test_srun_or_mpirun_without_torchrun_variables_is_refused(launcher):
    rank_var = next(k for k in launcher if k.endswith(("PROCID", "_RANK")))
    with pytest.raises(LaunchError, match=rf"{rank_var}=.*RANK, WORLD_SIZE, MASTER_ADDR.*shardtune run"):
        check_launch(launcher, backend="gloo")
    partial = {**launcher, "RANK": "0", "WORLD_SIZE": "8"}  # MASTER_ADDR still missing
    with pytest.raises(LaunchError, match=r"but MASTER_ADDR is not set"):
        check_launch(partial, backend="gloo")


def test_single_task_srun_plain_python_and_torchrun_under_srun_are_accepted():
    assert check_launch({}, backend="gloo") == []  # plain python: a one-process group, as before
    assert check_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, backend="gloo") == []
    under_srun = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", **TORCHRUN, "MASTER_ADDR": "127.0.0.1"}
    assert check_launch(under_srun, backend="gloo") == []


@pytest.mark.parametrize("name", ["TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"])
def test_nccl_without_async_error_handling_is_refused(name):
    env = {**TORCHRUN, "MASTER_ADDR": "127.0.0.1", name: "0"}
    with pytest.raises(LaunchError, match=rf"{name}=0 .*process_group_timeout_s.*Unset {name}"):
        check_launch(env, backend=NCCL)
    assert check_launch(env, backend="gloo") == []  # gloo has no watchdog to turn off
    for value in ("1", "3"):
        assert check_launch({**env, name: value}, backend=NCCL) == []
    # torch reads the TORCH_ name first: the legacy one does not override it
    assert (
        check_launch({**env, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_ASYNC_ERROR_HANDLING": "0"}, backend=NCCL)
        == []
    )


@pytest.mark.parametrize("backend", ["gloo", NCCL])
def test_hostname_on_loopback_across_nodes_is_warned_about_for_gloo(hostname_on, backend):
    hostname_on("127.0.1.1")
    (warning,) = check_launch(TORCHRUN, backend=backend)
    assert "'node1'" in warning and "127.0.1.1" in warning and "GLOO_SOCKET_IFNAME" in warning
    assert "/etc/hosts" in warning
    by_groups = {**TORCHRUN, "WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"}  # heterogeneous nodes
    assert len(check_launch(by_groups, backend=backend)) == 1


def test_no_loopback_warning_when_it_cannot_matter(hostname_on):
    hostname_on("127.0.1.1")
    assert check_launch({**TORCHRUN, "GLOO_SOCKET_IFNAME": "eth0"}, backend="gloo") == []
    assert check_launch({**TORCHRUN, "LOCAL_WORLD_SIZE": "16"}, backend="gloo") == []  # one node
    assert check_launch({**TORCHRUN, "MASTER_ADDR": "127.0.0.1"}, backend="gloo") == []  # all on this host
    assert check_launch({**TORCHRUN, "MASTER_ADDR": "node1"}, backend="gloo") == []  # so is this host's own name
    assert check_launch({**TORCHRUN, "MASTER_ADDR": "unknown"}, backend="gloo") == []  # torchrun fails clearly then
    assert check_launch(TORCHRUN, backend="nccl") == []  # no gloo group
    hostname_on("10.1.2.3")
    assert check_launch(TORCHRUN, backend="gloo") == []


def test_init_distributed_refuses_before_creating_a_group(monkeypatch):
    monkeypatch.setattr(process.dist, "is_initialized", lambda: False)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")

    def must_not_run(**kwargs):
        raise AssertionError("init_process_group called")

    monkeypatch.setattr(process.dist, "init_process_group", must_not_run)
    with pytest.raises(LaunchError, match="srun"):
        process.init_distributed()
    assert "RANK" not in process.os.environ  # no defaults filled in for a refused launch


def test_init_distributed_binds_the_group_to_the_local_gpu_on_cuda(monkeypatch):
    """Eager NCCL init: ``device_id`` is LOCAL_RANK's GPU (checked without a GPU: the calls are recorded)."""
    calls = {}
    monkeypatch.setattr(process.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(process, "device_type", lambda: "cuda")
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: calls.setdefault("index", index))
    monkeypatch.setattr(process.dist, "init_process_group", lambda **kwargs: calls.setdefault("init", kwargs))
    monkeypatch.setattr(process.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(process.dist, "get_world_size", lambda: 8)
    for name, value in {**TORCHRUN, "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert process.init_distributed(timeout_s=30) == (3, 8)
    assert calls["index"] == 3
    assert calls["init"]["device_id"] == torch.device("cuda", 3)
    assert calls["init"]["backend"] == NCCL and calls["init"]["timeout"].total_seconds() == 30
