"""jaxcp: packed-document and small-sequence attention kernels for JAX, with context parallelism."""
from jaxcp._src.attention import attention
from jaxcp._src.masks import segments_from_cu_seqlens

__all__ = ["attention", "segments_from_cu_seqlens"]
__version__ = "0.1.0"
