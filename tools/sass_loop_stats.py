"""The instruction mix of a kernel's tensor-core loops, read from its SASS (no GPU needed): every
loop (a backward branch) whose body issues HGMMA, with its length, its opcodes by count, and what
slows such a loop: local-memory spills (STL/LDL), calls (which make ptxas serialize wgmma), and
waits on the wgmma pipeline (WARPGROUP.DEPBAR). Compare a jaxcp kernel with FlashAttention-3's
built from the same problem, e.g. the backward's consumer loop:

  nvcc ... -DNDEBUG --use_fast_math -c ffi/cuda/attention/bwd_sm90.cu -o bwd.o   (the build's flags)
  python3 tools/sass_loop_stats.py bwd.o 'attention_bwd_sm90_kernel.*bfloat16.*Li128ELi2E'
  python3 tools/sass_loop_stats.py flash_api.so 'FlashAttnBwdSm90.*ILi64EEENS7_ILi128EEESB_'

cuobjdump comes from $CUOBJDUMP, else the PATH (the CUDA toolkit, or pip's nvidia-cuda-cuobjdump);
its -sass runs nvdisasm, which must be on the PATH too (pip's nvidia-cuda-nvdisasm; a toolkit
with nvcc alone has neither).
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"BRA\S*\s+(?:!?U?P[T\d]+,\s*)?0x([0-9a-f]+)")


def functions(sass: str, pattern: str):
    """{mangled name: [(address, instruction)]} of the functions whose name matches pattern."""
    found, name = {}, None
    for line in sass.splitlines():
        if "Function :" in line:
            name = line.split("Function :")[1].strip()
            name = name if re.search(pattern, name) else None
            if name:
                found[name] = []
        elif name:
            m = _INSTRUCTION.match(line)
            if m:
                found[name].append((int(m.group(1), 16), m.group(2)))
    return found


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def mma_loops(instructions, max_len: int):
    """(start, end, body) of the backward branches whose body issues HGMMA, innermost first."""
    index = {a: i for i, (a, _) in enumerate(instructions)}
    loops = []
    for i, (a, text) in enumerate(instructions):
        m = _BRANCH.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < a and target in index:
            body = [t for _, t in instructions[index[target]:i + 1]]
            if any("HGMMA" in t for t in body) and len(body) <= max_len:
                loops.append((target, a, body))
    return sorted(loops, key=lambda x: len(x[2]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", help="an object file, cubin or shared library with sm_90a SASS")
    ap.add_argument("kernel", help="regex on the mangled kernel name")
    ap.add_argument("--max-len", type=int, default=2000, help="longest loop body reported (instructions)")
    ap.add_argument("--top", type=int, default=24, help="opcodes listed per loop")
    a = ap.parse_args()
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not tool:
        sys.exit("cuobjdump not found: set CUOBJDUMP or put the CUDA toolkit's bin on the PATH")
    run = subprocess.run([tool, "-sass", a.binary], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"cuobjdump -sass failed (nvdisasm on the PATH?): {run.stderr.strip()}")
    sass = run.stdout
    found = functions(sass, a.kernel)
    if not found:
        sys.exit(f"no function matches {a.kernel!r}")
    for name, instructions in found.items():
        print(f"{name[:160]}: {len(instructions)} instructions, "
              f"{sum('STL' in t or 'LDL' in t for _, t in instructions)} spill accesses, "
              f"{sum('CALL' in t for _, t in instructions)} calls")
        for start, end, body in mma_loops(instructions, a.max_len):
            ops = collections.Counter(opcode(t) for t in body)
            spills = sum("STL" in t or "LDL" in t for t in body)
            print(f"  loop {start:#x}-{end:#x}: {len(body)} instructions, {ops['HGMMA']} HGMMA "
                  f"({sum('HGMMA' in t and 'gsb0' in t for t in body)} closing a group), "
                  f"{sum('DEPBAR' in t for t in body)} wgmma waits, {spills} spill accesses, "
                  f"{ops['CALL']} calls")
            print("    " + ", ".join(f"{k} {v}" for k, v in ops.most_common(a.top)))


if __name__ == "__main__":
    main()
