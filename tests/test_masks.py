"""Segment ids and positions from cu_seqlens and defaults, including clamping."""
import jax
import jax.numpy as jnp
import numpy as np

import jaxcp
from jaxcp._src.masks import positions_from_segments


def test_segments_from_cu_seqlens_sentinels_and_padding():
  cu = jnp.array([[0, 3, 3, 7, 7], [0, 10, 10, 10, 10]], jnp.int32)
  seg, pos = jaxcp.segments_from_cu_seqlens(cu, 10)
  np.testing.assert_array_equal(seg[0], [1, 1, 1, 3, 3, 3, 3, 0, 0, 0])
  np.testing.assert_array_equal(pos[0], [0, 1, 2, 0, 1, 2, 3, 0, 0, 0])
  np.testing.assert_array_equal(seg[1], [1] * 10)
  np.testing.assert_array_equal(pos[1], np.arange(10))


def test_segments_from_cu_seqlens_clamps_out_of_range_values():
  cu = jnp.array([[0, 6, 4, 50]], jnp.int32)  # not monotonic, past S
  seg, pos = jaxcp.segments_from_cu_seqlens(cu, 8)
  # clamped to [0, 6, 6, 8]: documents [0, 6) and [6, 8)
  np.testing.assert_array_equal(seg[0], [1, 1, 1, 1, 1, 1, 3, 3])
  np.testing.assert_array_equal(pos[0], [0, 1, 2, 3, 4, 5, 0, 1])


def test_segments_from_cu_seqlens_under_jit():
  cu = jnp.array([[0, 2, 5]], jnp.int32)
  seg, pos = jax.jit(jaxcp.segments_from_cu_seqlens, static_argnums=1)(cu, 6)
  np.testing.assert_array_equal(seg[0], [1, 1, 2, 2, 2, 0])


def test_positions_restart_per_contiguous_run():
  seg = jnp.array([[1, 1, 2, 2, 2, 1, 0, 0]])
  np.testing.assert_array_equal(positions_from_segments(seg)[0], [0, 1, 0, 1, 2, 0, 0, 1])
