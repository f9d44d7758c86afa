#!/usr/bin/env bash
# Multi-process check on one host with 4 GPUs: examples/train_packed_lm.py as one process with
# 4 GPUs and as 2 processes x 2 GPUs joined by jax.distributed at 127.0.0.1 (NCCL between the
# processes), same configuration and steps, for two meshes:
#   dp1_cp4  context parallelism over all 4 GPUs (cp crosses the process boundary)
#   dp2_cp2  dp across the processes, cp inside each (the layout the example's mesh order picks)
# Prints the losses side by side and the tokens/s of each run; writes the metrics of every run
# (JSON) and one plot of the four loss curves to $OUT (or ./gpu_results); the runs' logs stay in
# a temporary folder, their tails printed on failure. Fails if the losses of the first 10 steps
# differ by more than MH_TOL (relative, default 1e-3: bfloat16 compute, float32 parameters and
# gradients).
#
#   bash tools/gpu_multihost_check.sh [extra example flags, e.g. --steps 50 --seq-len 32768]
#
# Builds jaxcp with the CUDA extension first (tools/gpu_build.sh; JAXCP_SKIP_BUILD=1 skips it).
# Nothing is downloaded: wheels the host lacks (nvidia-cutlass for the build; flax and optax if
# the image has none) go in .whl/, which tools/gpu_build.sh installs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES JAX_PROCESS_ID  # explicit flags below

if [[ "${JAXCP_SKIP_BUILD:-0}" != 1 ]]; then
  bash tools/gpu_build.sh || exit 1
fi
python3 -c "import flax, optax" || { echo "flax / optax missing: put their wheels in .whl/"; exit 1; }
ngpu=$(nvidia-smi -L | wc -l)
(( ngpu >= 4 )) || { echo "needs 4 GPUs, found $ngpu"; exit 1; }

CONFIG=(--steps 30 --batch 8 --seq-len 16384 --min-doc 64 --d-model 1024 --layers 4 --heads 8
        --kv-heads 2 --head-dim 128 --mlp-hidden 4096 --log-every 10 "$@")
LIMIT=${MH_RUN_LIMIT:-240}  # seconds per run: a failed or stuck run's processes are ended
RUNS=$(mktemp -d)   # logs and the example's own plots

one_process() {  # name, mesh flags...
  local name=$1; shift
  CUDA_VISIBLE_DEVICES=0,1,2,3 timeout -k 10 $LIMIT python3 examples/train_packed_lm.py "$@" \
    "${CONFIG[@]}" --save-metrics "$RUNS/multihost_${name}_1x4.json" > "$RUNS/${name}_1x4.log" 2>&1
  local rc=$?
  grep -E "^jaxcp |tokens/s after" "$RUNS/${name}_1x4.log"
  cp "$RUNS/multihost_${name}_1x4.json" "$OUT/" 2>/dev/null
  return $rc
}

two_processes() {  # name, mesh flags...
  local name=$1; shift
  local port=$((20000 + RANDOM % 20000)) pids=() rc=0
  # All 4 GPUs stay visible to both processes (NCCL's peer-to-peer path between processes);
  # --local-device-ids gives each process its 2.
  for p in 0 1; do
    timeout -k 10 $LIMIT python3 examples/train_packed_lm.py "$@" "${CONFIG[@]}" \
      --coordinator "127.0.0.1:$port" --num-processes 2 --process-id $p \
      --local-device-ids "$((2 * p)),$((2 * p + 1))" \
      --save-metrics "$RUNS/multihost_${name}_2x2.json" > "$RUNS/${name}_2x2_p$p.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  grep -E "^jaxcp |tokens/s after" "$RUNS/${name}_2x2_p0.log"
  cp "$RUNS/multihost_${name}_2x2.json" "$OUT/" 2>/dev/null
  return $rc
}

rc=0
for mesh in "dp1_cp4:--dp 1 --cp 4" "dp2_cp2:--dp 2 --cp 2"; do
  name=${mesh%%:*}
  [[ -n "${MH_ONLY:-}" && "$name" != "$MH_ONLY" ]] && continue   # MH_ONLY=dp1_cp4: one mesh only
  read -r -a flags <<< "${mesh#*:}"
  echo "== $name: 1 process x 4 GPUs"
  one_process "$name" "${flags[@]}" || { rc=1; tail -20 "$RUNS/${name}_1x4.log"; }
  echo "== $name: 2 processes x 2 GPUs"
  two_processes "$name" "${flags[@]}" || { rc=1; tail -20 "$RUNS/${name}"_2x2_p*.log; }
done
rm -rf "$RUNS"

python3 - "$OUT" "${MH_TOL:-1e-3}" "${MH_ONLY:-}" <<'EOF' || rc=1
import json, pathlib, sys
out, tol = pathlib.Path(sys.argv[1]), float(sys.argv[2])
ok, curves = True, {}
for name in [sys.argv[3]] if sys.argv[3] else ("dp1_cp4", "dp2_cp2"):
  paths = [out / f"multihost_{name}_{kind}.json" for kind in ("1x4", "2x2")]
  if not all(p.exists() for p in paths):
    print(f"{name}: missing {[p.name for p in paths if not p.exists()]}")
    ok = False
    continue
  one, two = (json.loads(p.read_text()) for p in paths)
  dp, cp, tp = one["mesh"]
  print(f"\n{name} (dp={dp} cp={cp} tp={tp}, {one['device_kind']}, {one['dtype']}, "
        f"batch {one['config']['batch']} x {one['config']['seq_len']}); mesh axes across "
        f"processes in the 2-process run: {', '.join(two['axes_across_processes']) or 'none'}")
  print(f"{'step':>5} {'1 x 4 GPUs':>12} {'2 x 2 GPUs':>12} {'rel diff':>9}")
  rels = []
  for step, (a, b) in enumerate(zip(one["losses"], two["losses"]), 1):
    rels.append(abs(a - b) / max(abs(a), 1e-30))
    print(f"{step:5d} {a:12.6f} {b:12.6f} {rels[-1]:9.2e}")
  first = max(rels[:10])
  print(f"max rel diff: {first:.2e} (first 10 steps), {max(rels):.2e} (all {len(rels)})")
  print(f"tokens/s (steps 2..{len(rels)}): 1 x 4 GPUs {one['tokens_per_s']:,.0f}, "
        f"2 x 2 GPUs {two['tokens_per_s']:,.0f} ({two['tokens_per_s'] / one['tokens_per_s']:.3f}x)")
  if first > tol:
    print(f"FAIL: {name} losses differ by {first:.2e} > {tol:g} in the first 10 steps")
    ok = False
  curves[name] = (one, two)
try:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
except ImportError:
  curves = {}
if curves:
  fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 3.6), squeeze=False)
  for ax, (name, runs) in zip(axes[0], curves.items()):
    for run, label, style in zip(runs, ("1 process x 4 GPUs", "2 processes x 2 GPUs"), ("-", "--")):
      ax.plot(range(1, len(run["losses"]) + 1), run["losses"], style,
              label=f"{label}: {run['tokens_per_s']:,.0f} tokens/s")
    ax.set(xlabel="step", ylabel="loss", title=name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out / "multihost_losses.png", dpi=110)
  print(f"plot: {out / 'multihost_losses.png'}")
sys.exit(0 if ok else 1)
EOF
exit $rc
