import sys, os, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "benchmarks")
import bench_cp, common, jaxcp
cal = bench_cp.load_calibration("benchmarks/results/placement_calibration_h200.json")
heads = (16, 16); n = 4
arrays, _ = bench_cp.problem(131072, "doc8k", heads, n, bench_cp.placement_cost(cal))
pl, perm = bench_cp.layout("placement", arrays[4], n, bench_cp.placement_cost(cal, heads), None,
                           bench_cp.group_choices(n), bench_cp.exchange_cost(cal, heads, n))
host = [jaxcp.load_balance(x, n, axis=1, strategy=perm) for x in arrays]
q, k, v, do, seg, pos = host
R = q.shape[1] // n
dev = jax.devices()[0]
fwd = jax.jit(lambda q, k, v, qs, qp, ks, kp: jaxcp.attention(q, k, v, segment_ids=qs, positions=qp, kv_segment_ids=ks,
                                                               kv_positions=kp, is_causal=True))
for r in range(n):
  mine = slice(r * R, (r + 1) * R); par = slice((r ^ 1) * R, ((r ^ 1) + 1) * R)
  res = []
  for name, ki in (("own", mine), ("partner", par)):
    a = [jax.device_put(x, dev) for x in (q[:, mine], k[:, ki], v[:, ki], do[:, mine], seg[:, mine], pos[:, mine], seg[:, ki], pos[:, ki])]
    tf = common.time_fn(fwd, a[0], a[1], a[2], a[4], a[5], a[6], a[7], warmup=2, reps=5)
    tb = common.time_fn(bench_cp._local, *a, warmup=2, reps=5)
    res.append(f"{name}: fwd {tf*1e3:.3f} fwd+bwd {tb*1e3:.3f}")
  print("rank", r, " | ".join(res), flush=True)
