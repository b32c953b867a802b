"""Which modules of a user's model nantrace may put a hook on without changing what they compute.

Some modules look at their own hooks: torch's ``TransformerEncoderLayer`` leaves its fused inference
path (eval mode, no gradient) when it or any of its sublayers carries a forward hook, and the two paths
differ (an all-padding row is NaN on the fused path and 0 on the other, and the other rows differ in the
last bits). nantrace must never change the user's numbers: a module inside such a module is reached by a
process-wide hook filtered by identity (``torch.nn.modules.module.register_module_forward_hook``), or not
at all.
"""

from __future__ import annotations

from torch import nn

__all__ = ["HOOK_SENSITIVE", "MODE_SENSITIVE", "hook_changes_numerics", "mode_changes_numerics"]

HOOK_SENSITIVE: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer,)
"""Module types whose forward takes another path when it or a sublayer is hooked."""


def hook_changes_numerics(root: nn.Module) -> set[int]:
    """``id`` of every module below ``root`` (``root`` included) that a forward hook would move off a
    fused path: the hook-sensitive modules and everything inside them."""
    inside: set[int] = set()
    for module in root.modules():
        if isinstance(module, HOOK_SENSITIVE) and id(module) not in inside:
            inside.update(id(m) for m in module.modules())
    return inside


MODE_SENSITIVE: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerEncoder,
                                              nn.MultiheadAttention)
"""Module types whose fused inference path torch skips while any torch-function mode is active."""


def mode_changes_numerics(root: nn.Module) -> bool:
    """Whether a torch-function mode pushed around ``root``'s forward would move a module of it off its fused path
    (a replay's observer must not: the re-run takes the path the real step took)."""
    return any(isinstance(m, MODE_SENSITIVE) for m in root.modules())
