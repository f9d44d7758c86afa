"""Draws the mask of one packed row for the README (docs/mask.png), from jaxcp's own reference."""
import os

import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import jaxcp  # noqa: E402
from jaxcp._src.mask_spec import MaskSpec  # noqa: E402
from jaxcp._src.masks import allowed_pairs  # noqa: E402

cu = jnp.array([[0, 10, 24, 30, 30]], jnp.int32)  # docs of 10, 14, 6 tokens, then 2 padding tokens
seg, pos = jaxcp.segments_from_cu_seqlens(cu, 32)
panels = [("causal", MaskSpec(True)), ("causal, window (4, 0)", MaskSpec(True, 4, 0)),
          ("causal, chunk 5", MaskSpec(True, -1, -1, 5)), ("bidirectional", MaskSpec())]
fig, axes = plt.subplots(1, 4, figsize=(16, 4.4))
for ax, (title, spec) in zip(axes, panels):
  m = np.asarray(allowed_pairs(seg, pos, seg, pos, spec)[0])
  ax.imshow(m, cmap="Blues", vmin=0, vmax=1.3)
  ax.set_title(title)
  ax.set_xlabel("key token")
  ax.set_ylabel("query token")
  ax.set_xticks(np.asarray(cu[0, :4]) - 0.5, labels=[str(int(x)) for x in cu[0, :4]])
  ax.set_yticks(np.asarray(cu[0, :4]) - 0.5, labels=[str(int(x)) for x in cu[0, :4]])
  ax.grid(color="gray", linewidth=0.4)
fig.suptitle("One packed row: cu_seqlens = [0, 10, 24, 30, 30] (documents of 10, 14, 6 tokens; 2 padding tokens)")
fig.tight_layout()
fig.savefig(os.path.join(os.path.dirname(__file__), "mask.png"), dpi=90)
