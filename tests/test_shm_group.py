"""Shared memory across Unix users: with ``[sessions] shm_group`` the agent's segments and
doorbells are 0660 in that group and a client that is a member makes its own so too, so an
agent running as its service user serves inference processes of other users; without it each
side's segments are its user's alone, and a client of another user is refused with a message
that says why. The cross-user tests run real processes under other uids (root only)."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpu_agent.config import ConfigError, from_mapping
from dpu_offload import shm
from dpu_offload.port_bell import PortBell, bell_path
from dpu_offload.shm import SharedBuffer, unique_name
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from host_client.launcher import AgentProcess
from tests.conftest import checkpoint_bytes, child_env

AGENT_UID, CLIENT_UID, GROUP = 4101, 4102, 4242
"""Ids with no entry in the user and group databases (none is needed to run as them)."""

ROOT = Path(__file__).resolve().parents[1]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="runs processes as other users")


@pytest.fixture
def shared_with() -> Iterator[object]:
    """``shm.share_with_group`` for the test, this process's setting put back after."""
    yield shm.share_with_group
    shm.share_with_group(None)


@contextlib.contextmanager
def ring_with_bell() -> Iterator[str]:
    """A fresh ring segment's name, its doorbell made first (as a ring's maker does), both
    made under this process's group setting; both removed after."""
    name = unique_name("dpu-test-group")
    bell = PortBell.create(name)
    assert bell is not None
    try:
        with SharedBuffer(name, 4096, create=True):
            yield name
    finally:
        bell.close()
        os.unlink(bell_path(name))


def test_segments_and_doorbells_made_for_a_group_are_0660_in_it(shared_with: object) -> None:
    gid = os.getegid()
    shm.share_with_group(gid)
    with ring_with_bell() as name:
        for path in (Path(shm.SHM_DIR) / name, Path(bell_path(name))):
            st = os.stat(path)
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid, path
        reopened = PortBell.open(name)  # group-writable in the ring's own group: accepted
        assert reopened is not None
        reopened.close()
    shm.share_with_group(None)
    with SharedBuffer(unique_name("dpu-test-group"), 4096, create=True) as buf:
        assert stat.S_IMODE(os.stat(Path(shm.SHM_DIR) / buf.name).st_mode) == 0o600


@pytest.mark.parametrize("group", [None, pytest.param(GROUP, marks=root_only)])
def test_a_group_writable_doorbell_is_refused_unless_the_ring_is_shared_with_that_group(
        shared_with: object, group: int | None) -> None:
    """A ring made 0600 (no group): a doorbell its group may write is a way in, refused. A
    FIFO a group may write is accepted only where the ring itself is shared with that same
    group: one in another group is a way in for its members (changing its group: root only)."""
    shm.share_with_group(None)
    with ring_with_bell() as name:
        if group is not None:
            os.chown(bell_path(name), -1, group)
        os.chmod(bell_path(name), 0o660)
        with pytest.raises(ValueError, match="not the ring owner's alone"):
            PortBell.open(name)


def test_the_group_setting_is_checked_at_load() -> None:
    with pytest.raises(ConfigError, match=r"sessions\.shm_group: no group named"):
        from_mapping({"sessions": {"shm_group": "no-such-group-dpu-offload"}})
    if os.geteuid() != 0:
        with pytest.raises(ConfigError, match="is not a member of group"):
            from_mapping({"sessions": {"shm_group": str(GROUP)}})
    assert from_mapping({"sessions": {"shm_group": str(os.getegid())}}).sessions.shm_group
    # What a client checks of the group the agent names (CreateSessionResponse.shm_gid).
    assert shm.may_share_with(os.getegid()) and not shm.may_share_with(2**32 - 1)
    assert shm.may_share_with(GROUP) == (os.geteuid() == 0)


CLIENT = """
import sys
from dpu_offload.keys import ExpertKey
from dpu_offload.shm import SharedBufferError
from host_client import AgentClient, AgentError, CpuReferenceDevice, SlotPoolSpec
address, checkpoint, device = sys.argv[1:4]
if device == "cuda":
    from host_client.cuda_device import CudaDevice
try:
    with AgentClient(address, client_name="other-user") as client:
        model = client.load_model(checkpoint, "shared")
        dev = client.register_device(CudaDevice(0) if device == "cuda" else CpuReferenceDevice(),
                                     [SlotPoolSpec(model.expert_bytes, 2)])
        raw = client.acquire(dev, ExpertKey("shared", 1, 2)).wait(30).raw("up_proj")
        sys.stdout.buffer.write((raw.get() if device == "cuda" else raw).tobytes())
except (AgentError, SharedBufferError) as exc:
    print("REFUSED", type(exc).__name__, exc)
    raise SystemExit(3)
"""

def as_user(uid: int) -> list[str]:
    """A command prefix that runs as ``uid`` with ``GROUP`` as its only supplementary group."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={GROUP}"]


def run_client(agent: AgentProcess, checkpoint: Path, device: str
               ) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*as_user(CLIENT_UID), sys.executable, "-c", CLIENT, agent.address,
                           str(checkpoint), device], capture_output=True, timeout=300, cwd=ROOT,
                          env=child_env())


def user_agent(settings: str) -> AgentProcess:
    agent = AgentProcess(settings, startup_timeout=300,
                         interpreter=[*as_user(AGENT_UID), sys.executable])
    os.chmod(agent.config_path.parent, 0o777)  # its config, and where it writes its ready file
    return agent


@root_only
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_agent_serves_a_client_of_another_user_through_their_group(device: str) -> None:
    """On the GPU the DMA engine (run by the agent, as the agent's user) opens the other
    user's slot pool by CUDA IPC handle. Both users run with this process's ``HOME``, which
    is not theirs to write: CuPy's kernel cache goes to a private directory of each
    (``dpu_offload.jit.keep_cupy_cache``)."""
    if device == "cuda":
        pytest.importorskip("cupy")
    shared = Path(tempfile.mkdtemp(prefix="dpu-shm-group-"))
    try:
        os.chmod(shared, 0o755)
        ckpt = make_checkpoint(shared / "qwen", CheckpointSpec(
            "qwen3-moe", layers=2, experts=4, hidden=128, intermediate=64))
        want = checkpoint_bytes(ckpt)["model.layers.1.mlp.experts.2.up_proj.weight"]
        with user_agent('[arena]\nbytes = "16MiB"\n') as agent:
            refused = run_client(agent, ckpt, device)
        assert refused.returncode == 3, refused.stderr.decode()[-2000:]
        assert b"permission denied" in refused.stdout and b"shm_group" in refused.stdout
        with user_agent(f'[arena]\nbytes = "16MiB"\n[sessions]\nshm_group = "{GROUP}"\n'
                        ) as agent:
            served = run_client(agent, ckpt, device)
        assert served.returncode == 0, served.stderr.decode()[-2000:]
        assert served.stdout == want
    finally:
        subprocess.run(["rm", "-rf", str(shared)], check=False)
