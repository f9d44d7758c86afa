import sys, re, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "benchmarks")
import doc_mixes, jaxcp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
seg = doc_mixes.packed_row(np.random.default_rng(0), 131072, "doc2k")[None]
seg, _ = doc_mixes.placeable(seg, 4, token_cost=290.6)
pl, perm, _ = jaxcp.choose_placement(seg, 4, token_cost=290.6)
pos = doc_mixes.positions(seg)
mesh = Mesh(np.array(jax.devices()[:4]), ("cp",)); sh = NamedSharding(mesh, P(None, "cp"))
S=131072
q = jnp.zeros((1,S,32,128), jnp.bfloat16); k = jnp.zeros((1,S,8,128), jnp.bfloat16)
args = [jax.device_put(jaxcp.load_balance(x, 4, strategy=perm), sh) for x in (q,k,k,q, jnp.asarray(seg), jnp.asarray(pos))]
def f(q,k,v,do,s,p):
  g=lambda q,k,v: jaxcp.attention(q,k,v,segment_ids=s,positions=p,is_causal=True,context_parallel=pl)
  o,vjp=jax.vjp(g,q,k,v); return (o,*vjp(do))
txt = jax.jit(f).lower(*args).compile().as_text()
open(sys.argv[1],"w").write(txt)
ent = [l for l in txt.splitlines() if re.search(r"all-gather|reduce-scatter|custom-call|collective", l) and "=" in l]
for l in ent: print(re.sub(r", metadata=.*","",l.strip())[:200])
