#!/usr/bin/env python3
"""A model of the cooperative rows kernel's deferred epilogue (grouped_sm90_rows.cuh with
`kDefer`; deferred_staging, release_held and tma_math_loop's hold_last in
grouped_sm90_parts.cuh).

The ring: kStages stages, each with a "full" mbarrier (the producer's arrive_expect_tx plus the
TMA bytes) and an "empty" one (8 arrivals: the 4 warps of each math warpgroup). Both math
warpgroups compute every tile of the block (rows 0-63 and 64-127), slice by slice. Warpgroup 0
stages its finished 64 x 256 piece of the tile in the stage of the tile's last slice: its warp 0
holds back that stage's arrival (hold_last) and its thread 0 hands the staged pieces to TMA stores;
after it issues the next tile's slice release_at (0 up to kStages - 2; or after the block's last
tile) the same thread waits until its stores have read the stage and then arrives
(release_held). A tile cut in
warpgroup 0's half is stored by the warps themselves from the stage (no TMA stores), which is
then released at once. Warpgroup 1 stages in the kernel's own 32 KiB (two 16 KiB parts): it waits
for all its earlier stores before the first piece, and for all but the latest before the SwiGLU
tile's third piece, which reuses the first part. A tile whose real rows end in warpgroup 0's half
is skipped by warpgroup 1 (it waits for and frees the stages); warpgroup 0 computes every tile
(a tile has at least one real row, in its half first). Both warpgroups meet after each tile's
main loop (a named barrier): warpgroup 1's wgmma may still read the last stage until then.

The model runs the producer, the TMA loads (landing in any order), the TMA stores' reads of the
staging (finishing in any order) and both math warpgroups under random interleavings and checks:
  - every slice a math warpgroup computes is the one it waited for,
  - no load lands in a stage whose wgmma still read it or whose staged piece is not yet read by
    its stores (or read back by the warps), and warpgroup 0 stages nothing in a stage that
    warpgroup 1's wgmma still read,
  - no piece is written into staging that a store still reads,
  - every process finishes (no deadlock).
A broken variant, warpgroup 0 freeing its held stage without waiting for its stores, must fail.
Exit status 0 when both hold.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from mbarrier_model import (Failure, MBar, check, run_processes,  # noqa: E402
                            wait_for_slice)


def run(rng, stages, slices, tile_rows, swiglu, wait_held, release_at=0):
    """One interleaving: the block's tiles have `slices` k-slices each and tile_rows[j] real rows
    (1..128). Raises Failure."""
    full = [MBar(1) for _ in range(stages)]
    empty = [MBar(8) for _ in range(stages)]
    content = [None] * stages  # the slice a stage holds
    reading = [set() for _ in range(stages)]  # slices whose wgmma still read the stage
    staged = [False] * stages  # a stage whose staged pieces the warps have not yet read back
    loads = []  # issued, not landed: (slice, stage)
    stores = {0: [], 1: []}  # per warpgroup, in issue order: [region, still reading]
    total = slices * len(tile_rows)

    def parity(it):
        return (it // stages) & 1

    def producer():
        for it in range(total):
            s = it % stages
            if it >= stages:
                yield lambda s=s, p=parity(it) ^ 1: empty[s].parity_done(p)
            full[s].arrive(1, tx=1)
            loads.append((it, s))
            yield None

    def store_reads(s):
        return any(st[1] and st[0] == s for st in stores[0])

    def tma_loads():
        for _ in range(total):
            yield lambda: bool(loads)
            it, s = loads.pop(rng.randrange(len(loads)))
            if reading[s] or staged[s] or store_reads(s):
                why = (f"slices {reading[s]} read it" if reading[s] else
                       "a staged piece is in it" if staged[s] else "a store reads it")
                raise Failure(f"slice {it} landed in stage {s} while {why}")
            content[s] = it
            full[s].complete_tx(1)

    done = [False, False]
    passed = [0, 0]  # tiles each math warpgroup is through (the rendezvous)

    def tma_stores():
        """Each store group's read of its staging finishes at some point (the list keeps every
        group in issue order: wait_group.read counts the latest ones, finished or not)."""
        while True:
            pending = [st for g in (0, 1) for st in stores[g] if st[1]]
            if not pending:
                if all(done):
                    return
                yield lambda: all(done) or any(st[1] for g in (0, 1) for st in stores[g])
                continue
            rng.choice(pending)[1] = False
            yield None

    def reads_pending(g, keep=0):
        """wait_group.read keep: all but this warpgroup's `keep` latest groups have read."""
        groups = stores[g]
        return lambda: not any(st[1] for st in (groups[:-keep] if keep else groups))

    def math(g):
        held = None  # warpgroup 0's held stage (ring slice)

        def release():
            nonlocal held
            if held is None:
                return
            if wait_held:  # (the broken variant frees it under its stores)
                yield reads_pending(0)
            empty[held % stages].arrive(1)
            held = None

        def rendezvous(j):  # both warpgroups through tile j's main loop (bar.sync 3, 256)
            passed[g] = j + 1
            yield lambda: passed[1 - g] >= j + 1

        for j, n in enumerate(tile_rows):
            base = j * slices
            real = n > 64 * g
            if not real:  # skip_slices, after releasing any held stage
                yield from release()
                for t in range(slices):
                    it = base + t
                    yield lambda s=it % stages, p=parity(it): full[s].parity_done(p)
                    empty[it % stages].arrive(4)
                    yield None
                yield from rendezvous(j)
                continue
            prev = None
            for t in range(slices):
                it = base + t
                s = it % stages
                yield from wait_for_slice(full, content, stages, it, f"warpgroup {g}")
                reading[s].add((g, it))  # its wgmma issued
                if t == release_at:
                    yield from release()
                if prev is not None:  # wgmma_wait<1>: the previous slice's retired
                    reading[prev % stages].discard((g, prev))
                    empty[prev % stages].arrive(4)
                prev = it
                yield None
            last = base + slices - 1
            reading[last % stages].discard((g, last))  # wgmma_wait<0>
            if slices <= release_at:
                yield from release()
            hold = g == 0
            empty[last % stages].arrive(3 if hold else 4)
            yield from rendezvous(j)
            if hold and any(r[0] == 1 for r in reading[last % stages]):
                raise Failure(f"warpgroup 0 staged its pieces in stage {last % stages} while "
                              "warpgroup 1's wgmma read it")
            whole = n >= 64 * g + 64  # the half's rows all real: TMA stores
            pieces = 3 if swiglu else 2
            if hold:
                # (the stage is this warpgroup's: no wait before the pieces)
                held = last
                if whole:
                    stores[0].append([last % stages, True])  # the pieces' stores
                else:  # the warps read the pieces back and store them; then the barrier
                    staged[last % stages] = True
                    yield None
                    staged[last % stages] = False
                    yield from release()
            else:
                for p in range(pieces):
                    region = 0 if p == 2 else p
                    if p == 0:
                        yield reads_pending(1)
                    elif p == 2:
                        yield reads_pending(1, keep=1)
                    if any(st[1] and st[0] == region for st in stores[1]):
                        raise Failure(f"warpgroup 1 wrote staging part {region} while a store "
                                      "read it")
                    if whole:
                        stores[1].append([region, True])
                    yield None
            yield None
        yield from release()
        done[g] = True

    run_processes(rng, [producer(), tma_loads(), tma_stores(), math(0), math(1)])


def random_case(wait_held):
    def one_run(rng):
        stages = rng.randint(3, 6)
        slices = rng.randint(1, 12)
        tiles = rng.randint(1, 8)
        # mostly whole tiles, some cut at an expert's end in either half
        tile_rows = [128 if rng.random() < 0.6 else rng.randint(1, 128) for _ in range(tiles)]
        swiglu = rng.random() < 0.5
        release_at = rng.randint(0, stages - 2)  # the kernel's: 0-2 of 4 stages
        try:
            run(rng, stages, slices, tile_rows, swiglu, wait_held, release_at)
        except Failure as e:
            raise Failure(f"{e} (stages {stages}, slices {slices}, rows {tile_rows}, "
                          f"swiglu {swiglu}, released at slice {release_at})")
    return one_run


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    return check(runs, random_case(True), random_case(False), "deferred epilogue",
                 "held stage freed without waiting for its stores")


if __name__ == "__main__":
    sys.exit(main())
