"""benchmarks/bench_small_seq.py runs end to end on the CPU (--quick) and writes its timing and
memory columns (tests/test_benchmarks_smoke.py covers the other benchmark scripts)."""
import json
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def test_bench_small_seq_quick(tmp_path):
  sys.path.insert(0, BENCH)
  try:
    import bench_small_seq
    bench_small_seq.main(["--quick", "--reps", "2", "--only", "ragged", "--out", str(tmp_path)])
    bench_small_seq.main(["--quick", "--reps", "2", "--only", "GQA", "--out", str(tmp_path)])
  finally:
    sys.path.remove(BENCH)
  data = json.loads((tmp_path / "small_seq_cpu.json").read_text())
  (r,) = data["results"]
  assert "error" not in r, r.get("error")
  assert r["jaxcp_fwd_ms"] > 0 and r["copy_gbps"] > 0
  for tag in ("fwd", "fwdbwd"):
    comp = r[f"{tag}_compiled"]
    assert comp is not None and comp["temp"] >= 0
    # the saved probabilities are the only sizeable temporary
    assert comp["total"] <= r[f"need_{tag}_bytes"] + (1 << 20)
    assert r[f"{tag}_memory_ok"] is True
  md = (tmp_path / "small_seq_cpu.md").read_text()
  assert "temp bytes / (inputs+outputs+probs)" in md and "pass" in md
