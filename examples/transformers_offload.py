"""A transformers MoE model whose experts the agent serves (the README's first example).

Builds a small random Qwen3-MoE with transformers' own classes and saves it (pass a checkpoint
directory to use your own), loads it without its routed experts (their tensors are never
read), starts an agent, and generates with the experts held only in the agent's arena and
delivered per layer into a device slot pool of 25 % of them; the output is checked against the
whole model's, loaded as transformers loads it (``--no-reference`` skips that, for a
checkpoint too large to load whole). Runs on the CPU reference device, or a GPU with
``--device cuda``.

    python examples/transformers_offload.py [--checkpoint DIR] [--device cpu|cuda]
        [--no-reference]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers

from host_client import AgentClient, CpuReferenceDevice
from host_client.integrations.transformers import load_without_experts, offload_experts
from host_client.launcher import AgentProcess


def small_qwen3_moe(directory: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=512, intermediate_size=512, moe_intermediate_size=128,
        num_experts=16, num_experts_per_tok=4)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(
        directory)
    return directory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--no-reference", action="store_true",
                    help="do not load the whole model to check the output against")
    args = ap.parse_args()
    if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
        ap.error(f"--checkpoint: {args.checkpoint} is not a checkpoint directory (no config.json)")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or small_qwen3_moe(Path(tmp) / "qwen3-moe")
        prompt = torch.tensor([[1, 42, 7, 300, 5]], device=args.device)
        resident = None
        if not args.no_reference:
            whole = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
            resident = whole.to(args.device).generate(prompt, max_new_tokens=8, do_sample=False)
            del whole
        model = load_without_experts(path, dtype=torch.bfloat16).to(args.device)
        if args.device == "cuda":
            from host_client.cuda_device import CudaDevice

            device = CudaDevice(0)
        else:
            device = CpuReferenceDevice()

        with AgentProcess('[arena]\nbytes = "256MiB"\n') as agent, \
                AgentClient(agent.address) as client:
            offload = offload_experts(model, client, path, device, cache=0.25)
            served = model.generate(prompt, max_new_tokens=8, do_sample=False)
            print(f"generated {served[0, prompt.shape[1]:].tolist()} with "
                  f"{len(offload.layers)} MoE layers' experts served by the agent: "
                  f"{offload.experts_acquired} acquires, {offload.hits} hits")
        if resident is None:
            return 0
        if not torch.equal(served, resident):
            print("FAILED: the output differs from the whole model's", file=sys.stderr)
            return 1
        print("same tokens as the whole model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
