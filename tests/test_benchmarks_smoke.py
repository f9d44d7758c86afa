"""The benchmark scripts run end to end (tiny shapes, CPU) and write their outputs."""
import importlib
import json
import os
import sys

import numpy as np

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def _run_quick(script, out_dir, *args):
  """Runs benchmarks/<script>.py's main with --quick (and args), writing to out_dir; returns the module."""
  sys.path.insert(0, BENCH)
  try:
    module = importlib.import_module(script)
    module.main(["--quick", "--out", str(out_dir), *args])
    return module
  finally:
    sys.path.remove(BENCH)


def test_bench_attention_quick(tmp_path):
  """In two parts (as over two GPUs), then merged: every case once, in the case list's order."""
  for i in range(2):
    _run_quick("bench_attention", tmp_path, "--part", f"{i}/2")
  parts = [str(tmp_path / f"attention_cpu_part{i}.json") for i in range(2)]
  module = _run_quick("bench_attention", tmp_path, "--merge", *parts)
  data = json.loads((tmp_path / "attention_cpu.json").read_text())
  assert [r["case"]["name"] for r in data["results"]] == [c.name for c in module.QUICK_CASES]
  assert len(data["meta"]["parts"]) == 2
  assert all("jaxcp" in r and "fwd_ms" in r["jaxcp"] for r in data["results"])
  # the XLA peer is checked against jaxcp's output and gradients (float32 on the CPU)
  errs = [(r["xla"]["rel_err_vs_jaxcp"], r["xla"]["grad_rel_err_vs_jaxcp"]) for r in data["results"]]
  assert errs and all(0 <= e < 1e-4 for pair in errs for e in pair), errs
  # deterministic=True: timed forward+backward and backward alone, the default's gradients
  det = [r["jaxcp_det"] for r in data["results"]]
  assert all("bwd_ms" in d and "fwd_bwd_ms" in d and "fwd_ms" not in d for d in det), det
  assert all(0 <= d["grad_rel_err_vs_jaxcp"] < 1e-4 for d in det), det
  assert data["summary"]["deterministic_bwd"]["cases"] == len(det)
  md = (tmp_path / "attention_cpu.md").read_text()
  assert md.startswith("Device:") and "deterministic=True over the default" in md
  # parts measured on another host (named after its device) merge here under their own name, in
  # the case list's order whichever part comes first
  other = tmp_path / "other"
  other.mkdir()
  for i, part in enumerate(parts):
    (other / f"attention_h200_part{i}.json").write_text(open(part).read())
  _run_quick("bench_attention", other, "--merge", *(str(other / f"attention_h200_part{i}.json") for i in (1, 0)))
  merged = json.loads((other / "attention_h200.json").read_text())
  assert [r["case"]["name"] for r in merged["results"]] == [c.name for c in module.QUICK_CASES]


def test_bench_small_seq_layer_quick(tmp_path):
  _run_quick("bench_small_seq_layer", tmp_path)
  data = json.loads((tmp_path / "small_seq_layer_cpu.json").read_text())
  assert len(data["results"]) == 2
  for r in data["results"]:
    assert r["jaxcp_ms"] > 0 and r["xla_ms"] > 0 and r["max_rel_err"] < 2e-2
    assert r["xla_matmuls"] >= 8  # four projections forward and backward, and the attention's own
  assert "matmuls jaxcp / XLA" in (tmp_path / "small_seq_layer_cpu.md").read_text()


def test_accuracy_quick(tmp_path):
  """The accuracy script runs, and the CPU kernel's bf16 output is within bf16 rounding of the
  float64 reference (its own rounding of the output alone is about 1.5e-3)."""
  _run_quick("accuracy_attention", tmp_path)
  data = json.loads((tmp_path / "accuracy_cpu.json").read_text())
  errs = [r["rel_err_vs_f64"]["jaxcp"] for r in data["results"]]
  assert len(errs) == 2 and all(0 < e < 4e-3 for e in errs), errs


def test_grad_check_quick(tmp_path):
  """The per-document gradient reference agrees with jaxcp's float32 CPU kernel (causal, and with
  a window) to float32 rounding: a reference that masked differently would not."""
  _run_quick("grad_check_long_rows", tmp_path)
  data = json.loads((tmp_path / "grad_check_cpu.json").read_text())
  errs = [r["jaxcp"][g]["rel_err"] for r in data["results"] for g in ("dq", "dk", "dv")]
  assert len(errs) == 6 and all(0 < e < 1e-5 for e in errs), errs


def test_cudnn_packed_args_are_starts_only():
  """JAX's packed cuDNN form takes document starts, -1 after the last (an end offset would shift
  every later row of the batch by one document)."""
  sys.path.insert(0, BENCH)
  try:
    from bench_attention import cudnn_packed_args
  finally:
    sys.path.remove(BENCH)
  seqlen, offsets = cudnn_packed_args([[3, 5, 2], [10]], batch=2)
  np.testing.assert_array_equal(seqlen, [[3, 5, 2], [10, -1, -1]])
  np.testing.assert_array_equal(offsets, [[0, 3, 8, -1], [0, -1, -1, -1]])


def test_ratio_summary_drops_peers_with_wrong_results():
  """A peer whose output disagrees with jaxcp's gets no ratio ("wrong result") and stays out of
  the geometric means, one whose gradients disagree loses its forward+backward ratio only;
  padded cases count in "all" only."""
  sys.path.insert(0, BENCH)
  try:
    from bench_attention import _fmt, _ratio, ratio_summary
  finally:
    sys.path.remove(BENCH)

  def case(pad, jax_tf, peer_tf, err, grad_err=2e-3):
    return dict(case=dict(pad=pad), jaxcp=dict(fwd_tflops=jax_tf, fwd_bwd_tflops=jax_tf),
                cudnn_packed=dict(fwd_tflops=peer_tf, fwd_bwd_tflops=peer_tf, rel_err_vs_jaxcp=err,
                                  grad_rel_err_vs_jaxcp=grad_err))

  results = [case(0, 200.0, 100.0, 1e-3), case(0, 100.0, 200.0, 2e-3), case(300, 300.0, 100.0, 1e-3),
             case(0, 100.0, 400.0, 1.3), case(0, 100.0, 400.0, float("nan")),
             case(0, 100.0, 100.0, 1e-3, grad_err=0.9)]
  assert _ratio(results[3]["jaxcp"], results[3]["cudnn_packed"], "fwd_tflops") == "wrong result"
  assert _ratio(results[0]["jaxcp"], results[0]["cudnn_packed"], "fwd_tflops") == "2.00x"
  assert _ratio(results[5]["jaxcp"], results[5]["cudnn_packed"], "fwd_tflops") == "1.00x"
  assert _ratio(results[5]["jaxcp"], results[5]["cudnn_packed"], "fwd_bwd_tflops") == "wrong result"
  s = ratio_summary(results)
  assert s["unpadded_fwd_tflops"] == dict(cases=3, geomean=1.0)
  assert s["unpadded_fwd_bwd_tflops"]["cases"] == 2
  assert s["all_fwd_bwd_tflops"]["cases"] == 3
  np.testing.assert_allclose(s["all_fwd_bwd_tflops"]["geomean"], 3.0 ** (1 / 3))
  # against the static-capacity peer: a mode where it ran out of memory counts as not run, and a
  # backward out of memory leaves its forward
  results[0]["cudnn_static"] = dict(fwd_tflops=100.0, rel_err_vs_jaxcp=1e-3, fwd_bwd_error="OOM")
  results[1]["cudnn_static"] = dict(fwd_tflops=200.0, fwd_bwd_tflops=50.0, rel_err_vs_jaxcp=1e-3,
                                    grad_rel_err_vs_jaxcp=2e-3)
  results[2]["cudnn_static"] = dict(fwd_error="OOM", fwd_bwd_error="OOM")
  s = ratio_summary(results)
  assert s["static_unpadded_fwd_tflops"] == dict(cases=2, geomean=1.0)
  assert s["static_unpadded_fwd_bwd_tflops"] == dict(cases=1, geomean=2.0)
  assert _fmt(results[0]["cudnn_static"], "fwd_bwd_tflops") == "OOM"
  assert _fmt(results[0]["cudnn_static"], "fwd_tflops") == "100"
  assert _ratio(results[2]["jaxcp"], results[2]["cudnn_static"], "fwd_tflops") == "-"
  assert s["unpadded_fwd_bwd_tflops"]["cases"] == 2  # the packed peer's ratios are unchanged


_SCHEDULE = """
%dynamic_slice_fusion_computation (p0: bf16[8,4], p1: s32[8]) -> bf16[4,4] {
  %k = (bf16[4,4], u8[4]) custom-call(%s0, %s1), custom_call_target="jaxcp_attention_fwd"
}

ENTRY %main (param: bf16[8,4]) -> bf16[16,4] {
  %all-gather-start = (bf16[4,4], bf16[16,4]) all-gather-start(%p), dimensions={0}
  %dynamic_slice_fusion = bf16[4,4] fusion(%param), kind=kCustom, calls=%dynamic_slice_fusion_computation
  %all-gather-done = bf16[16,4] all-gather-done(%all-gather-start)
  %all-to-all-start = (bf16[4,4], bf16[4,4]) all-to-all-start(%q)
  %wrapped_concatenate = bf16[16,4] fusion(%a, %b), kind=kLoop, calls=%wrapped_concatenate_computation
  %all-to-all-done = bf16[4,4] all-to-all-done(%all-to-all-start)
}
"""


def test_cp_overlap_evidence_sees_kernels_inside_fusions():
  """bench_cp's overlap check: a jaxcp kernel that XLA wrapped in a dynamic-slice fusion (slices
  passed as addresses) counts inside an all-gather window; a copy fusion does not."""
  sys.path.insert(0, BENCH)
  try:
    from bench_cp import overlap_evidence
  finally:
    sys.path.remove(BENCH)
  assert overlap_evidence(_SCHEDULE, "all-gather")
  assert not overlap_evidence(_SCHEDULE, "all-to-all")
  assert not overlap_evidence(_SCHEDULE.replace("calls=%dynamic_slice_fusion_computation", "calls=%other"),
                              "all-gather")



def test_bench_attention_only_takes_several_substrings(tmp_path):
  """--only A,B: the cases whose names contain A or B (here B only: no case is named A)."""
  module = _run_quick("bench_attention", tmp_path, "--only", "no such case,1x512")
  data = json.loads((tmp_path / "attention_cpu.json").read_text())
  assert [r["case"]["name"] for r in data["results"]] == [module.QUICK_CASES[1].name]


def test_bench_attention_keeps_the_cases_before_a_failure(tmp_path, monkeypatch):
  """A run that stops after its first case (here the second raises, as a time limit would cut it)
  has already written that case's results."""
  sys.path.insert(0, BENCH)
  try:
    module = importlib.import_module("bench_attention")
    real, calls = module.run_case, []

    def run_case(*args, **kwargs):
      calls.append(1)
      if len(calls) > 1:
        raise KeyboardInterrupt("cut short")
      return real(*args, **kwargs)

    monkeypatch.setattr(module, "run_case", run_case)
    try:
      module.main(["--quick", "--out", str(tmp_path)])
    except KeyboardInterrupt:
      pass
  finally:
    sys.path.remove(BENCH)
  data = json.loads((tmp_path / "attention_cpu.json").read_text())
  assert [r["case"]["name"] for r in data["results"]] == [module.QUICK_CASES[0].name]
