"""Scripts in tools/ that need no GPU, on small synthetic inputs."""
import csv
import gzip
import importlib.util
import os
import sys

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")


def _tool(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _source_page(path, instructions):
  """A gpu_profile_sass.sh source page: (source, executed, {reason: samples}) per instruction."""
  reasons = ["stall_barrier", "stall_short_sb", "stall_wait"]
  header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", *reasons,
            *(f"{r} (Not Issued)" for r in reasons)]
  with gzip.open(path, "wt", newline="") as f:
    w = csv.writer(f)
    w.writerow(["Kernel Name", "k"])
    w.writerow(header)
    for n, (source, executed, stalls) in enumerate(instructions):
      counts = [stalls.get(r[len("stall_"):], 0) for r in reasons]
      w.writerow([hex(0x1000 + 16 * n), source, sum(counts), executed, *counts, *counts])


def test_sass_profile_compare(tmp_path, capsys):
  tool = _tool("sass_profile_compare")
  loop = [("HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0", 800, {"wait": 5}),
          ("@P0 BRA 0x10", 800, {"short_sb": 30}),
          ("LOP3.LUT R1, R1, 0xff, RZ, 0xc0, !PT", 800, {"barrier": 1})]
  producer = [("LDG.E R2, [R4.64]", 100, {"wait": 2})]
  a, b = tmp_path / "a_sass.csv.gz", tmp_path / "b_sass.csv.gz"
  _source_page(a, loop + producer)
  _source_page(b, loop[:2] + [("FSEL R1, R1, -INF, !P0", 800, {})])
  rows = tool.load(str(a))
  assert [r["executed"] for r in rows] == [800, 800, 800, 100]
  assert tool.opcode("@P0 BRA 0x10") == "BRA" and tool.opcode("LOP3.LUT R1") == "LOP3.LUT"
  groups = tool.groups_by_count(rows)
  assert {c: len(rs) for c, rs in groups.items()} == {800: 3, 100: 1}
  argv, sys.argv = sys.argv, ["sass_profile_compare", str(a), str(b)]
  try:
    tool.main()
  finally:
    sys.argv = argv
  out = capsys.readouterr().out
  assert "3 instructions x     0.00 M" in out  # the loop of a: 3 instructions run 800 times
  assert "short_sb 83.3%" in out  # 30 of the loop's 36 samples
  diff = out.split("differ most")[1]
  assert "LOP3.LUT" in diff and "+0.0" in diff and "FSEL" in diff
