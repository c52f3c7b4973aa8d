"""Fold every BatchNorm into the Conv before it, in torch, before anything trains.

ONNX preparation folds BN too (quantize/fold_bn.py), but then the weights QAT trains would not be
the weights that are exported: folding first makes the trained Conv the exported Conv, and BN's
running statistics are frozen from the first step on (they are gone).
"""

from __future__ import annotations

from qtool.errors import ModelError

_BN_TYPES = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d")
_CONV_TYPES = ("Conv1d", "Conv2d", "Conv3d")


def _set_submodule(root, path: str, module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def fold_batchnorm(model) -> list[tuple[str, str]]:
    """Fold in place; return the (conv, batchnorm) module paths folded.

    A model without BatchNorm is left untouched (and need not be traceable). A BatchNorm that
    does not directly follow a Conv whose output nothing else reads cannot be folded: an error
    naming it, because training it unfolded would export something else than what trained.
    """
    import torch
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    modules = dict(model.named_modules())
    bns = [name for name, m in modules.items() if type(m).__name__ in _BN_TYPES]
    if not bns:
        return []
    try:
        traced = torch.fx.symbolic_trace(model)
    except Exception as exc:
        raise ModelError(
            f"BatchNorm '{bns[0]}': the model cannot be traced by torch.fx to find the Conv it "
            f"follows ({type(exc).__name__}); fold it into the Conv before qtool qat"
        ) from None
    folded = []
    model.eval()
    for node in traced.graph.nodes:
        if node.op != "call_module" or node.target not in bns:
            continue
        source = node.args[0] if node.args else None
        conv = None
        if (
            isinstance(source, torch.fx.Node)
            and source.op == "call_module"
            and type(modules.get(source.target)).__name__ in _CONV_TYPES
            and len(source.users) == 1
        ):
            conv = source.target
        if conv is None:
            raise ModelError(
                f"BatchNorm '{node.target}' does not follow a Conv whose only reader it is: "
                "qtool qat folds BatchNorm into the preceding Conv and cannot fold this one"
            )
        fused = fuse_conv_bn_eval(modules[conv], modules[node.target])
        _set_submodule(model, conv, fused)
        _set_submodule(model, node.target, torch.nn.Identity())
        folded.append((conv, node.target))
    return folded
