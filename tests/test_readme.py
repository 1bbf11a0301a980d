"""Every Python block of the README runs as written on the CPU reference device (a block that
opens with ``# On a GPU`` is left to the GPU tests). The first block is the transformers
example; its two inputs (``path``, ``prompt``) are given as examples/transformers_offload.py
gives them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
INPUTS = """import sys, torch
sys.path.insert(0, {examples!r})
from transformers_offload import small_qwen3_moe
path = small_qwen3_moe(__import__("pathlib").Path("qwen3-moe"))
prompt = torch.tensor([[1, 42, 7, 300, 5]])
"""


def test_the_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 3 and "offload_experts" in BLOCKS[0]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_block_runs(index: int, tmp_path: Path) -> None:
    block = BLOCKS[index]
    if block.startswith("# On a GPU"):
        pytest.skip("a GPU block")
    if "offload_experts" in block:
        pytest.importorskip("transformers")
        block = INPUTS.format(examples=str(ROOT / "examples")) + block + \
            "assert out.shape[1] > prompt.shape[1]\n"
    script = tmp_path / "block.py"
    script.write_text(block)
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300,
                         env=child_env())
    assert res.returncode == 0, res.stderr[-3000:]
