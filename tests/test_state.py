"""State survives restarts; SIGKILL at random points of writes never leaves a torn state; an
unwritable state directory is a clear start-up error."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dpu_agent.state import StateStore
from host_client import AgentClient
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from host_client.launcher import AgentProcess


def test_models_restored_after_restart(tmp_path: Path, qwen_ckpt: Path) -> None:
    settings = f'[state]\ndir = "{tmp_path / "state"}"\n'
    with AgentProcess(settings) as agent, AgentClient(agent.address) as client:
        client.load_model(str(qwen_ckpt), "kept")
    with AgentProcess(settings) as agent, AgentClient(agent.address) as client:
        assert [m.model for m in client.status().models] == ["kept"]


def test_sigkill_during_writes_leaves_old_or_new_state(tmp_path: Path) -> None:
    roots = [make_checkpoint(tmp_path / f"m{i}", CheckpointSpec("olmoe", layers=1, experts=2,
                                                                 hidden=64, intermediate=32))
             for i in range(6)]
    state_dir = tmp_path / "state"
    rng = random.Random(1)
    loaded: list[str] = []
    pending: str | None = None
    for _ in range(5):
        agent = AgentProcess(f'[state]\ndir = "{state_dir}"\n').start()
        client = AgentClient(agent.address)
        names = [m.model for m in client.status().models]
        # Old state (without the load killed mid-write) or new (with it); nothing else.
        assert names in (loaded, [*loaded, pending]), (names, loaded, pending)
        loaded, pending = names, None
        for i in range(len(loaded), min(len(loaded) + 2, len(roots))):
            name = f"m{i}"
            if rng.random() < 0.6:
                t = threading.Thread(target=_quiet_load, args=(client, roots[i], name))
                t.start()
                time.sleep(rng.uniform(0.0, 0.03))
                agent.kill()
                t.join()
                pending = name
                break
            client.load_model(str(roots[i]), name)
            loaded.append(name)
        client.close()
        agent.kill()
        data = json.loads((state_dir / "state.json").read_text())
        assert data["version"] == 1 and isinstance(data["models"], list)


def _quiet_load(client: AgentClient, root: Path, name: str) -> None:
    try:
        client.load_model(str(root), name)
    except Exception:  # noqa: BLE001 - the agent is being killed under it
        pass


def test_unwritable_state_dir_is_a_startup_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[server]\nlisten_address = "127.0.0.1:0"\n[state]\ndir = "{blocker}/x"\n')
    res = subprocess.run([sys.executable, "-m", "dpu_agent.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and "state.dir" in res.stderr, res.stderr


def test_corrupt_state_is_refused(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text('{"version": 1, "mod')
    with pytest.raises(ValueError, match="unreadable state"):
        StateStore(tmp_path).load()
