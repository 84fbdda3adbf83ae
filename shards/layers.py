"""DFlash's default target layers: which hidden states a drafter reads when nobody says.

Extraction captures these layers by default and training defaults `target_layer_ids` to them, so
the rule belongs to the contract between the phases. (The exported `dflash.py` keeps its own copy:
it must load without dflash installed.)
"""

from __future__ import annotations


def default_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """K ids evenly spaced from 1 to L-3, `round(1 + i*(L-4)/(K-1))` (Python round); K = 1 -> [L // 2].

    L=36, K=5 -> [1, 9, 17, 25, 33]. Shallow targets may repeat an id (L=4, K=5 -> [1]*5): the drafter
    then reads that layer K times, and extraction stores it once.
    """
    if num_target_layers < 1 or k < 1:
        raise ValueError(f"need num_target_layers >= 1 and k >= 1, got L={num_target_layers}, k={k}")
    if k == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"the default layer rule needs a target of >= 4 layers (got {num_target_layers}); "
            "pass the layer ids explicitly"
        )
    return [round(1 + i * (num_target_layers - 4) / (k - 1)) for i in range(k)]
