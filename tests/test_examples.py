"""The README's first example runs as written: a transformers model, loaded without its
experts, generating with them served by the agent: the same tokens as the whole model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def test_transformers_example_generates_the_resident_models_tokens() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "transformers_offload.py")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "same tokens as the whole model" in res.stdout
    assert "4 MoE layers' experts served by the agent" in res.stdout
