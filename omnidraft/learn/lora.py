"""LoRA for the online learner: adapters on the training copy only, served merged.

The served drafter stays a plain model whose adapted linear weights are the merged
``W + scale * B @ A``, computed in the training dtype from the frozen base weights and cast once, so
serving costs no extra matmuls and repeated merges never accumulate rounding.
"""

from __future__ import annotations

import copy

import torch


def with_lora(model, rank: int, alpha: int | None = None, target_modules: list[str] | None = None,
              seed: int = 0):
    """Wrap a model with LoRA adapters (peft); the base weights stay frozen. The adapters'
    random initialisation draws from ``seed``, not from (or into) the global torch RNG."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=int(rank), lora_alpha=int(alpha or 2 * rank), lora_dropout=0.0,
                     target_modules=list(target_modules or ["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        wrapped = get_peft_model(model, cfg)
    for p in wrapped.parameters():
        p.requires_grad_(False)
    return wrapped.eval()


def lora_layers(peft_model) -> dict[str, torch.nn.Module]:
    """Module path in the unwrapped model -> its peft LoRA layer."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in peft_model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merge_lora_into(served: torch.nn.Module, peft_model) -> int:
    """Write ``base + delta`` of every LoRA layer of ``peft_model`` into the weight of the module at
    the same path in ``served`` (a plain model of the same architecture). Returns the count."""
    layers = lora_layers(peft_model)
    for name, mod in layers.items():
        w = served.get_submodule(name).weight
        delta = sum(mod.get_delta_weight(a) for a in mod.active_adapters)
        w.copy_((mod.base_layer.weight + delta).to(w.dtype))
    return len(layers)


def merge_lora_state(served: torch.nn.Module, tensors: dict[str, torch.Tensor], lora, dtype=torch.float32) -> int:
    """Serve a saved LoRA state (``param.<name>`` adapter tensors) frozen: merge it into ``served``."""
    from omnidraft.state import load_weights

    if any("lora_" in n for n, _ in served.named_parameters()):
        raise ValueError("merge_lora_state serves into a plain model; this one already carries LoRA adapters")
    wrapped = with_lora(copy.deepcopy(served).to(dtype), *lora)
    load_weights(wrapped, tensors)
    return merge_lora_into(served, wrapped)


class LoraServing:
    """Several saved LoRA states served frozen in turn on one plain drafter (one per target of a
    target-switching stream): :meth:`use` puts back the base weights of the adapted layers, then
    merges a state's adapters (none: the base drafter). Only those layers' base weights are kept."""

    def __init__(self, served: torch.nn.Module, lora):
        self.served, self.lora = served, tuple(lora)
        names = list(lora_layers(with_lora(copy.deepcopy(served), *self.lora)))
        self.base = {n: served.get_submodule(n).weight.detach().clone() for n in names}

    @torch.no_grad()
    def use(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """Serve the adapters of ``tensors`` (``param.<name>``), or the base drafter for None."""
        for n, w in self.base.items():
            self.served.get_submodule(n).weight.copy_(w)
        if tensors:
            merge_lora_state(self.served, tensors, self.lora)
