"""The private kernel options (jaxcp._src.kernel_options): checked arguments, carried as static
primitive parameters (so they are part of the traced program), ignored by the CPU kernels and the
reference. Their effect on the CUDA kernels is tested in the gpu tests."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcp
from jaxcp._src import registry
from jaxcp._src.attention.api import attention_with_options
from jaxcp._src.kernel_options import AttentionKernelOptions, SmallSeqKernelOptions
from jaxcp._src.small_seq.api import small_seq_attention_with_options

needs_cpu_kernel = pytest.mark.skipif(not registry.cpu_extension_available(), reason="CPU extension not built")

Q = jax.random.normal(jax.random.PRNGKey(0), (2, 40, 4, 16), jnp.float32)
K = jax.random.normal(jax.random.PRNGKey(1), (2, 40, 2, 16), jnp.float32)
SEG = np.repeat(np.array([[1] * 25 + [2] * 15]), 2, axis=0).astype(np.int32)


@pytest.mark.parametrize("field", ["sm80_only", "fwd_fixed_tiles"])
def test_attention_fields_must_be_bools(field):
  with pytest.raises(ValueError, match=field):
    AttentionKernelOptions(**{field: 1})


@pytest.mark.parametrize("field", ["fwd", "bwd"])
def test_small_seq_fields_name_a_kernel_family(field):
  with pytest.raises(ValueError, match=f"{field} must be 'auto' or one of"):
    SmallSeqKernelOptions(**{field: "tensor_cores"})


def test_small_seq_auto_is_resolved_per_shape():
  """"auto" becomes a named family before lowering (the rule of small_seq/dispatch.py); what the
  caller names stays; a family that cannot run a shape is reported as unavailable."""
  from jaxcp._src.small_seq import dispatch
  with pytest.raises(ValueError, match="auto"):
    SmallSeqKernelOptions().ffi_attrs()
  # (group, head dim, keys): (forward family, backward family)
  rule = {
      (1, 128, 8): ("lanes", "lanes"),
      (2, 64, 12): ("lanes", "lanes"),
      (1, 128, 13): ("lanes", "mma"),
      (1, 256, 16): ("lanes", "mma"),
      (2, 64, 16): ("mma", "mma"),
      (1, 512, 12): ("lanes", "mma"),
      (4, 128, 4): ("lanes", "lanes"),
      (4, 256, 2): ("mma", "lanes"),
      (4, 256, 3): ("mma", "mma"),
      (4, 64, 5): ("mma", "mma"),
      (8, 64, 2): ("mma", "lanes"),
      (8, 64, 4): ("mma", "mma"),
      (8, 128, 2): ("mma", "mma"),
      (32, 128, 4): ("mma", "lanes"),
      (4, 128, 16): ("mma", "mma"),
  }
  for (group, dim, keys), (fwd, bwd) in rule.items():
    got = dispatch.resolve(SmallSeqKernelOptions(), group, dim, keys)
    assert got == SmallSeqKernelOptions(fwd, bwd), (group, dim, keys, got)
  assert dispatch.resolve(SmallSeqKernelOptions(), 32, 64, 4).bwd == "lanes"
  assert dispatch.resolve(SmallSeqKernelOptions(), 32, 64, 8).bwd == "cuda_core"
  assert dispatch.resolve(SmallSeqKernelOptions(fwd="cuda_core"), 1, 64, 4) == SmallSeqKernelOptions("cuda_core", "lanes")
  assert dispatch.available("fwd", "lanes", 1, 512, 16)  # one head a task: K, then V
  assert not dispatch.available("fwd", "lanes", 2, 512, 16)
  assert not dispatch.available("bwd", "lanes", 1, 512, 16)
  assert dispatch.available("bwd", "lanes", 4, 64, 4)  # groups over 2 heads: up to 4 keys, D <= 256
  assert dispatch.available("bwd", "lanes", 32, 256, 2)
  assert not dispatch.available("bwd", "lanes", 4, 64, 5)
  assert not dispatch.available("bwd", "lanes", 3, 512, 2)
  assert not dispatch.available("bwd", "mma", 32, 64, 4)
  assert dispatch.available("bwd", "cuda_core", 32, 64, 4)


def test_small_seq_rule_names_a_family_that_runs_the_shape():
  """Over every group (1-64 heads), head dim and key count the kernels take, "auto" resolves to a
  family that can run the shape (one that cannot would fail the call on the GPU)."""
  from jaxcp._src.small_seq import dispatch
  for group in range(1, 65):
    for head_dim in (64, 128, 256, 512):
      for max_len in range(1, 17):
        shape = (group, head_dim, max_len)
        assert dispatch.available("fwd", dispatch.default_fwd(*shape), *shape), shape
        assert dispatch.available("bwd", dispatch.default_bwd(*shape), *shape), shape


def test_entry_points_check_the_options_type():
  with pytest.raises(ValueError, match="AttentionKernelOptions"):
    attention_with_options(Q, K, K, kernel_options=SmallSeqKernelOptions())
  with pytest.raises(ValueError, match="SmallSeqKernelOptions"):
    small_seq_attention_with_options(Q[:, 0], K[:, :4], K[:, :4], kernel_options=AttentionKernelOptions())


def test_options_are_static_parameters():
  """Other options, another traced program (hence another jit cache entry and executable)."""
  jaxpr = lambda options: str(jax.make_jaxpr(lambda q, k: attention_with_options(
      q, k, k, is_causal=True, implementation="cpu", kernel_options=options))(Q, K))
  default, sm80 = jaxpr(AttentionKernelOptions()), jaxpr(AttentionKernelOptions(sm80_only=True))
  assert "sm80_only=True" in sm80 and "sm80_only=True" not in default


@needs_cpu_kernel
@pytest.mark.parametrize("impl", ["cpu", "xla"])
def test_cpu_and_reference_ignore_attention_options(impl):
  f = lambda options: jax.grad(lambda q: attention_with_options(
      q, K, K, segment_ids=SEG, is_causal=True, implementation=impl, kernel_options=options).sum())(Q)
  np.testing.assert_array_equal(f(AttentionKernelOptions(sm80_only=True, fwd_fixed_tiles=True)),
                                f(AttentionKernelOptions()))


@needs_cpu_kernel
def test_cpu_ignores_small_seq_options():
  q, k = Q[:, 0], K[:, :5]
  lengths = jnp.array([3, 5], jnp.int32)
  f = lambda options: small_seq_attention_with_options(q, k, k, kv_lengths=lengths, implementation="cpu",
                                                       kernel_options=options)
  np.testing.assert_array_equal(f(SmallSeqKernelOptions(fwd="cuda_core", bwd="cuda_core")),
                                f(SmallSeqKernelOptions()))
  np.testing.assert_array_equal(f(SmallSeqKernelOptions()),
                                jaxcp.small_seq_attention(q, k, k, kv_lengths=lengths, implementation="cpu"))


@needs_cpu_kernel
def test_mask_is_one_dictionary_attribute():
  """The attention handlers take the mask rules and the scale as one attribute, "mask"."""
  hlo = jax.jit(lambda q, k: jaxcp.attention(q, k, k, is_causal=True, local_window_size=(5, 2), chunk_size=8,
                                             scale=0.5, implementation="cpu")).lower(Q, K).as_text()
  assert ("mask = {chunk_size = 8 : i64, is_causal = true, scale = 5.000000e-01 : f32, window_left = 5 : i64, "
          "window_right = 2 : i64}") in hlo
