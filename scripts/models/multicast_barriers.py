#!/usr/bin/env python3
"""A model of the multicast grouped GEMM's barrier protocol (grouped_sm90_rows.cuh, Sched::multicast
and Sched::pingpong_multicast).

Two blocks of a cluster run the same k-slices in the same order. Each block's producer, for
slice it in stage it % kStages: waits on its own empty barrier for the slice kStages before, arms
its own full barrier for the whole stage (A, its half of B, the peer's half of B: 3 parts
here), loads its A into its own stage and its half of B into both blocks' stages (TMA
multicast). Each block's two math warpgroups wait on their own full barrier, read the stage and
free it on both blocks' empty barriers (each counts the 8 math warps of both blocks: 4 arrivals
per warpgroup here, twice). The TMA unit lands every part in any order and at any time after
its issue: a peer's part may complete bytes on a full barrier before its own producer armed it
(mbarrier transaction counts may go below zero; the phase needs the producer's arrival too).
With ping-pong (pingpong_multicast), each block's tiles alternate between its math warpgroups,
which take turns (as scripts/models/pingpong_barriers.py models), and a stage is read by one
warpgroup of each block: its empty barrier counts 4 + 4 warps.

Checked under random interleavings: every slice a warpgroup computes holds all three parts of
that slice (no stale or partial stage), no part lands in a stage a warpgroup still reads (no
overwrite), and everything finishes (no deadlock). It also runs the protocol with each block's
empty barrier counting only its own warps and requires the checks to catch the peer's
overwrite there. Exit status 0 when both hold.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from mbarrier_model import Failure, MBar, check, run_processes  # noqa: E402


def run(rng, stages, tiles, peer_frees, pingpong):
    """tiles[j]: the k-slices of the pair's tile j."""
    slices = sum(tiles)
    readers = 4 if pingpong else 8  # warps of a block that read a stage
    full = [[MBar(1) for _ in range(stages)] for _ in range(2)]
    empty = [[MBar(2 * readers if peer_frees else readers) for _ in range(stages)]
             for _ in range(2)]
    turn = [[MBar(1), MBar(1)] for _ in range(2)]
    parts = [[set() for _ in range(stages)] for _ in range(2)]  # (slice, part) held
    reading = [[set() for _ in range(stages)] for _ in range(2)]
    inflight = []  # (block, stage, slice, part)

    def parity(it):
        return (it // stages) & 1

    def producer(b):
        for it in range(slices):
            s = it % stages
            if it >= stages:
                yield lambda s=s, p=parity(it) ^ 1: empty[b][s].parity_done(p)
            full[b][s].arrive(1, tx=3)
            inflight.append((b, s, it, "A"))
            for dst in (0, 1):  # its half of B into both blocks (multicast)
                inflight.append((dst, s, it, f"B{b}"))
            yield None

    def tma():
        total = 6 * slices
        for _ in range(total):
            yield lambda: bool(inflight)
            b, s, it, part = inflight.pop(rng.randrange(len(inflight)))
            if reading[b][s]:
                raise Failure(f"slice {it}'s {part} landed in block {b}'s stage {s} while "
                              f"slices {reading[b][s]} read it")
            parts[b][s] = {x for x in parts[b][s] if x[0] == it} | {(it, part)}
            full[b][s].complete_tx(1)

    def math(b, g):
        """Warpgroup g of block b: every slice (cooperative), or tile j's for j % 2 == g between
        the turns (ping-pong)."""
        base, k = 0, 0
        for j, n in enumerate(tiles):
            if pingpong and j % 2 != g:
                base += n
                continue
            if pingpong and not (g == 0 and k == 0):
                p = ((k - 1) if g == 0 else k) & 1
                yield lambda p=p: turn[b][g].parity_done(p)
            yield from tile_loop(b, g, base, n)
            if pingpong:
                turn[b][1 - g].arrive()
            base += n
            k += 1

    def tile_loop(b, g, base, n):
        prev = None
        for it in range(base, base + n):
            s = it % stages
            yield lambda s=s, p=parity(it): full[b][s].parity_done(p)
            want = {(it, "A"), (it, "B0"), (it, "B1")}
            if parts[b][s] != want:
                raise Failure(f"block {b} warpgroup {g} waited for slice {it} in stage {s} and "
                              f"found {sorted(parts[b][s])}")
            reading[b][s].add((it, g))
            if prev is not None:
                free(b, g, prev)
            prev = it
            yield None
        if prev is not None:
            free(b, g, prev)

    def free(b, g, it):
        s = it % stages
        reading[b][s].discard((it, g))
        empty[b][s].arrive(4)  # (the warpgroup's 4 warps)
        if peer_frees:
            empty[1 - b][s].arrive(4)

    run_processes(rng, [producer(0), producer(1), tma(), math(0, 0), math(0, 1), math(1, 0),
                        math(1, 1)])


def random_case(peer_frees):
    def one_run(rng):
        pingpong = rng.random() < 0.5
        stages = rng.randint(4 if pingpong else 2, 6)
        n = rng.randint(1, 20)
        tiles = [n] * rng.randint(1, 6)  # (the rows kernel: as many slices every tile)
        try:
            run(rng, stages, tiles, peer_frees, pingpong)
        except Failure as e:
            kind = "ping-pong" if pingpong else "cooperative"
            raise Failure(f"{e} ({kind}, stages {stages}, tiles of {n} slices: {len(tiles)})")
    return one_run


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    return check(runs, random_case(True), random_case(False), "peers free each other's stages",
                 "each block frees only its own")


if __name__ == "__main__":
    sys.exit(main())
