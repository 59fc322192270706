#!/usr/bin/env bash
# One fio row through NBD against a fresh `blizzard up`, for A/B runs
# between two builds (run it alternately with each BIN):
#
#   BIN=path/to/blizzard RW=randwrite BS=4k QD=1 bench/row.sh
#
# Environment (all optional):
#   BIN=target/release/blizzard   the binary under test
#   MODE=write-through            --mode of the volume (fast-ack, log)
#   REPL=1                        --replication of the volume
#   FLUSH=durable                 --flush policy (ordered)
#   RW=write BS=1M QD=8           the fio row
#   RUNTIME=5                     seconds
#   PREFILL=1                     write the 1 GiB volume sequentially first
#                                 (0: measure a fresh volume, as a new VM sees it)
#   DROP=1                        drop the page cache before the row (0: keep
#                                 what the prefill left there, as bench/nbd.sh does)
#   DIR=/var/tmp/blizzard-row     data directory, removed before and after
#   PORT=10939                    NBD port (the metadata server takes PORT+1)
#   UNIX=0                        1: serve NBD on a unix socket beside DIR, as
#                                 bench/vs-ceph.sh does (TCP loopback costs the
#                                 server more per request)
#   UP_ARGS=                      more flags for `blizzard up`, e.g. "--threads 1"
#   PERF=                         a path: also record the server with `perf record -g`
#                                 while fio runs (then: perf report -i PATH)
#   BLOCKREQ=1                    also count the device requests per operation, by
#                                 kind and size (perf's block:block_rq_issue, whole machine)
#
# Prints one line: IOPS, MB/s, mean and p99 latency and the server's CPU time per
# operation (utime+stime from /proc, and utime alone, from just before fio until one second
# after it). Needs fio with the nbd engine; root for drop_caches.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/blizzard}
MODE=${MODE:-write-through}
REPL=${REPL:-1}
FLUSH=${FLUSH:-durable}
RW=${RW:-write}
BS=${BS:-1M}
QD=${QD:-8}
RUNTIME=${RUNTIME:-5}
PREFILL=${PREFILL:-1}
DIR=${DIR:-/var/tmp/blizzard-row}
PORT=${PORT:-10939}
URI=nbd://127.0.0.1:$PORT/disk
LISTEN=127.0.0.1:$PORT
if [ "${UNIX:-0}" = 1 ]; then
    LISTEN=unix:$DIR.sock
    URI="nbd+unix:///disk?socket=$DIR.sock"
fi
LOG=$(mktemp)

rm -rf "$DIR"
"$BIN" up --data "$DIR" --listen "$LISTEN" --meta-listen "127.0.0.1:$((PORT + 1))" \
    --tractservers 4 --replication "$REPL" --mode "$MODE" --flush "$FLUSH" --size 1GiB ${UP_ARGS:-} > "$LOG" 2>&1 &
PID=$!
trap 'kill -TERM $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$DIR" "$DIR.sock" "$LOG"' EXIT

. bench/lib/up.sh
wait_up "$LOG" "$PID" 180
if [ "$PREFILL" = 1 ]; then
    fio --name=prefill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size=1G > /dev/null
fi
sync
if [ "${DROP:-1}" = 1 ] && [ "$(id -u)" = 0 ]; then echo 3 > /proc/sys/vm/drop_caches; fi
sleep 1

cpu() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
ucpu() { awk '{print $14}' "/proc/$PID/stat"; }
c0=$(cpu)
u0=$(ucpu)
if [ -n "${PERF:-}" ]; then
    perf record -q ${PERF_ARGS:--g} -p "$PID" -o "$PERF" -- sleep "$RUNTIME" 2>/dev/null &
fi
if [ "${BLOCKREQ:-0}" = 1 ]; then
    perf record -q -e block:block_rq_issue -a -o "$DIR.blockreq" -- sleep "$RUNTIME" 2>/dev/null &
    BLOCKREQ_PID=$!
fi
out=$(fio --name=row --ioengine=nbd --uri="$URI" --rw="$RW" --bs="$BS" --iodepth="$QD" --size=1G \
    --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 --output-format=json)
sleep 1
c1=$(cpu)
u1=$(ucpu)
python3 - "$out" "$((c1 - c0))" "$(getconf CLK_TCK)" "$BIN" "$MODE r$REPL $RW bs=$BS qd=$QD prefill=$PREFILL" "$((u1 - u0))" <<'EOF'
import json, sys
j = json.loads(sys.argv[1][sys.argv[1].index("{"):])["jobs"][0]
ticks, hz, binary, row = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
ops = j["read"]["total_ios"] + j["write"]["total_ios"]
iops = j["read"]["iops"] + j["write"]["iops"]
mbps = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6
lat = max(j["read"]["clat_ns"]["mean"], j["write"]["clat_ns"]["mean"]) / 1e3
p99 = max(d["clat_ns"].get("percentile", {}).get("99.000000", 0) for d in (j["read"], j["write"])) / 1e3
cpu = ticks / hz * 1e6 / max(ops, 1)
user = int(sys.argv[6]) / hz * 1e6 / max(ops, 1)
print(f"{row}: {iops:,.0f} IOPS, {mbps:,.0f} MB/s, mean {lat:,.0f} µs, p99 {p99:,.0f} µs, server CPU {cpu:,.1f} µs/op ({user:,.1f} user)  [{binary}]")
EOF
if [ "${BLOCKREQ:-0}" = 1 ]; then
    wait "$BLOCKREQ_PID" 2>/dev/null || true
    # Device requests per fio operation and their mean size, by kind
    # (blktrace's RWBS: W write, S sync, M metadata, FF a cache flush).
    # Counts the whole machine, so keep it otherwise idle.
    ops=$(python3 -c 'import json,sys; t=sys.argv[1]; j=json.loads(t[t.index("{"):])["jobs"][0]; print(j["read"]["total_ios"] + j["write"]["total_ios"])' "$out")
    perf script -i "$DIR.blockreq" 2>/dev/null | awk -v ops="$ops" '
        { for (i = 1; i <= NF; i++) if ($i ~ /^[RWDFSMAN]+$/ && $(i + 1) ~ /^[0-9]+$/) { n[$i]++; b[$i] += $(i + 1); break } }
        END {
            printf "device requests per op:"
            for (k in n) printf "  %s %.2f (mean %.1f KiB)", k, n[k] / ops, b[k] / n[k] / 1024
            print ""
        }'
    rm -f "$DIR.blockreq"
fi
