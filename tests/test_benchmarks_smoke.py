"""The benchmark scripts run end to end (tiny shapes, CPU) and write their outputs."""
import json
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def test_bench_attention_quick(tmp_path):
  sys.path.insert(0, BENCH)
  try:
    import bench_attention
    bench_attention.main(["--quick", "--out", str(tmp_path)])
  finally:
    sys.path.remove(BENCH)
  data = json.loads((tmp_path / "attention.json").read_text())
  assert all("jaxcp" in r and "fwd_ms" in r["jaxcp"] for r in data["results"])
  assert (tmp_path / "attention.md").read_text().startswith("Device:")
