#!/usr/bin/env bash
# What snapshots of a volume in the blob store cost (design 0011, issue 57):
#
#   bench/snapshots.sh [DIR]   (default: a temp dir under /var/tmp)
#
# Environment (all optional):
#   RUNTIME=10     seconds per fio row
#   REPEAT=2       alternated rounds of each comparison (the median is kept)
#   SIZE=4GiB      each volume's size; `snap` is written whole first
#   WORKSET=1GiB   the rows' working set: the first WORKSET bytes of each
#                  volume (written whole before the rows)
#   SNAPSHOTS=1000 snapshots of the volume for the read row
#   CARGO_TARGET_DIR  where the blizzard binary is built (default target)
#
# One `blizzard up --replication 3` (4 tractservers, write-through, durable
# flush) serves three volumes: `plain` (never snapshotted: the baseline),
# `snap` (the one snapshotted), and `w1g` (1 GiB written, for the cost of a
# snapshot of a volume mostly empty). fio's nbd engine, 4 KiB, QD32, one
# connection. Rows, each alternated with the same row on `plain` (plain,
# snap, snap, plain, ...: ABBA):
#
#   first   4 KiB random writes right after a snapshot of `snap` (taken
#           before each round), while its first writes to each chunk go to
#           a new head: first_write_vs_none
#   steady  the same once `snap`'s head holds every chunk (written whole
#           since the last snapshot): steady_write_vs_none
#   read    4 KiB random reads of `snap` with SNAPSHOTS snapshots:
#           read_1000_vs_none
#
# snapshot_ms is the first snapshot of `snap` with SIZE written (the
# costliest: the head's chunk map is asked of the tractservers), as
# `blizzard volume snapshot` reports it from the command to the answer,
# through the serving process's control socket; the first snapshot of
# `w1g` (1 GiB written) and the median of the later ones are printed too.
#
# The last line is:
#   snapshots: first_write_vs_none=A steady_write_vs_none=B read_1000_vs_none=C snapshot_ms=D
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/up.sh
RUNTIME=${RUNTIME:-10}
REPEAT=${REPEAT:-2}
SIZE=${SIZE:-4GiB}
SNAPSHOTS=${SNAPSHOTS:-1000}
command -v fio >/dev/null || apt-get install -y -qq fio
cargo build -q --release -p blizzard-cli --bin blizzard
bin=$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/release/blizzard
base=${1:-/var/tmp}
work=$(mktemp -d "$base/snapshots-bench.XXXXXX")
up_pid=
cleanup() {
    [ -n "$up_pid" ] && kill "$up_pid" 2>/dev/null && wait "$up_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
export BLIZZARD_RUN_DIR=$work/run
sock=$work/nbd.sock
bytes=$(python3 -c "import re,sys; s='$SIZE'; m=re.fullmatch(r'(\d+)(KiB|MiB|GiB)?',s); print(int(m[1])*{None:1,'KiB':1<<10,'MiB':1<<20,'GiB':1<<30}[m[2]])")
ws=$(python3 -c "import re; s='${WORKSET:-1GiB}'; m=re.fullmatch(r'(\d+)(KiB|MiB|GiB)?',s); print(int(m[1])*{None:1,'KiB':1<<10,'MiB':1<<20,'GiB':1<<30}[m[2]])")
# w1g: a quarter of the volume written (1 GiB of the default 4 GiB).
quarter=$(( bytes / 4 ))
# Space, 3-way over 4 disks (tract slots of 8 MiB, whole 1 GiB segments
# touched): snap written whole; plain's working set; snap's head filled
# over the working set for the steady row, and each first row's head (a
# tract written in a layer takes a whole slot however few chunks it holds:
# design 0011, "Space"); w1g's quarter. A quarter as much again: placement
# is not even over 4 disks.
seg=$(( 1 << 30 ))
up_to_seg() { echo $(( ($1 + seg - 1) / seg * seg )); }
need=$(( $(up_to_seg "$bytes") + $(up_to_seg "$ws") * (2 + REPEAT) + $(up_to_seg "$quarter") ))
disk=$(( need * 3 * 5 / 4 / 4 / (1 << 30) + 2 ))GiB

# up's own volume (1 MiB blocks, as up makes it) is w1g; plain and snap are
# made alike by `volume create` (64 KiB blocks), so only snapshots differ.
"$bin" up --data "$work/data" --listen "unix:$sock" --meta-listen 127.0.0.1:0 --replication 3 \
    --tractservers 4 --volume w1g --size "$SIZE" --disk-size "$disk" --mode write-through \
    >"$work/up.log" 2>&1 &
up_pid=$!
wait_up "$work/up.log" "$up_pid" 900
meta=$(grep -o 'status: *blizzard status --meta [^ ]*' "$work/up.log" | awk '{print $NF}')
for v in plain snap; do
    "$bin" volume create "$v" --size "$SIZE" --replication 3 --mode write-through --meta "$meta" >/dev/null
done

uri() { echo "nbd+unix:///$1?socket=$sock"; }
# fio ROW VOLUME EXTRA...: prints IOPS.
fio_row() {
    local rw=$1 vol=$2
    shift 2
    fio --name=row --ioengine=nbd --uri="$(uri "$vol")" --rw="$rw" --bs=4k --iodepth=32 \
        --size="$ws" --time_based --runtime="$RUNTIME" --randrepeat=0 --norandommap \
        --clocksource=clock_gettime --output-format=json --output="$work/fio.json" "$@" >"$work/fio.out" 2>&1 || { cat "$work/fio.out" >&2; exit 1; }
    python3 -c "import json; j=json.load(open('$work/fio.json'))['jobs'][0]; print(round(j['write']['iops'] + j['read']['iops']))"
}
fill() { # fill VOLUME BYTES: sequential 1 MiB writes
    fio --name=fill --ioengine=nbd --uri="$(uri "$1")" --rw=write --bs=1M --iodepth=8 --size="$2" \
        --clocksource=clock_gettime --output-format=json >/dev/null
}
snapshot_ms() { # snapshot_ms VOLUME NAME: the command's own figure
    "$bin" volume snapshot "$1" "$2" --meta "$meta" | grep -o 'in [0-9.]* ms' | awk '{print $2}'
}
# abba ROW: ROW on plain and snap, alternated REPEAT times (plain first in
# odd rounds); fills the arrays a (plain) and b (snap).
abba() {
    a=(); b=()
    for r in $(seq 1 "$REPEAT"); do
        if [ $((r % 2)) = 1 ]; then
            a+=("$(fio_row "$1" plain)"); b+=("$(fio_row "$1" snap)")
        else
            b+=("$(fio_row "$1" snap)"); a+=("$(fio_row "$1" plain)")
        fi
    done
}
median() { python3 -c "import statistics,sys; print(statistics.median(float(x) for x in sys.argv[1:]))" "$@"; }
ratio() { python3 -c "print(f'{$1/$2:.2f}')"; }

echo "== filling snap ($SIZE), plain's working set ($((ws >> 20)) MiB) and a quarter of w1g"
fill plain "$ws"
fill snap "$bytes"
fill w1g "$quarter"
first_ms=$(snapshot_ms snap s0)
w1g_ms=$(snapshot_ms w1g s0)
echo "first snapshot of a $SIZE volume: $first_ms ms with all of it written, $w1g_ms ms with $((quarter >> 20)) MiB written"

# first: a snapshot before each snap row, so its writes are first writes.
a=(); b=()
for r in $(seq 1 "$REPEAT"); do
    if [ $((r % 2)) = 1 ]; then
        a+=("$(fio_row randwrite plain)")
        snapshot_ms snap "f$r" >/dev/null
        b+=("$(fio_row randwrite snap)")
    else
        snapshot_ms snap "f$r" >/dev/null
        b+=("$(fio_row randwrite snap)")
        a+=("$(fio_row randwrite plain)")
    fi
done
none_w=$(median "${a[@]}")
first_w=$(median "${b[@]}")
echo "random write: none ${a[*]} IOPS, right after a snapshot ${b[*]}"

# steady: snap's head holds the whole working set since its last snapshot.
snapshot_ms snap steady >/dev/null
fill snap "$ws"
abba randwrite
none_w2=$(median "${a[@]}")
steady_w=$(median "${b[@]}")
echo "random write: none ${a[*]} IOPS, head written whole since ${b[*]}"

# read: SNAPSHOTS snapshots in all, taken back to back, so every chunk
# read is found through the frozen layers' view (the head holds none).
have=$("$bin" volume list --meta "$meta" | grep -c '^snap@' || true)
later=()
for i in $(seq "$have" $((SNAPSHOTS - 1))); do
    ms=$(snapshot_ms snap "n$i")
    later+=("$ms")
done
echo "snapshots of snap: $("$bin" volume list --meta "$meta" | grep -c '^snap@'); later ones took a median of $(median "${later[@]}") ms"
abba randread
none_r=$(median "${a[@]}")
read_n=$(median "${b[@]}")
echo "random read: none ${a[*]} IOPS, with $SNAPSHOTS snapshots ${b[*]}"
echo "snapshots: first_write_vs_none=$(ratio "$first_w" "$none_w") steady_write_vs_none=$(ratio "$steady_w" "$none_w2") read_1000_vs_none=$(ratio "$read_n" "$none_r") snapshot_ms=$first_ms"
