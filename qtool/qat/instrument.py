"""Put the fake quantizers into the torch module: weight parametrizations and activation hooks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from qtool.qat.fake_quant import (
    ActivationQuantizer,
    BlockInt8Input,
    LearnedWeightQuantizer,
    StoredWeightQuantizer,
)
from qtool.qat.mapping import Site
from qtool.write.int4 import BlockwiseWeight
from qtool.write.params import ActivationParams


def _key(tensor: str) -> str:
    """A ModuleDict key for a tensor name (no dots)."""
    return tensor.replace(".", "_")


class FakeQuantModel(nn.Module):
    """The float module with fake quantization where the QDQ layout quantizes.

    `net` keeps its own parameter names (a parametrized weight lives under
    `<module>.parametrizations.weight.original`, see `float_state`).
    """

    def __init__(
        self,
        net: nn.Module,
        sites: list[Site],
        activations: dict[str, ActivationParams],
        weight_stores: dict[str, tuple[Callable, bool]],
        learn_scales: bool,
        learned_weights: frozenset[str] = frozenset(),
        int8_compute_inputs: dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.quantizers = nn.ModuleDict()
        self.sites = sites
        self.learned: dict[str, LearnedWeightQuantizer] = {}
        for name, (store, transposed) in sorted(weight_stores.items()):
            owner, _, attr = name.rpartition(".")
            module = net.get_submodule(owner)
            quantizer: nn.Module = StoredWeightQuantizer(store, transposed)
            if name in learned_weights:
                initial = store(getattr(module, attr).detach().cpu().numpy())
                if not isinstance(initial, BlockwiseWeight):
                    raise TypeError(f"weight {name!r}: learned scales need a BlockwiseWeight")
                quantizer = LearnedWeightQuantizer(initial, transposed)
                self.learned[name] = quantizer
            parametrize.register_parametrization(module, attr, quantizer)
        self._inputs: dict[int, ActivationQuantizer] = {}
        for site in sites:
            quantizer = ActivationQuantizer(activations[site.tensor], learn_scales)
            self.quantizers[_key(site.tensor)] = quantizer
            if site.module is None:
                self._inputs[site.index] = quantizer
            else:
                net.get_submodule(site.module).register_forward_hook(
                    lambda _m, _i, out, q=quantizer: q(out)
                )

        self.int8_compute: dict[str, BlockInt8Input] = {}
        # module path -> block size: the input of a MatMulNBits written with int8 compute
        for path, block_size in sorted((int8_compute_inputs or {}).items()):
            dynamic = BlockInt8Input(block_size)
            self.int8_compute[path] = dynamic
            net.get_submodule(path).register_forward_pre_hook(
                lambda _m, args, q=dynamic: (q(args[0]), *args[1:])
            )

    def forward(self, *inputs: torch.Tensor):
        inputs = tuple(self._inputs[i](x) if i in self._inputs else x for i, x in enumerate(inputs))
        return self.net(*inputs)

    def activation_params(self) -> dict[str, ActivationParams]:
        return {site.tensor: self.quantizers[_key(site.tensor)].params() for site in self.sites}

    def learned_weights(self) -> dict[str, BlockwiseWeight]:
        """The weights with learned scales, in the form the writer stores them."""
        result = {}
        for name, quantizer in self.learned.items():
            owner, _, attr = name.rpartition(".")
            module = self.net.get_submodule(owner)
            original = module.parametrizations[attr].original
            result[name] = quantizer.stored_form(original.detach())
        return result

    def float_state(self) -> dict[str, np.ndarray]:
        """The trained float parameters under the names the exporter gave the initializers."""
        state = {}
        for name, value in self.net.named_parameters():
            if ".parametrizations." in name and not name.endswith(".original"):
                continue  # a learned weight scale: exported through learned_weights()
            state[name.replace("parametrizations.", "").removesuffix(".original")] = (
                value.detach().cpu().numpy().copy()
            )
        return state
