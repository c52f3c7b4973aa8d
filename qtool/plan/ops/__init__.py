"""The op registry: what qtool knows about each op type, one module per op family.

registry.py holds the types and the lookups; each family module (conv.py, matmul.py, ...) holds
its rules and is registered here, in the order recipes list the quantizable op types. Adding an
op family is adding a module and a line below; adding a precision or a target is adding entries
to the rules (docs/op-registry.md).
"""

from __future__ import annotations

from qtool.plan.ops import (
    clamp,
    concat,
    conv,
    elementwise,
    gather,
    matmul,
    passthrough,
    pooling,
    runtime_only,
)
from qtool.plan.ops.registry import (
    PRECISIONS,
    Entry,
    OpRule,
    RegistryError,
    find_rule,
    fused_into,
    precision_key,
    quantizable_op_types,
    register,
    rule,
    rules,
    unplaced_reason,
    unregister,
    written_op_types,
)

FAMILIES = (conv, matmul, elementwise, concat, pooling, gather, passthrough, clamp, runtime_only)

for _family in FAMILIES:
    for _rule in _family.RULES:
        register(_rule)

__all__ = [
    "FAMILIES",
    "PRECISIONS",
    "Entry",
    "OpRule",
    "RegistryError",
    "find_rule",
    "fused_into",
    "precision_key",
    "quantizable_op_types",
    "register",
    "rule",
    "rules",
    "unplaced_reason",
    "unregister",
    "written_op_types",
]
