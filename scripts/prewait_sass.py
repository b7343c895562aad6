#!/usr/bin/env python3
"""Which global loads of each kernel come before its PDL wait, as compiled.

ptxas may schedule griddepcontrol.wait (SASS ACQBULK) above loads written before it
(docs/cuda.md), so a kernel's early loads are only early if its SASS says so:

    nvcc ... -cubin src/cuda/qmatmul/qmatmul_decode.cu -o qmatmul_decode.cubin
    python3 scripts/prewait_sass.py qmatmul_decode.cubin [REGEX on the kernel name]

prints, per kernel, how many LDGs come before the first ACQBULK (how many of them
non-coherent, .CONSTANT) and the first few after it, and flags a kernel whose trigger
(griddepcontrol.launch_dependents, SASS PREEXIT) comes before its wait: the decode kernels
trigger right after it, and a trigger above it would let the dependent read, before its
own wait, what this kernel's predecessor is still writing. Needs cuobjdump (and nvdisasm)
on PATH.
"""
import re
import subprocess
import sys


def kernels(sass):
    """{kernel: {"waits": bool, "pre": LDGs before its first ACQBULK, "post": after it,
    "trigger_first": a PREEXIT before its first ACQBULK}} of cuobjdump -sass text."""
    name, rows = None, {}
    for line in sass.splitlines():
        if m := re.search(r"Function : (\S+)", line):
            name = m.group(1)
            rows[name] = {"waits": False, "pre": [], "post": [], "trigger_first": False}
        elif name and (m := re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)):
            ins, r = m.group(1), rows[name]
            if "ACQBULK" in ins and not r["waits"]:
                r["waits"] = True
            elif "PREEXIT" in ins and not r["waits"]:
                r["trigger_first"] = True
            elif ld := re.search(r"\bLDG(?!DEPBAR)\S*", ins):  # LDGDEPBAR waits on cp.async groups: not a load
                (r["post"] if r["waits"] else r["pre"]).append(ld.group(0))
    return rows


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    pattern = re.compile(sys.argv[2] if len(sys.argv) > 2 else ".")
    sass = subprocess.run(["cuobjdump", "-sass", sys.argv[1]], capture_output=True, text=True, check=True).stdout
    for name, r in kernels(sass).items():
        if not pattern.search(name):
            continue
        nc = sum("CONSTANT" in k for k in r["pre"])
        wait = f"{len(r['pre'])} LDG before the wait ({nc} .nc), after: {r['post'][:3]}" if r["waits"] else "no wait"
        print(f"{name}: {wait}" + ("; TRIGGER BEFORE THE WAIT" if r["trigger_first"] else ""))


if __name__ == "__main__":
    main()
