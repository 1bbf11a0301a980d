"""Loading a transformers MoE model for expert offload: peak memory and time of
``from_pretrained`` (the whole model) against ``load_without_experts`` (the experts' tensors
never read), each in a fresh process, on the same checkpoint.

The checkpoint: Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of 768, BF16) with
``--layers`` MoE layers and a trimmed vocabulary, random weights, written once with
``save_pretrained``. Peak memory is the process's high-water resident set (``VmHWM``; not
``ru_maxrss``, which Linux carries across ``execve`` from the parent), including the
interpreter, torch and transformers (``baseline_mb``: the same process importing them and
loading nothing).

    python bench/transformers_load.py [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import envelope, write
from dpu_offload.cli_args import positive

MODES = ("baseline", "whole", "without_experts")


def make_checkpoint(path: Path, layers: int) -> int:
    """Write the checkpoint; returns its experts' bytes."""
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=4096)
    with torch.device("meta"):
        shapes = transformers.AutoModelForCausalLM.from_config(cfg)
    experts = sum(p.numel() * 2 for n, p in shapes.named_parameters() if ".experts." in n)
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return experts


def measure(path: Path, mode: str) -> dict[str, float]:
    """Peak memory (MB) and seconds of one load in a fresh process."""
    code = f"""
import json, re, sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
import torch, transformers
from host_client.integrations.transformers import load_without_experts
t = time.perf_counter()
if {mode!r} == "whole":
    model = transformers.AutoModelForCausalLM.from_pretrained({str(path)!r}, dtype=torch.bfloat16)
elif {mode!r} == "without_experts":
    model = load_without_experts({str(path)!r}, dtype=torch.bfloat16)
else:
    model = None
seconds = time.perf_counter() - t
params = 0 if model is None else sum(p.numel() * p.element_size() for p in model.parameters())
status = open("/proc/self/status").read()
peak_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", status)[1])
print(json.dumps({{"peak_mb": peak_kb / 1024, "seconds": seconds,
                  "parameter_mb": params / 2**20}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=positive, default=2)
    args = ap.parse_args()
    if not 1 <= args.layers <= 48:
        ap.error("--layers must be between 1 and 48")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen3-moe"
        experts = make_checkpoint(path, args.layers)
        runs = {mode: measure(path, mode) for mode in MODES}
    result = {"arch": "qwen3-30b-a3b", "layers": args.layers, "experts_mb": experts / 2**20,
              "baseline_mb": runs["baseline"]["peak_mb"],
              **{mode: runs[mode] for mode in MODES[1:]},
              "peak_ratio": runs["without_experts"]["peak_mb"] / runs["whole"]["peak_mb"]}
    for mode in MODES[1:]:
        print(f"{mode:16s} peak {runs[mode]['peak_mb']:7.0f} MB  {runs[mode]['seconds']:5.2f} s"
              f"  parameters {runs[mode]['parameter_mb']:7.0f} MB")
    print(f"experts {experts / 2**20:.0f} MB; interpreter + torch + transformers alone "
          f"{runs['baseline']['peak_mb']:.0f} MB")
    write("transformers-load", envelope("transformers_load", result,
                                        command=f"python bench/transformers_load.py "
                                                f"--layers {args.layers}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
