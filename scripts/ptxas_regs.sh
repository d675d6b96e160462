#!/usr/bin/env bash
# Registers, spills and code size per kernel of one CUDA source file, this tree against a git revision (docs/GPU.md,
# "Epilogue instances"). An edit to an epilogue changes the register allocation of the whole kernel it is
# inlined into (the k-loop's rounds in flight included): check this before spending device time on an A/B.
#
#   scripts/ptxas_regs.sh [REV] [FILE]        (defaults HEAD, src/kernels/cuda/matmul.cu)
#
# Compiles FILE of REV and of the working tree in parallel (sm_90a cubins, ~3-4 min for matmul.cu on two
# cores) and prints every kernel whose registers, spill bytes or SASS bytes (its .text section in the cubin)
# differ, then the kernels that spill in the working tree. Code size matters as much as registers here: each
# kernel of a decode step starts with a cold instruction cache, and the 32-token kernels that carried every
# epilogue (~100 KB of SASS each) ran 6-7 % slower than one-epilogue instances of 40-60 KB. Kernel names
# lose their anonymous-namespace hash, so the two builds' names match; a kernel that gained a trailing
# template parameter is compared with the revision's kernel without it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REV=${1:-HEAD}
FILE=${2:-src/kernels/cuda/matmul.cu}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/old"
git -C "$ROOT" archive "$REV" src | tar x -C "$work/old"
compile() {  # src_root out_log
  "$NVCC" -DMERLIN_HAVE_CUDA -I"$1/src" -O3 -DNDEBUG -arch=sm_90a -cubin -lineinfo --expt-relaxed-constexpr \
    -std=c++17 -Xptxas -v -x cu "$1/$FILE" -o "$2.cubin" > "$2" 2>&1
}
compile "$work/old" "$work/old.log" &
compile "$ROOT" "$work/new.log" &
wait
python3 - "$work/old.log" "$work/new.log" "$REV" <<'EOF'
import re, shutil, subprocess, sys

def strip_hash(name):
    return re.sub(r"_GLOBAL__N__\w+?_\d+|\d+_\w+?_cu_[0-9a-f]{8}", "", name)

def code_sizes(cubin):  # SASS bytes per kernel: the size of its .text section
    out = subprocess.run(["readelf", "-S", "-W", cubin], capture_output=True, text=True).stdout
    pat = r"\.text\.(\S+)\s+PROGBITS\s+[0-9a-f]+\s+[0-9a-f]+\s+([0-9a-f]+)"
    return {strip_hash(m.group(1)): int(m.group(2), 16) for m in re.finditer(pat, out)}

def parse(path):
    sizes = code_sizes(path + ".cubin")
    kernels, cur = {}, None
    for line in open(path):
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            cur = strip_hash(m.group(1))
            kernels[cur] = {"regs": 0, "spill": (0, 0), "code": sizes.get(cur, 0)}
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            kernels[cur]["regs"] = int(m.group(1))
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur:
            kernels[cur]["spill"] = (int(m.group(1)), int(m.group(2)))
    return kernels

def demangle(kernels):
    if not shutil.which("c++filt"):
        return kernels
    names = list(kernels)
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    # The stripped namespace shifts the mangling's substitutions, so the argument list reads wrong: drop it.
    short = lambda d: re.sub(r"^void |\(.*\)$", "", d)
    return {short(out[i]) if i < len(out) and out[i] else n: kernels[n] for i, n in enumerate(names)}

old, new = demangle(parse(sys.argv[1])), demangle(parse(sys.argv[2]))
rev = sys.argv[3]
fmt = lambda k: f"{k['regs']:3d} regs, spill {k['spill'][0]:4d}/{k['spill'][1]:4d}, {k['code'] / 1024:6.1f} KiB"
def counterpart(n):  # the revision's kernel for tree kernel n (the same name, or n without its last parameter)
    if n in old:
        return n
    shorter = re.sub(r", [^,<>]+>$", ">", n)
    return shorter if shorter in old else None

pairs = {n: counterpart(n) for n in new}
changed = [n for n in sorted(new) if pairs[n] and old[pairs[n]] != new[n]]
print(f"{len(new)} kernels ({len(old)} in {rev}); {len(changed)} changed")
for n in changed:
    print(f"  {rev}: {fmt(old[pairs[n]])}  tree: {fmt(new[n])}  {n}")
for n in sorted(n for n in new if not pairs[n]):
    print(f"  only in tree: {fmt(new[n])}  {n}")
for n in sorted(set(old) - set(pairs.values())):
    print(f"  only in {rev}: {n}")
spilling = [n for n in sorted(new) if new[n]["spill"] != (0, 0)]
print(f"{len(spilling)} kernels spill in the tree:")
for n in spilling:
    print(f"  {fmt(new[n])}  {n}")
EOF
