#!/usr/bin/env python3
"""What a durable 4 KiB write costs on this disk, with and without a
checksum entry kept elsewhere in the same file.

    bench/durable_floor.py FILE SECONDS

FILE must already exist and be written (not sparse or unwritten). Each
operation is one of, drawn at random so that both see the same disk:

  one page:  pwrite 4 KiB at a random offset, fdatasync
  + entry:   pwrite a 16-byte entry into a table at the front of the file,
             pwrite 4 KiB at a random offset past the table, fdatasync

The second is the shape of a tractserver's durable write (design 0002: the
chunk's data and its 16-byte chunk entry, one group-commit fdatasync). On a
disk that serves requests one at a time the entry's page is one more device
request per write. Prints one JSON object: mean and median microseconds
per operation of each kind.
"""

import json
import os
import random
import sys
import time

PAGE = 4096
ENTRY = 16


def main():
    path, seconds = sys.argv[1], float(sys.argv[2])
    fd = os.open(path, os.O_RDWR)
    size = os.fstat(fd).st_size
    # One 16-byte entry per 4 KiB page, as the chunk table has.
    table = size // PAGE * ENTRY
    pages = (size - table) // PAGE
    if pages < 1024:
        sys.exit(f"{path}: {size} bytes is too small; give a file of at least 64 MiB")
    data, entry = os.urandom(PAGE), os.urandom(ENTRY)

    def one_page():
        os.pwrite(fd, data, table + random.randrange(pages) * PAGE)
        os.fdatasync(fd)

    def with_entry():
        page = random.randrange(pages)
        os.pwrite(fd, entry, page * ENTRY)
        os.pwrite(fd, data, table + page * PAGE)
        os.fdatasync(fd)

    kinds = {"one_page": one_page, "with_entry": with_entry}
    times = {k: [] for k in kinds}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        kind = random.choice(list(kinds))
        t = time.perf_counter()
        kinds[kind]()
        times[kind].append(time.perf_counter() - t)
    os.close(fd)
    out = {}
    for kind, ts in times.items():
        ts.sort()
        out[kind] = {
            "ops": len(ts),
            "mean_us": round(sum(ts) / len(ts) * 1e6, 1),
            "p50_us": round(ts[len(ts) // 2] * 1e6, 1),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
