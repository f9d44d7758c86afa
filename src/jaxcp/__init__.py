"""jaxcp: packed-document and small-sequence attention kernels for JAX, with context parallelism."""
from jaxcp._src.attention.api import attention
from jaxcp._src.attention.load_balance import (apply_permutation, invert_permutation, load_balance,
                                     load_balance_permutation, restore_order)
from jaxcp._src.attention.placement import (DocumentPlacement, choose_placement, exchange_cost,
                                              placement_violations)
from jaxcp._src.masks import segments_from_cu_seqlens
from jaxcp._src.small_seq.api import small_seq_attention

__all__ = [
    "attention",
    "small_seq_attention",
    "segments_from_cu_seqlens",
    "load_balance",
    "restore_order",
    "load_balance_permutation",
    "apply_permutation",
    "invert_permutation",
    "DocumentPlacement",
    "choose_placement",
    "exchange_cost",
    "placement_violations",
]
__version__ = "0.1.0"
