#!/usr/bin/env python3
"""A model of the sm_90 grouped GEMM's tile schedules (grouped_sm90_rows.cuh, grouped_sm90_dw.cuh):
the index arithmetic by which blocks, math warpgroups and cluster ranks pick their work, against
random expert offsets and grid sizes.

Checked for each schedule (cooperative, pingpong, multicast, pingpong_multicast): every output
row of every column tile is computed and stored exactly once, by a warpgroup whose ring slices
are the ones its block's producer loaded for that tile (the producer walks the block's tiles in
order, `slices` a tile); a ping-pong warpgroup's k-th tile is the block's tile 2k + g; the two
blocks of a multicast pair walk the same pair tiles. For the dw kernel's ping-pong order: every
(expert, chunk, tile) unit is computed once, by the warpgroup of its parity in the block, at the
ring slices the producer gave it. Two broken variants must fail: the ping-pong slice index taken
from the warpgroup's own count (k * slices), and a cooperative warpgroup's ring index advanced only
over the tiles where it has rows (skip_slices' advance left out). Exit status 0 when all hold.
"""
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from mbarrier_model import Failure, check_variants  # noqa: E402

BM = 128


def find_row_tile(offsets, tile, row_tile):
    """grouped_tiles.cuh's find_row_tile: the tile-th row tile over the experts, each cut into
    row_tile rows; (expert, r0, r1) or None past the last."""
    before = 0
    for e in range(len(offsets) - 1):
        count = offsets[e + 1] - offsets[e]
        tiles = (count + row_tile - 1) // row_tile
        if before <= tile < before + tiles:
            r0 = offsets[e] + (tile - before) * row_tile
            return e, r0, min(r0 + row_tile, offsets[e + 1])
        before += tiles
    return None


def sched_row_tile(offsets, tile, multicast, rank):
    if not multicast:
        return find_row_tile(offsets, tile, BM)
    t = find_row_tile(offsets, tile, 2 * BM)
    if t is None:
        return None
    e, s0, s1 = t
    r0 = s0 + BM * rank
    return e, r0, min(s1, r0 + BM)


def walk(offsets, tiles, n_tiles, start, stride, multicast, rank):
    """The tiles a loop from `start` by `stride` visits until the first past the experts' rows:
    (tile, (expert, r0, r1))."""
    tile = start
    while tile < tiles:
        t = sched_row_tile(offsets, tile // n_tiles, multicast, rank)
        if t is None:
            return
        yield tile, t
        tile += stride


def rows_schedule(offsets, n_tiles, grid, slices, sched, broken=None):
    """Who stores which (row, column tile): a dict (row, n) -> count, with slice checks.
    broken: None, "pingpong" or "cooperative" (the module's broken variants)."""
    rows = offsets[-1]
    experts = len(offsets) - 1
    pingpong = sched in ("pingpong", "pingpong_multicast")
    multicast = sched in ("multicast", "pingpong_multicast")
    row_tile = 2 * BM if multicast else BM
    tiles = n_tiles * ((rows + row_tile - 1) // row_tile + experts)
    stored = {}
    blocks = range(grid)
    for b in blocks:
        rank = b % 2 if multicast else 0
        first, step = (b // 2, grid // 2) if multicast else (b, grid)
        # the producer: ring slices of each tile of the block, in order
        loaded = {tile: i * slices
                  for i, (tile, _) in enumerate(walk(offsets, tiles, n_tiles, first, step,
                                                     multicast, rank))}
        # the math warpgroups: a ping-pong one every other tile (its k-th the block's 2k + g),
        # all 128 rows of it; a cooperative one every tile, its 64 rows, its ring index `it`
        # advanced by each tile's slices as the kernel's loop does (a tile without rows of its
        # half skipped by skip_slices, which waits for and frees the slices)
        for g in (0, 1):
            start, stride = (first + g * step, 2 * step) if pingpong else (first, step)
            it = 0
            for k, (tile, (e, r0, r1)) in enumerate(walk(offsets, tiles, n_tiles, start, stride,
                                                         multicast, rank)):
                real = r0 + 64 * g < r1
                if not pingpong and not real:
                    if broken != "cooperative":
                        it += slices
                    continue
                j = (tile - first) // step  # the block's tile j
                if pingpong and (j % 2 != g or j // 2 != k):
                    raise Failure(f"block {b} warpgroup {g}: tile {tile} is the block's tile {j}, "
                                  f"its turn count {k}")
                it0 = (k if broken == "pingpong" else j) * slices if pingpong else it
                it += slices
                if loaded.get(tile) != it0:
                    raise Failure(f"block {b} warpgroup {g} reads tile {tile} at slice {it0}, "
                                  f"loaded at {loaded.get(tile)}")
                lo, hi = (r0, r1) if pingpong else (r0 + 64 * g, min(r1, r0 + 64 * g + 64))
                for r in range(lo, hi):
                    stored[(r, tile % n_tiles)] = stored.get((r, tile % n_tiles), 0) + 1
    for r in range(rows):
        for n in range(n_tiles):
            if stored.get((r, n), 0) != 1:
                raise Failure(f"{sched}: row {r} column tile {n} stored {stored.get((r, n), 0)} "
                              f"times (grid {grid}, offsets {offsets})")
    if len(stored) != rows * n_tiles:
        raise Failure(f"{sched}: rows past the experts stored")


def dw_pingpong(offsets, tiles, chunk, grid, broken=False):
    """The dw kernel's ping-pong order: units (expert, chunk, tile), slices from the chunk rows."""
    units = []
    for e in range(len(offsets) - 1):
        n = offsets[e + 1] - offsets[e]
        if n <= 0:
            continue
        chunks = (n + chunk - 1) // chunk
        for c in range(chunks):
            k0 = offsets[e] + c * chunk
            k1 = min(offsets[e + 1], k0 + chunk)
            for t in range(tiles):
                units.append((e, c, t, (k1 - k0 + 63) // 64))
    done = {}
    for b in range(grid):
        loaded, it = {}, 0
        for u in range(b, len(units), grid):
            loaded[u] = it
            it += units[u][3]
        for g in (0, 1):
            it, j = 0, 0
            for u in range(b, len(units), grid):
                slices = units[u][3]
                if j % 2 != g:
                    it += slices
                    j += 1
                    continue
                at = (sum(units[v][3] for v in range(b, u, grid) if ((v - b) // grid) % 2 == g)
                      if broken else it)
                if loaded[u] != at:
                    raise Failure(f"dw block {b} warpgroup {g} reads unit {u} at slice {at}, "
                                  f"loaded at {loaded[u]}")
                done[u] = done.get(u, 0) + 1
                it += slices
                j += 1
    if any(done.get(u, 0) != 1 for u in range(len(units))):
        raise Failure("dw: a unit computed other than once")


def random_offsets(rng):
    experts = rng.randint(1, 9)
    counts = [rng.choice([0, 1, 3, 64, 65, 127, 128, 129, 255, 256, 257, 500])
              for _ in range(experts)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


def one_run(rng, broken=None):
    offsets = random_offsets(rng)
    if offsets[-1] == 0:
        offsets[-1] = 1
    n_tiles = rng.randint(1, 4)
    slices = rng.randint(1, 6)
    grid = 2 * rng.randint(1, 8)  # (multicast: pairs)
    for sched in ("cooperative", "pingpong", "multicast", "pingpong_multicast"):
        rows_schedule(offsets, n_tiles, grid, slices, sched, broken)
    dw_pingpong(offsets, rng.randint(1, 6), 64 * rng.randint(1, 4), rng.randint(1, 9),
                broken == "pingpong")


def main():
    # (each case runs every schedule: a tenth of the protocol models' count, the same time)
    runs = max(1, (int(sys.argv[1]) if len(sys.argv) > 1 else 3000) // 10)
    return check_variants(
        runs, one_run, "the kernels' schedules",
        [(lambda rng: one_run(rng, "pingpong"), "ping-pong slices from the warpgroup's own count"),
         (lambda rng: one_run(rng, "cooperative"),
          "cooperative slices advanced only over tiles with rows")], "random cases")


if __name__ == "__main__":
    sys.exit(main())
