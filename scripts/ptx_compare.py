#!/usr/bin/env python3
"""Do two PTX files hold the same kernels? For refactors that must not change the code a GPU runs
(shared helpers, renamed functions, kernels behind a new switch that is off by default).

Each kernel (`.entry`) and device function (`.func`) with a body is normalised (mangled names
and basic-block labels replaced; parameters keep their numbers) and the two files' bodies are
compared as multisets, so renaming or reordering them does not count as a change. Static data
(shared arrays a kernel holds itself, "demoted", or the module holds; globals; constants) is
compared apart as counted declarations, since a second kernel calling the same device function
moves a demoted array to module scope. Exit status 0 when every body and declaration of OLD is
in NEW (NEW may add kernels of its own), 1 if not (with a short diff against NEW's closest
body), 2 on bad arguments. Not compared: anything else at module scope (e.g. texture or
surface references); the host code. `--self-test` checks the
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

# A kernel (.entry) or device function (.func) with a body: its parameter list, the directives
# before the body (.maxntid, .reqntid, ...) and the body. Prototypes end in ';' and are skipped.
ENTRY = re.compile(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?(\S+)\(([^)]*\)[^{;]*\{.*?)\n\}\n",
                   re.S)
DEMOTED = re.compile(r"[ \t]*// demoted variable\n[ \t]*\.shared[^\n]*\n")
# Static data: shared arrays (demoted into a kernel or at module scope), globals and constants.
DECLARATION = re.compile(r"^\s*(?:\.visible\s+|\.extern\s+|\.weak\s+)*\.(?:shared|global|const)\b[^\n]*",
                         re.M)


def normalise_names(text):
    # Parameter names keep their number (a swapped pair of parameters is a change); every other
    # mangled name becomes NAME.
    text = re.sub(r"_Z\w*?_param_(\d+)\b", r"NAME_param_\1", text)
    return re.sub(r"_Z\w+(\$\w+)?|\$_\d+", "NAME", text)


def normalise(body):
    # A function-scope __shared__ variable used by one kernel is declared inside it ("demoted");
    # once a second kernel calls the same device function it moves to module scope. The code is
    # the same, so the declarations are left out here (declarations() compares them) and blank
    # lines folded.
    body = DEMOTED.sub("", body)
    body = re.sub(r"\n\s*\n", "\n", body)
    body = normalise_names(body)
    body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
    return re.sub(r"BB\d+_", "BB_", body)


def entries(path):
    with open(path) as f:
        return [(m.group(1), normalise(m.group(2))) for m in ENTRY.finditer(f.read())]


def declarations(path):
    """The static data declarations (shared arrays demoted or at module scope, globals,
    constants) with names normalised, counted: what leaving the demoted ones out of the bodies
    must not hide."""
    with open(path) as f:
        return collections.Counter(normalise_names(line.strip())
                                   for line in DECLARATION.findall(f.read()))


SAMPLE = (".shared .align 4 .b8 _ZZ4scanPfE3buf[1024];\n"
          ".func  (.param .b32 func_retval0) _Z4halff(\n"
          "\t.param .b32 _Z4halff_param_0\n"
          ")\n"
          ";\n"
          ".visible .entry _Z3addPfi(\n"
          "\t.param .u64 _Z3addPfi_param_0,\n"
          "\t.param .u32 _Z3addPfi_param_1\n"
          ")\n"
          ".maxntid 128, 1, 1\n"
          "{\n"
          "\t// demoted variable\n"
          "\t.shared .align 4 .b8 _ZZ3addPfiE4hist[1024];\n"
          "\tld.param.u64 %rd1, [_Z3addPfi_param_0];\n"
          "\tld.param.u32 %r1, [_Z3addPfi_param_1];\n"
          "$L__BB0_1:\n"
          "\tadd.f32 %f1, %f1, 0f3F800000;\n"
          "\t@%p1 bra $L__BB0_1;\n"
          "\tret;\n"
          "}\n"
          ".func  (.param .b32 func_retval0) _Z4halff(\n"
          "\t.param .b32 _Z4halff_param_0\n"
          ")\n"
          "{\n"
          "\tmul.f32 %f2, %f1, 0f3F000000;\n"
          "\tret;\n"
          "}\n")


def self_test():
    """What the comparison must see: a renamed kernel with renumbered labels, or its demoted
    shared array moved to module scope, is the same; a changed constant (in a kernel or in a
    device function), a swapped pair of parameters or a changed shared array size (even beside
    another array of the old size) is not. Returns the exit status (0: every case as expected)."""
    import os
    import tempfile
    demoted = "\t// demoted variable\n\t.shared .align 4 .b8 _ZZ3addPfiE4hist[1024];\n"
    swapped = (SAMPLE.replace("_param_0]", "_param_X]").replace("_param_1]", "_param_0]")
               .replace("_param_X]", "_param_1]"))
    cases = {
        "renamed": (SAMPLE.replace("_Z3addPfi", "_Z4add2Pfi").replace("$L__BB0_", "$L__BB7_"), 0),
        "shared moved to module scope":
            (".shared .align 4 .b8 _ZZ3addPfiE4hist[1024];\n" + SAMPLE.replace(demoted, ""), 0),
        "changed constant": (SAMPLE.replace("0f3F800000", "0f40000000"), 1),
        "changed device function": (SAMPLE.replace("0f3F000000", "0f3E800000"), 1),
        "swapped parameters": (swapped, 1),
        "changed shared size": (SAMPLE.replace("hist[1024]", "hist[2048]"), 1),
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
    print(f"bodies (kernels, device functions): old {len(old)}, new {len(new)}; old ones missing in new: "
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
    # (new kernels may bring declarations of their own; every old one must still be there)
    lost = declarations(argv[1]) - declarations(argv[2])
    if lost:
        print("old static data declarations missing in new:", sorted(lost.elements()))
    return 1 if missing or lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
