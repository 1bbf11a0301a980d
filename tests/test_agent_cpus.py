"""``[process] cpus``: the agent, and the DMA-engine process it starts, run on the CPUs given
(a DPU's cores, apart from the inference process's); a list it cannot use is refused by name."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from dpu_agent.config import ConfigError, from_mapping
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess


def _cpus_of(pid: int) -> set[int]:
    """The CPUs every thread of process ``pid`` may run on (the union over its threads)."""
    cpus: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        cpus |= os.sched_getaffinity(int(tid))
    return cpus


@pytest.mark.parametrize(("value", "problem"), [
    ("3-1", "'3-1' in '3-1' is not a CPU number or a range"),
    ("0,x", "'x' in '0,x' is not a CPU number"),
    ("0-5000", "from 0 to 4095"),
    (7, "expected a CPU list such as '2-3,6', got 7"),
    ([0, -1], "'-1' in '0,-1' is not a CPU number"),
])
def test_a_cpu_list_it_cannot_read_is_refused_by_name(value: object, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"process": {"cpus": value}}, env={})
    assert any(p.startswith("process.cpus: ") and problem in p for p in err.value.problems), \
        err.value.problems


def test_cpus_the_machine_does_not_have_are_refused() -> None:
    outside = os.cpu_count()
    with pytest.raises(ConfigError, match=rf"process.cpus: CPUs \[{outside}\] are not on this "
                                          rf"machine \(CPUs 0 to {outside - 1}\)"):
        from_mapping({"process": {"cpus": f"0,{outside}"}}, env={})
    assert from_mapping({}, env={"DPU_AGENT_PROCESS_CPUS": "0"}).process.cpus == (0,)
    assert from_mapping({"process": {"cpus": "0,0-0, 0"}}, env={}).process.cpus == (0,)
    assert from_mapping({"process": {"cpus": [0]}}, env={}).process.cpus == (0,)


def test_the_agent_its_dma_engine_and_its_nic_run_on_the_cpus_given(qwen_ckpt: Path) -> None:
    from bench.common import child_pid
    from dpu_offload.keys import ExpertKey

    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    settings = f'[process]\ncpus = "{cpu}"\n[activations]\nlisten_address = "127.0.0.1:0"\n'
    # Started by a process kept off that CPU (a benchmark's, keep_off_agent_cpus): the agent
    # inherits the narrower set and still takes the CPU it is given.
    with contextlib.ExitStack() as stack:
        os.sched_setaffinity(0, allowed - {cpu} or allowed)
        try:
            agent = stack.enter_context(AgentProcess(settings))
        finally:
            os.sched_setaffinity(0, allowed)
        client = stack.enter_context(AgentClient(agent.address))
        model = client.load_model(str(qwen_ckpt), "pinned")
        dev = client.register_device(CpuReferenceDevice(),
                                     [SlotPoolSpec(model.expert_bytes, 2)], delivery="engine")
        key = ExpertKey("pinned", model.moe_layers[0], 1)
        client.acquire(dev, key).wait(10)  # delivered by the engine, on that CPU
        client.release(dev, key)
        assert _cpus_of(agent.proc.pid) == {cpu}
        assert _cpus_of(child_pid(agent.proc.pid, "dma_engine")) == {cpu}
        assert _cpus_of(child_pid(agent.proc.pid, "nic")) == {cpu}  # the NIC stand-in


def test_a_benchmark_keeps_off_the_agents_cpus() -> None:
    """``bench.common.keep_off_agent_cpus``: with ``DPU_AGENT_PROCESS_CPUS`` set, the benchmark's
    process leaves those CPUs to the agents it starts; one that would leave it none is
    refused, naming the variable."""
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os; from bench.common import keep_off_agent_cpus; keep_off_agent_cpus(); "
            "print(sorted(os.sched_getaffinity(0)))")
    root = Path(__file__).resolve().parents[1]

    def run(cpus: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              cwd=root, env={**os.environ, "DPU_AGENT_PROCESS_CPUS": cpus})

    if len(allowed) > 1:
        kept = run(str(allowed[-1]))
        assert kept.returncode == 0 and kept.stdout.strip() == str(allowed[:-1]), kept
    every = run(",".join(map(str, allowed)))
    assert every.returncode != 0 and "leaves this process no CPU" in every.stderr, every
