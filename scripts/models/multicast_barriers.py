#!/usr/bin/env python3
"""A model of the multicast grouped GEMM's barrier protocol (grouped_wgmma_sm90.cu, Sched::multicast).

Two blocks of a cluster run the same k-slices in the same order. Each block's producer, for
slice it in stage it % kStages: waits on its own empty barrier for the slice kStages before, arms
its own full barrier for the whole stage (A, its half of B, the peer's half of B: 3 parts
here), loads its A into its own stage and its half of B into both blocks' stages (TMA
multicast). Each block's two math warpgroups wait on their own full barrier, read the stage and
free it on both blocks' empty barriers (each counts the 8 math warps of both blocks: 4 arrivals
per warpgroup here, twice). The TMA unit lands every part in any order and at any time after
its issue: a peer's part may complete bytes on a full barrier before its own producer armed it
(mbarrier transaction counts may go below zero; the phase needs the producer's arrival too).

Checked under random interleavings: every slice a warpgroup computes holds all three parts of
that slice (no stale or partial stage), no part lands in a stage a warpgroup still reads (no
overwrite), and everything finishes (no deadlock). It also runs the protocol with each block's
empty barrier counting only its own warps and requires the checks to catch the peer's
overwrite there. Exit status 0 when both hold.
"""
import random
import sys


class MBar:
    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, n=1, tx=0):
        self.tx += tx
        self.pending -= n
        assert self.pending >= 0, "more arrivals than the barrier's count"
        self._complete()

    def complete_tx(self, tx):
        self.tx -= tx
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def parity_done(self, parity):
        return (self.phase & 1) != parity


class Failure(Exception):
    pass


def run(rng, stages, slices, peer_frees):
    full = [[MBar(1) for _ in range(stages)] for _ in range(2)]
    empty = [[MBar(16 if peer_frees else 8) for _ in range(stages)] for _ in range(2)]
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
        prev = None
        for it in range(slices):
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
        empty[b][s].arrive(4)
        if peer_frees:
            empty[1 - b][s].arrive(4)

    procs = [producer(0), producer(1), tma(), math(0, 0), math(0, 1), math(1, 0), math(1, 1)]
    waits = [None] * len(procs)
    live = list(range(len(procs)))
    while live:
        ready = [i for i in live if waits[i] is None or waits[i]()]
        if not ready:
            raise Failure("deadlock: no process can go on")
        i = rng.choice(ready)
        try:
            waits[i] = next(procs[i])
        except StopIteration:
            live.remove(i)


def explore(peer_frees, runs, seed):
    rng = random.Random(seed)
    failures, first = 0, None
    for _ in range(runs):
        stages = rng.randint(2, 6)
        slices = rng.randint(1, 40)
        try:
            run(rng, stages, slices, peer_frees)
        except Failure as e:
            failures += 1
            first = first or f"{e} (stages {stages}, slices {slices})"
    return failures, first


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    bad, first = explore(True, runs, 1)
    print(f"peers free each other's stages: {bad} of {runs} interleavings failed" +
          (f": {first}" if first else ""))
    caught, example = explore(False, runs, 2)
    print(f"each block frees only its own: {caught} of {runs} interleavings failed" +
          (f", e.g. {example}" if example else ""))
    if bad:
        return 1
    if not caught:
        print("the model caught nothing in the broken protocol: it would not catch a real bug")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
