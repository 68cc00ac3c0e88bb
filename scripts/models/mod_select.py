#!/usr/bin/env python3
"""A model of the MoD selection (kernels/cuda/mod_select.cuh): select_sequence's radix passes
and select_one_per_thread's bitwise search (T no more than the block's threads).

Both keep the C largest of a sequence's T scores, ties to the lower position, by order-preserving
integer keys (score_key). The radix select: 8-bit digit passes from the top narrow a prefix
(prefix, pmask) and the rank k within it until the C-th key's bin is found; then one pass keeps
every key above the prefix and the first k equal to it. The bitwise search builds the C-th
largest key p bit by bit from the top, keeping a bit when at least C keys reach the candidate
(one block-wide count a bit), and stops when exactly C do. The model runs the kernels'
arithmetic (find_digit's bin search from the top included) on random, tied, signed-zero,
narrow-range and all-equal scores of 16-, 32- and 64-bit keys and checks both forms against a
sort; radix passes that stop after the first digit and a bitwise search that stops at the first
count of C or more must fail. Exit status 0 when all hold.
"""

import os
import random
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from mbarrier_model import Failure, check_variants  # noqa: E402

DIGIT = 8
BINS = 1 << DIGIT


def score_key(v, bits):
    """score_key: the float's bits, +-0 alike, negatives reversed below positives."""
    if bits == 16:
        b = struct.unpack("<H", struct.pack("<e", v))[0]
    elif bits == 32:
        b = struct.unpack("<I", struct.pack("<f", v))[0]
    else:
        b = struct.unpack("<Q", struct.pack("<d", v))[0]
    sign = 1 << (bits - 1)
    full = (1 << bits) - 1
    if b & ~sign & full == 0:
        b = 0
    return (~b & full) if b & sign else (b | sign)


def find_digit(hist, k):
    """The bin, from the top, holding the k-th largest candidate; k within it; its count."""
    above = 0
    for d in range(BINS - 1, -1, -1):
        n = hist[d]
        if above + n >= k:
            return d, k - above, n
        above += n
    raise Failure("find_digit: fewer candidates than k")


def select(keys, c, bits, broken=False):
    """select_sequence's kept positions (the radix passes), ascending."""
    t = len(keys)
    prefix, pmask, k = 0, 0, c
    if 0 < c < t:
        for p in range(bits // DIGIT):
            shift = bits - (p + 1) * DIGIT
            hist = [0] * BINS
            for key in keys:
                if key & pmask == prefix:
                    hist[(key >> shift) & (BINS - 1)] += 1
            d, k, n = find_digit(hist, k)
            prefix |= d << shift
            pmask |= (BINS - 1) << shift
            if n == k or broken:
                break
    kept, ties = [], 0
    for i, key in enumerate(keys):
        m = key & pmask
        if m > prefix or (m == prefix and ties < k):
            kept.append(i)
        ties += m == prefix
    return kept


def select_bitwise(keys, c, bits, broken=False):
    """select_one_per_thread's kept positions, ascending."""
    t = len(keys)
    gt, eq, k = [False] * t, [False] * t, 0
    if c >= t:
        gt = [True] * t
    elif c > 0:
        p, exact = 0, False
        for bit in range(bits - 1, -1, -1):
            cand = p | (1 << bit)
            n = sum(key >= cand for key in keys)  # __syncthreads_count
            if n >= c:
                p = cand
                if n == c or broken:
                    exact = True
                    break
        if exact:
            gt = [key >= p for key in keys]
        else:
            gt = [key > p for key in keys]
            eq = [key == p for key in keys]
            k = c - sum(gt)
    kept, gt_before, eq_before = [], 0, 0  # block_exclusive_scan2, then the slot of each kept
    slots = {}
    for i in range(t):
        if gt[i] or (eq[i] and eq_before < k):
            slots[gt_before + min(eq_before, k)] = i
        gt_before += gt[i]
        eq_before += eq[i]
    if sorted(slots) != list(range(len(slots))):
        raise Failure(f"bitwise: output slots {sorted(slots)[:8]}... not 0..{len(slots) - 1}")
    kept = [slots[j] for j in range(len(slots))]
    return kept


def reference(values, c, bits):
    """The C largest by key, ties to the lower position, ascending."""
    order = sorted(range(len(values)), key=lambda i: (-score_key(values[i], bits), i))
    return sorted(order[:c])


def random_scores(rng, t, bits):
    kind = rng.choice(["wide", "narrow", "tied", "zeros", "equal", "negative"])
    if kind == "wide":
        v = [rng.uniform(-6e4, 6e4) for _ in range(t)]
    elif kind == "narrow":
        v = [rng.uniform(0.25, 0.4) for _ in range(t)]
    elif kind == "tied":
        v = [rng.choice([1.0, -1.0, 0.5, 3e-5, -3e-5]) for _ in range(t)]
    elif kind == "zeros":
        v = [rng.choice([0.0, -0.0, -0.5]) for _ in range(t)]
    elif kind == "equal":
        v = [0.5] * t
    else:
        v = [rng.uniform(-0.4, -0.3) for _ in range(t)]
    # rounded as the dtype stores them
    fmt = {16: "<e", 32: "<f", 64: "<d"}[bits]
    return [struct.unpack(fmt, struct.pack(fmt, x))[0] for x in v], kind


def case(broken_radix=False, broken_bitwise=False):
    def one_run(rng):
        bits = rng.choice([16, 32, 64])
        t = rng.randint(1, 300)
        c = rng.randint(0, t)
        values, kind = random_scores(rng, t, bits)
        keys = [score_key(x, bits) for x in values]
        want = reference(values, c, bits)
        forms = {
            "radix": lambda: select(keys, c, bits, broken_radix),
            "bitwise": lambda: select_bitwise(keys, c, bits, broken_bitwise),
        }
        for name, form in forms.items():
            got = form()
            if got != want:
                raise Failure(f"{name}: {bits}-bit keys, {kind} scores, T {t}, C {c}: "
                              f"{len(set(got) ^ set(want))} positions differ")
    return one_run


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    return check_variants(runs, case(), "the radix passes and the bitwise search",
                          [(case(broken_radix=True), "radix passes stopping after the first digit"),
                           (case(broken_bitwise=True), "bitwise search stopping at C or more")],
                          "random cases")


if __name__ == "__main__":
    sys.exit(main())
