#!/usr/bin/env python3
"""A model of the MoD selection's radix select (kernels/cuda/mod_select.cuh, select_sequence) with
and without its common-digit skip (kSkipCommon, MOE_MOD_SELECT_SKIP).

select_sequence keeps the C largest of a sequence's T scores, ties to the lower position, by
order-preserving integer keys (score_key): 8-bit digit passes from the top narrow a prefix
(prefix, pmask) and the rank k within it until the C-th key's bin is found; then one pass keeps
every key above the prefix and the first k equal to it. The skip ANDs and ORs all keys first and
starts the passes at the first digit in which two keys differ, taking the digits before it as the
prefix. The model runs the kernel's arithmetic (find_digit's bin search from the top included)
on random, tied, signed-zero, narrow-range and all-equal scores of 16-, 32- and 64-bit keys and
checks both forms against a sort; a broken skip (starting one digit too late) must fail.
Exit status 0 when both hold.
"""
import os
import random
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from mbarrier_model import Failure, check  # noqa: E402

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


def select(keys, c, bits, skip, broken=False):
    """select_sequence's kept positions, ascending."""
    t = len(keys)
    prefix, pmask, k = 0, 0, c
    if 0 < c < t:
        pass0 = 0
        if skip:
            a, o = (1 << bits) - 1, 0
            for key in keys:
                a &= key
                o |= key
            differ = a ^ o
            passes = bits // DIGIT
            pass0 = passes if differ == 0 else (bits - 1 - (differ.bit_length() - 1)) // DIGIT
            if broken and pass0 < passes:
                pass0 += 1
            for p in range(pass0):
                pmask |= (BINS - 1) << (bits - (p + 1) * DIGIT)
            prefix = a & pmask
        for p in range(pass0, bits // DIGIT):
            shift = bits - (p + 1) * DIGIT
            hist = [0] * BINS
            for key in keys:
                if key & pmask == prefix:
                    hist[(key >> shift) & (BINS - 1)] += 1
            d, k, n = find_digit(hist, k)
            prefix |= d << shift
            pmask |= (BINS - 1) << shift
            if n == k:
                break
    kept, ties = [], 0
    for i, key in enumerate(keys):
        m = key & pmask
        if m > prefix or (m == prefix and ties < k):
            kept.append(i)
        ties += m == prefix
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


def case(broken):
    def one_run(rng):
        bits = rng.choice([16, 32, 64])
        t = rng.randint(1, 300)
        c = rng.randint(1, t)
        values, kind = random_scores(rng, t, bits)
        keys = [score_key(x, bits) for x in values]
        want = reference(values, c, bits)
        for skip in (False, True):
            got = select(keys, c, bits, skip, broken and skip)
            if got != want:
                raise Failure(f"{'skip' if skip else 'plain'}: {bits}-bit keys, {kind} scores, "
                              f"T {t}, C {c}: {len(set(got) ^ set(want))} positions differ")
    return one_run


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    return check(runs, case(False), case(True), "select with and without the skip",
                 "skip starting a digit late", "random cases")


if __name__ == "__main__":
    sys.exit(main())
