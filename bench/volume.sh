#!/usr/bin/env bash
# Virtual-disk benchmarks (Blizzard §4.4, §4.7, §2.3), in one run:
#
#   bench/volume.sh [DIR]     (default: a temp dir under /var/tmp)
#
# (a) commit: 4 KiB and 64 KiB random writes at queue depth 16 with a flush
#     every 4 and every 20 writes, against 4 tractservers that inject 1 ms
#     and 5 ms per request (standing in for a remote disk's seek and the
#     network; requests wait concurrently), each commit mode and flush
#     policy side by side. The volume's block size equals the write size.
# (b) loss: an open-loop writer at 50..3000 writes/s with 1 and 4 writes
#     per flush (ordered flushes, 5 ms delay); at 100 random instants per
#     point, the acknowledged-but-not-durable writes and KiB a crash would
#     lose (the paper's Figures 13-14).
# (c) seqread: 1 GiB read sequentially in 1 MiB requests at QD 4 from
#     volumes striped with segments of 1 and of 128 tracts over 8
#     tractservers whose modelled disks (DiskModel) serve one request at a time
#     (1 ms per request + 100 MiB/s transfer).
#
# Everything (client and tractservers) runs in one process; the CPU column
# is that process's CPU time per acknowledged write. Prints markdown tables
# for docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-$(mktemp -d /var/tmp/blizzard-volbench.XXXXXX)}
mkdir -p "$DIR"
trap 'rm -rf "$DIR"' EXIT
cargo build --release -q -p blizzard-bench --bin volume-bench
BIN=${CARGO_TARGET_DIR:-target}/release/volume-bench

echo "## (a) commit modes: IOPS at QD 16, flush every N writes"
$BIN --data "$DIR" --delay-ms 1,5 commit --sizes 4KiB,64KiB --flush-every 4,20 --qd 16
echo
echo "## (b) data a crash would lose vs write rate (ordered flushes, 5 ms delay)"
$BIN --data "$DIR" --delay-ms 5 loss --sizes 4KiB,64KiB --wpf 1,4 --rates 50,100,300,1000,3000
echo
echo "## (c) sequential read by segment size"
$BIN --data "$DIR" --tractservers 8 --delay-ms 1 --arms 1 --disk-bandwidth 100MB seqread --segments 1,128
