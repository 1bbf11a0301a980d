"""A transformers MoE model's experts modules: which modules hold routed experts as stacked
parameters (transformers 5's experts interface, and Llama-4's scaled-input form), and loading a
model from its checkpoint with those parameters left unread (:func:`load_without_experts`), for
:func:`host_client.integrations.transformers.offload_experts` to serve them through the agent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
"""The stacked parameters of a transformers 5 experts module that the pool stands in for."""
_UNSET = object()


class OffloadError(ValueError):
    """The model and the checkpoint loaded in the agent do not fit together; says where."""


def expert_parameters(module: Any) -> list[str]:
    """The stacked expert parameters ``module`` has: as parameters, or left out as meta
    tensors by :func:`load_without_experts`."""
    return [p for p in EXPERT_PARAMETERS if p in module._parameters
            or getattr(getattr(module, p, None), "is_meta", False)]


def experts_modules(model: Any) -> Iterator[tuple[str, Any]]:
    """(qualified name, module) of every routed-experts module: stacked expert parameters and
    the ``(hidden_states, top_k_index, top_k_weights)`` forward of transformers 5's experts
    interface (``use_experts_implementation``)."""
    for name, module in model.named_modules():
        if (hasattr(module, "has_gate") and hasattr(module, "num_experts")
                and expert_parameters(module)):
            yield name, module


def scaled_input_blocks(model: Any) -> Iterator[tuple[str, Any]]:
    """(qualified name of the experts module, MoE block) of every MoE block whose experts take
    the router-scaled input of every expert and compute them all (Llama-4: ``router``,
    ``shared_expert`` and an ``experts`` module with stacked parameters and a
    ``(hidden_states)`` forward)."""
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if (experts is not None and hasattr(module, "router")
                and hasattr(module, "shared_expert") and not hasattr(experts, "has_gate")
                and hasattr(experts, "num_experts") and expert_parameters(experts)):
            yield f"{name}.experts", module


_LEFT_OUT = r"\.experts\.(gate_up_proj|down_proj)(_bias)?$"
"""The checkpoint keys (as transformers renames them) that have nowhere to go when the experts
are left out: not reported as unexpected."""


@contextlib.contextmanager
def _experts_left_out(model_class: type, classes: set[type]) -> Iterator[None]:
    """While open, a module of ``classes`` is built without its stacked expert parameters: each
    becomes a plain meta tensor of its shape (so weight initialisation still finds it), and the
    checkpoint's tensors for it have nowhere to go (``model_class`` does not report them).
    Patches the classes: not for models of the same classes built on other threads
    meanwhile."""
    import torch

    saved = {cls: cls.__init__ for cls in classes}
    ignored = model_class.__dict__.get("_keys_to_ignore_on_load_unexpected", _UNSET)

    def leaving_out(init: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            for p in EXPERT_PARAMETERS:
                param = self._parameters.pop(p, None)
                if param is not None:
                    setattr(self, p, torch.empty(param.shape, dtype=param.dtype, device="meta"))
        return __init__

    for cls, init in saved.items():
        cls.__init__ = leaving_out(init)
    model_class._keys_to_ignore_on_load_unexpected = [
        *(model_class._keys_to_ignore_on_load_unexpected or []), _LEFT_OUT]
    try:
        yield
    finally:
        for cls, init in saved.items():
            cls.__init__ = init
        if ignored is _UNSET:
            del model_class._keys_to_ignore_on_load_unexpected
        else:
            model_class._keys_to_ignore_on_load_unexpected = ignored


def load_without_experts(checkpoint: str | Path, model_class: Any = None, **kwargs: Any) -> Any:
    """A transformers MoE model from ``checkpoint`` with its routed experts left out, for
    :func:`offload_experts`: transformers' own ``from_pretrained`` (its renames and conversions
    of older checkpoint forms; ``kwargs`` such as ``dtype`` or ``device_map`` passed through)
    loads everything else, while the experts modules are built without their stacked
    parameters, so the checkpoint's expert tensors are never read (Qwen3-30B-A3B expert shapes,
    2.3 GB of experts: peak memory 5.8 GB loaded whole, 0.39 GB so;
    ``bench/transformers_load.py``).

    Args:
        checkpoint: a Hugging Face checkpoint directory.
        model_class: the transformers class to load (default ``AutoModelForCausalLM``).
    """
    import torch
    import transformers

    cls = model_class or transformers.AutoModelForCausalLM
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        probe = cls.from_config(config)
    classes = ({type(m) for _, m in experts_modules(probe)}
               | {type(b.experts) for _, b in scaled_input_blocks(probe)})
    if not classes:
        raise OffloadError(f"{checkpoint}: the model has no experts module to leave out "
                           "(stacked expert parameters: transformers 5's experts interface or "
                           "Llama-4's)")
    with _experts_left_out(type(probe), classes):
        return cls.from_pretrained(checkpoint, **kwargs)
