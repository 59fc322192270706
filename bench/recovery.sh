#!/usr/bin/env bash
# Recovery speed (FDS §3.2, §5.3), in one run:
#
#   bench/recovery.sh [DATA] [DIR]   (defaults: 2GiB, a temp dir under /var/tmp)
#
# For 4, 8 and 16 tractservers in one process (3-way, 8 MiB tracts, 100 ms
# heartbeats, so a silent server is declared dead after 1 s): write DATA of
# 3-way blobs, cap every tractserver's modelled disk (blizzard_env::DiskModel) at 30 MB/s, stop one
# tractserver, and time until every row is fully replicated again. All
# tractservers share this machine's one disk and two CPUs, so the caps stand
# in for separate disks; a second, uncapped run of 16 tractservers shows
# what the machine itself can copy, which must be well above the capped
# rates for those to measure the recovery algorithm and not the machine.
# Prints markdown tables for docs/benchmarks.md (per-survivor detail first,
# then the summary). Needs about 6 times DATA free under DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-2GiB}
DIR=${2:-$(mktemp -d /var/tmp/blizzard-recbench.XXXXXX)}
mkdir -p "$DIR"
log=$(mktemp)
trap 'rm -rf "$DIR" "$log"' EXIT
cargo build --release -q -p blizzard-bench --bin recovery-bench
BIN=${CARGO_TARGET_DIR:-target}/release/recovery-bench

# This kind of machine is a VM whose memory is backed by the host only when
# first touched (see bench/blob.sh): touch most of the free RAM once so the
# first cluster does not pay for it (what is free, not all of it: others
# may be running here).
warm_mb=$(awk '/MemAvailable/ {print int($2/1024) - 4096}' /proc/meminfo)
python3 -c "
import mmap
n = $warm_mb << 20
m = mmap.mmap(-1, n)
for i in range(0, n, 4096): m[i] = 1
"

run() {
    if ! "$BIN" --dir "$DIR" --data "$DATA" "$@" 2>"$log"; then
        tail -n 40 "$log" >&2
        exit 1
    fi
    grep -a -E '^n=' "$log" >&2 || true
}

echo "## Capped: 30 MB/s per tractserver"
echo
run --tractservers 4,8,16 --cap-mbps 30 --detail
echo
echo "## Uncapped: what this machine copies (16 tractservers)"
echo
run --tractservers 16 --cap-mbps 0
