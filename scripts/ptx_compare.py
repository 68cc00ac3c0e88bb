#!/usr/bin/env python3
"""Do two PTX files hold the same kernels? For refactors that must not change the code a GPU runs
(shared helpers, renamed functions, kernels behind a new switch that is off by default).

Each `.entry` body is normalised (mangled names, basic-block labels and parameter numbers
replaced) and the two files' bodies are compared as multisets, so renaming or reordering
kernels does not count as a change; shared-memory declarations a kernel holds itself (demoted)
or the module holds are compared as a set apart, since a second kernel calling the same device
function moves them from one place to the other. Exit status 0 when every kernel of OLD is in
NEW with the same shared declarations, 1 if not (with a short diff against NEW's closest body),
2 on bad arguments. `--self-test` checks the
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


DEMOTED = re.compile(r"[ \t]*// demoted variable\n[ \t]*\.shared[^\n]*\n")


def normalise(body):
    # A function-scope __shared__ variable used by one kernel is declared inside it ("demoted");
    # once a second kernel calls the same device function it moves to module scope. The code is
    # the same, so the declarations are left out (and blank lines folded).
    body = DEMOTED.sub("", body)
    body = re.sub(r"\n\s*\n", "\n", body)
    body = re.sub(r"_Z\w+", "NAME", body)
    body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
    body = re.sub(r"BB\d+_", "BB_", body)
    body = re.sub(r"_param_\d+", "_param_N", body)
    return body


def entries(path):
    with open(path) as f:
        return [(m.group(1), normalise(m.group(2))) for m in ENTRY.finditer(f.read())]


def shared_declarations(path):
    """The set of static shared-memory declarations (demoted or at module scope), names
    normalised: what leaving the demoted ones out of the bodies must not hide."""
    with open(path) as f:
        lines = re.findall(r"^\s*(?:\.extern\s+)?\.shared[^\n]*", f.read(), re.M)
    return {re.sub(r"_Z\w+(\$\w+)?|\$_\d+", "NAME", line.strip()) for line in lines}


SAMPLE = (".visible .entry _Z3addPfi(\n"
          "\t.param .u64 _Z3addPfi_param_0,\n"
          "\t.param .u32 _Z3addPfi_param_1\n"
          ")\n"
          "{\n"
          "\t// demoted variable\n"
          "\t.shared .align 4 .b8 _ZZ3addPfiE4hist[1024];\n"
          "\tld.param.u64 %rd1, [_Z3addPfi_param_0];\n"
          "$L__BB0_1:\n"
          "\tadd.f32 %f1, %f1, 0f3F800000;\n"
          "\t@%p1 bra $L__BB0_1;\n"
          "\tret;\n"
          "}\n")


def self_test():
    """What the comparison must see: a renamed kernel with renumbered labels, or its demoted
    shared array moved to module scope, is the same; a changed constant or shared array size is
    not. Returns the exit status (0: every case as expected)."""
    import os
    import tempfile
    demoted = "\t// demoted variable\n\t.shared .align 4 .b8 _ZZ3addPfiE4hist[1024];\n"
    cases = {
        "renamed": (SAMPLE.replace("_Z3addPfi", "_Z4add2Pfi").replace("$L__BB0_", "$L__BB7_"), 0),
        "shared moved to module scope":
            (".shared .align 4 .b8 _ZZ3addPfiE4hist[1024];\n" + SAMPLE.replace(demoted, ""), 0),
        "changed constant": (SAMPLE.replace("0f3F800000", "0f40000000"), 1),
        "changed shared size": (SAMPLE.replace("[1024]", "[2048]"), 1),
    }
    failed = []
    with tempfile.TemporaryDirectory() as d:
        old, new = os.path.join(d, "old.ptx"), os.path.join(d, "new.ptx")
        with open(old, "w") as f:
            f.write(SAMPLE)
        for name, (text, want) in cases.items():
            with open(new, "w") as f:
                f.write(text)
            if main(["", old, new]) != want:
                failed.append(name)
    print("self-test:", "every case as expected" if not failed else "WRONG: " + ", ".join(failed))
    return 1 if failed else 0


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
    shared_old, shared_new = shared_declarations(argv[1]), shared_declarations(argv[2])
    if shared_old != shared_new:
        print("shared declarations differ: old only", sorted(shared_old - shared_new),
              "new only", sorted(shared_new - shared_old))
    return 1 if missing or shared_old != shared_new else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
