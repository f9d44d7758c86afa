"""Reads ncu's CSV (gpu__time_duration.sum of every kernel) from stdin and prints the kernels of
the last call: each kernel's duration and their sum. A call is what runs between two launches of
the same first kernel (the program's calls repeat one kernel sequence)."""
import csv
import sys


def main():
  rows = [r for r in csv.reader(line for line in sys.stdin if line.startswith('"'))]
  if not rows:
    sys.exit("no ncu rows")
  head, body = rows[0], rows[1:]
  name_col, value_col = head.index("Kernel Name"), head.index("Metric Value")
  unit_col = head.index("Metric Unit")
  scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
  kernels = [(r[name_col], float(r[value_col].replace(",", "")) * scale[r[unit_col]]) for r in body]
  names = [k for k, _ in kernels]
  # The call's sequence: from the last launch of the final call's first kernel.
  n = len(names)
  period = next((p for p in range(1, n // 2 + 1) if names[n - p:] == names[n - 2 * p:n - p]), n)
  last = kernels[n - period:]
  total = 0.0
  for name, us in last:
    total += us
    print(f"{us:10.1f} us  {name[:110]}")
  print(f"{total:10.1f} us  sum of {len(last)} kernels")


if __name__ == "__main__":
  main()
