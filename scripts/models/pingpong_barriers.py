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
import random
import sys


class MBar:
    """An mbarrier: arrivals and transaction bytes complete a phase."""

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
                yield lambda s=s, p=parity(it): full[s].parity_done(p)
                if content[s] != it:
                    raise Failure(f"warpgroup {g} waited for slice {it} in stage {s} and read "
                                  f"slice {content[s]}")
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

    procs = [producer(), tma(), math(0), math(1)]
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


def explore(turns_on, runs, seed):
    rng = random.Random(seed)
    failures = 0
    first = None
    for _ in range(runs):
        stages = rng.randint(4, 6)
        tiles = rng.randint(1, 9)
        uniform = rng.random() < 0.5  # rows kernel: equal slices a tile; dw: any
        n = rng.randint(1, 20)
        slices = [n if uniform else rng.randint(1, 20) for _ in range(tiles)]
        try:
            run(rng, stages, slices, turns_on)
        except Failure as e:
            failures += 1
            first = first or f"{e} (stages {stages}, slices {slices})"
    return failures, first


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    bad, first = explore(True, runs, 1)
    print(f"with turns: {bad} of {runs} interleavings failed" + (f": {first}" if first else ""))
    caught, example = explore(False, runs, 2)
    print(f"without turns: {caught} of {runs} interleavings failed" +
          (f", e.g. {example}" if example else ""))
    if bad:
        return 1
    if not caught:
        print("the model caught nothing without the turns: it would not catch a broken protocol")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
