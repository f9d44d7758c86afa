"""benchmarks/bench_layers.py runs end to end (tiny shapes, CPU) and writes its outputs."""
import json

from .test_benchmarks_smoke import _run_quick


def test_bench_layers_quick(tmp_path):
  _run_quick("bench_layers", tmp_path)
  data = json.loads((tmp_path / "layers_cpu.json").read_text())
  assert data["meta"]["layers"] == 4 and data["results"]
  for r in data["results"]:
    for name, layers in (("jaxcp", 4), ("jaxcp_1layer", 1)):
      assert r[name]["layers"] == layers
      assert all(r[name][f"{m}_ms"] > 0 and r[name][f"{m}_ms_per_layer"] > 0 for m in ("fwd", "fwd_bwd")), r[name]
    # the XLA peer's final output and gradients agree with jaxcp's (float32 on the CPU)
    errs = (r["xla"]["rel_err_vs_jaxcp"], r["xla"]["grad_rel_err_vs_jaxcp"])
    assert all(0 <= e < 1e-4 for e in errs), errs
    # every layer's kernel is in the compiled stack; the CPU kernels build no plan
    calls = r["jaxcp"]["fwd_bwd_hlo_custom_calls"]
    assert calls["jaxcp_attention_fwd"] == 4 and calls["jaxcp_attention_bwd"] == 4, calls
    assert calls["jaxcp_attention_fwd_plan"] == 0 and calls["jaxcp_attention_bwd_plan"] == 0, calls
  assert (tmp_path / "layers_cpu.md").read_text().startswith("Device:")
