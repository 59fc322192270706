#!/usr/bin/env python3
"""Greedy log cleaning under uniformly random overwrites, as an ideal model.

The load of `bench/lsvd.sh`'s 16 KiB phase, without anything else: 16 KiB
blocks, 8 MiB objects (512 blocks), 52,428 live blocks (80 % of 1 GiB),
overwritten 3 times at random; cleaning starts when live / stored bytes
drop below the threshold and stops 5 points above it, taking the least-live
object first (greedy). Prints the write amplification of data plus
cleaning (no headers, no checkpoints) per threshold.

Greedy cleaning is optimal under uniform random writes (Yang, Misra and
Rubenstein, "On the Optimality of Greedy Garbage Collection for SSDs",
2015), so this is the floor any cleaner reaches at that threshold under
this load: it shows where a WAF goal can and cannot hold.

    python3 bench/lsvd-gc-model.py           # about a second
"""
import random

BLOCKS_PER_OBJECT = 512
LIVE_BLOCKS = 52428


def waf(low, high, seed=1):
    rng = random.Random(seed)
    where = [None] * LIVE_BLOCKS  # block -> sealed object, or None
    live = {}  # sealed object -> its live blocks
    open_object, next_id, written, copied = [], 0, 0, 0

    def append(block):
        nonlocal open_object, next_id
        old = where[block]
        if old is not None and old in live:
            live[old].discard(block)
        where[block] = None
        open_object.append(block)
        if len(open_object) == BLOCKS_PER_OBJECT:
            live[next_id] = set(open_object)
            for b in open_object:
                where[b] = next_id
            next_id += 1
            open_object = []

    for b in range(LIVE_BLOCKS):
        append(b)
    for _ in range(3 * LIVE_BLOCKS):
        append(rng.randrange(LIVE_BLOCKS))
        written += 1
        if live and LIVE_BLOCKS / (len(live) * BLOCKS_PER_OBJECT) < low:
            while live and LIVE_BLOCKS / (len(live) * BLOCKS_PER_OBJECT) < high:
                victim = min(live, key=lambda o: len(live[o]))
                for b in live.pop(victim):
                    copied += 1
                    where[b] = None
                    append(b)
    return 1 + copied / written


if __name__ == "__main__":
    for low in (0.70, 0.60, 0.50, 0.45, 0.40):
        print(f"threshold {low:.0%}: WAF {waf(low, low + 0.05):.2f}, "
              f"stored per live byte at most {1 / low:.2f}")
