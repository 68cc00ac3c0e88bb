#!/usr/bin/env python3
"""A model of the ping-pong grouped GEMM kernels' barrier protocol (grouped_wgmma_sm90.cu).

The kernels' ring: kStages shared-memory stages, each with a "full" mbarrier (the producer's
arrive_expect_tx plus the TMA bytes) and an "empty" one (the 4 warps of the math warpgroup that
computed the stage's slice). The block's tiles (dw: units) alternate between math warpgroups 0
and 1, tile j on warpgroup j % 2; the two main loops take turns through two more mbarriers
(pingpong_wait_turn / pingpong_pass_turn). mbarrier waits are parity waits: a wait for parity p
returns once the barrier's current phase has parity != p, so it cannot tell phase n from n - 2.

The model runs the producer, the TMA unit (loads land in any order) and both math warpgroups as
processes under random interleavings and checks that
  - every slice a math warpgroup computes is the one it waited for (no stale-parity read),
  - no load lands in a stage whose wgmma still reads it (no overwritten stage),
  - every process finishes (no deadlock).
It also runs the protocol without the turns and requires that the checks catch it there (the
stale-parity read the turns exist to prevent): a model that found nothing either way would
prove nothing. Exit status 0 when both hold.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from mbarrier_model import (Failure, MBar, check, run_processes,  # noqa: E402
                            wait_for_slice)


def run(rng, stages, slices, turns_on):
    """One interleaving: slices[j] k-slices for the block's tile j. Raises Failure."""
    full = [MBar(1) for _ in range(stages)]
    empty = [MBar(4) for _ in range(stages)]
    turn = [MBar(1), MBar(1)]
    content = [None] * stages  # the slice a stage holds
    reading = [set() for _ in range(stages)]  # slices whose wgmma still read the stage
    inflight = []  # loads issued, not landed: (slice, stage)

    def parity(it):
        return (it // stages) & 1

    def producer():
        it = 0
        for n in slices:
            for _ in range(n):
                s = it % stages
                if it >= stages:  # the math of slice it - stages retired
                    yield lambda s=s, p=parity(it) ^ 1: empty[s].parity_done(p)
                full[s].arrive(1, tx=1)  # arrive_expect_tx, then the TMA load
                inflight.append((it, s))
                it += 1
                yield None

    def tma():
        total = sum(slices)
        landed = 0
        while landed < total:
            yield lambda: bool(inflight)
            it, s = inflight.pop(rng.randrange(len(inflight)))
            if reading[s]:
                raise Failure(f"slice {it} landed in stage {s} while slices {reading[s]} read it")
            content[s] = it
            full[s].complete_tx(1)
            landed += 1

    def math(g):
        base, k = 0, 0
        for j, n in enumerate(slices):
            if j % 2 != g:
                base += n
                continue
            if turns_on and not (g == 0 and k == 0):
                p = ((k - 1) if g == 0 else k) & 1
                yield lambda p=p: turn[g].parity_done(p)
            prev = None
            for t in range(n):
                it = base + t
                s = it % stages
                yield from wait_for_slice(full, content, stages, it, f"warpgroup {g}")
                reading[s].add(it)  # its wgmma issued
                if prev is not None:  # wgmma_wait<1>: the previous slice's retired
                    reading[prev % stages].discard(prev)
                    empty[prev % stages].arrive(4)
                prev = it
                yield None
            if turns_on:
                turn[1 - g].arrive()
            if prev is not None:  # wgmma_wait<0>
                reading[prev % stages].discard(prev)
                empty[prev % stages].arrive(4)
            base += n
            k += 1
            yield None  # the epilogue

    run_processes(rng, [producer(), tma(), math(0), math(1)])


def random_case(turns_on):
    def one_run(rng):
        stages = rng.randint(4, 6)
        tiles = rng.randint(1, 9)
        uniform = rng.random() < 0.5  # rows kernel: equal slices a tile; dw: any
        n = rng.randint(1, 20)
        slices = [n if uniform else rng.randint(1, 20) for _ in range(tiles)]
        try:
            run(rng, stages, slices, turns_on)
        except Failure as e:
            raise Failure(f"{e} (stages {stages}, slices {slices})")
    return one_run


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    return check(runs, random_case(True), random_case(False), "with turns", "without turns")


if __name__ == "__main__":
    sys.exit(main())
