"""What the protocol models of scripts/models/ share: an mbarrier, a scheduler that runs
generator processes under a random interleaving, and the check that a model finds no failure in
the protocol and some in a broken variant of it."""
import random


class MBar:
    """An mbarrier: a phase completes once its arrivals are in and its transaction count is back
    to zero (it may go below zero first: bytes may land before the producer arms the phase)."""

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
        """A parity wait: true once the phase of that parity has completed (it cannot tell
        phase n from n - 2)."""
        return (self.phase & 1) != parity


class Failure(Exception):
    pass


def wait_for_slice(full, content, stages, it, who):
    """A math warpgroup's wait for ring slice `it` (a generator step: yield from it): the parity
    wait on its stage's full barrier, then the check that the stage holds that slice and not one
    a parity wait confused with it (content: the slice each stage holds)."""
    s = it % stages
    yield lambda: full[s].parity_done((it // stages) & 1)
    if content[s] != it:
        raise Failure(f"{who} waited for slice {it} in stage {s} and read slice {content[s]}")


def run_processes(rng, procs):
    """Runs the generators to the end, one step of a random ready one at a time. A process
    yields None (it can go on) or a predicate (it waits until it holds). Raises Failure on a
    deadlock; the processes raise it for their own checks."""
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


def explore(runs, seed, one_run):
    """one_run(rng) runs one random case; returns (failures, the first failure's message)."""
    rng = random.Random(seed)
    failures, first = 0, None
    for _ in range(runs):
        try:
            one_run(rng)
        except Failure as e:
            failures += 1
            first = first or str(e)
    return failures, first


def check(runs, protocol, broken, protocol_name, broken_name, what="interleavings"):
    """The exit status: 0 when the protocol never fails and the broken variant does."""
    return check_variants(runs, protocol, protocol_name, [(broken, broken_name)], what)


def check_variants(runs, protocol, protocol_name, broken_variants, what="interleavings"):
    """The exit status: 0 when the protocol never fails and every broken variant does.
    broken_variants: (one_run, name) pairs; the protocol runs once for all of them."""
    bad, first = explore(runs, 1, protocol)
    print(f"{protocol_name}: {bad} of {runs} {what} failed" + (f": {first}" if first else ""))
    status = 1 if bad else 0
    for broken, broken_name in broken_variants:
        caught, example = explore(runs, 2, broken)
        print(f"{broken_name}: {caught} of {runs} {what} failed" +
              (f", e.g. {example}" if example else ""))
        if not caught:
            print("the model caught nothing in the broken variant: it would not catch a real bug")
            status = 1
    return status
