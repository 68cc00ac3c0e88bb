#!/usr/bin/env python3
"""Do two PTX files hold the same kernels? For refactors that must not change the code a GPU runs
(shared helpers, renamed functions, kernels behind a new switch that is off by default).

Each `.entry` body is normalised (mangled names, basic-block labels and parameter numbers
replaced) and the two files' bodies are compared as multisets, so renaming or reordering
kernels does not count as a change. Exit status 0 when every kernel of OLD is in NEW, 1 if not
(with a short diff against NEW's closest body), 2 on bad arguments. `--self-test` checks the
comparison itself (a CPU test runs it).

  nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DMOE_WITH_CUDA -DMOE_WITH_SM90A \
       -Iinclude -Ikernels -Isrc -ptx kernels/cuda/F.cu -o /tmp/new.ptx
  nvcc -std=c++17 -O3 -arch=compute_75 --expt-relaxed-constexpr -DMOE_WITH_CUDA \
       -Iinclude -Ikernels -Isrc -ptx kernels/cuda/F.cu -o /tmp/new75.ptx   (the T4's code)
  scripts/ptx_compare.py /tmp/old.ptx /tmp/new.ptx
"""
import collections
import difflib
import re
import sys

ENTRY = re.compile(r"\.entry (\S+)\((.*?)\n\}\n", re.S)


def normalise(body):
    body = re.sub(r"_Z\w+", "NAME", body)
    body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
    body = re.sub(r"BB\d+_", "BB_", body)
    body = re.sub(r"_param_\d+", "_param_N", body)
    return body


def entries(path):
    with open(path) as f:
        return [(m.group(1), normalise(m.group(2))) for m in ENTRY.finditer(f.read())]


SAMPLE = """.visible .entry _Z3addPfi(
	.param .u64 _Z3addPfi_param_0,
	.param .u32 _Z3addPfi_param_1
)
{
	ld.param.u64 %rd1, [_Z3addPfi_param_0];
$L__BB0_1:
	add.f32 %f1, %f1, 0f3F800000;
	@%p1 bra $L__BB0_1;
	ret;
}
"""


def self_test():
    """What the comparison must see: a renamed kernel with renumbered labels is the same, a
    changed constant is not. Returns the exit status (0: both hold)."""
    import os
    import tempfile
    renamed = SAMPLE.replace("_Z3addPfi", "_Z4add2Pfi").replace("$L__BB0_", "$L__BB7_")
    changed = SAMPLE.replace("0f3F800000", "0f40000000")
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i, text in enumerate((SAMPLE, renamed, changed)):
            paths.append(os.path.join(d, f"{i}.ptx"))
            with open(paths[-1], "w") as f:
                f.write(text)
        same = main(["", paths[0], paths[1]])
        differs = main(["", paths[0], paths[2]])
    print(f"self-test: renamed {'same' if same == 0 else 'DIFFERENT'}, changed constant "
          f"{'different' if differs == 1 else 'NOT SEEN'}")
    return 0 if same == 0 and differs == 1 else 1


def main(argv):
    if len(argv) == 2 and argv[1] == "--self-test":
        return self_test()
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[0], "\nusage: ptx_compare.py OLD.ptx NEW.ptx")
        return 2
    old, new = entries(argv[1]), entries(argv[2])
    missing = collections.Counter(b for _, b in old) - collections.Counter(b for _, b in new)
    print(f"kernels: old {len(old)}, new {len(new)}; old bodies missing in new: "
          f"{sum(missing.values())}")
    new_bodies = [b for _, b in new]
    for name, body in old:
        if body not in missing or not new_bodies:
            continue
        closest = max(new_bodies,
                      key=lambda b: difflib.SequenceMatcher(None, b[:20000], body[:20000]).quick_ratio())
        diff = list(difflib.unified_diff(body.splitlines(), closest.splitlines(), lineterm="", n=1))
        print(f"missing: {name} ({len(diff)} diff lines against the closest new body)")
        print("\n".join(diff[:60]))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
