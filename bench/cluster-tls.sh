#!/usr/bin/env bash
# What an authenticated cluster costs (issue 26, point 2): two clusters of
# separate processes on this machine, the same in all but TLS, each a
# `blizzard meta`, 4 `blizzard tractserver`s and a `blizzard nbd` serving a
# 3-way write-through volume: one with --insecure (plain TCP between them),
# one with certificates from `blizzard ca` (every connection between the
# processes mutual TLS, roles checked). fio reaches both through plain NBD
# on a unix socket, so only the cluster's own connections differ. Rows
# alternate between the two clusters, REPEAT rounds (3), medians:
#
#   bench/cluster-tls.sh                   (RUNTIME=10 by default)
#
# Rows: 4 KiB random write and read at QD32, 1 MiB sequential write at QD8.
# Server CPU per operation: utime+stime of all six processes of a cluster.
# Prints a markdown table; the last line is
#   cluster-tls: write_iops=A write_cpu=B read_iops=C read_cpu=D seqwrite=E
# each TLS ÷ plain (IOPS, and CPU per I/O: above 1 is TLS costing more).
# ROWS="w1m" runs only those rows (and prints no last line).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/blizzard}
RUNTIME=${RUNTIME:-10}
REPEAT=${REPEAT:-3}
DIR=${DIR:-/var/tmp/blizzard-cluster-tlsbench}
PORT=${PORT:-10970}
RESULTS=$(mktemp)
[ -x "$BIN" ] || cargo build --release -q -p blizzard-cli

rm -rf "$DIR"
mkdir -p "$DIR"
PIDS=()
stop() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$DIR" "$RESULTS"
}
trap stop EXIT

"$BIN" ca init "$DIR/ca" > /dev/null
for n in meta ts0 ts1 ts2 ts3 nbd admin; do
    case $n in meta) r=meta ;; ts*) r=tractserver ;; nbd) r=nbd ;; *) r=admin ;; esac
    "$BIN" ca issue "$n" --role "$r" "$DIR/ca" > /dev/null
done

# start_cluster NAME PORT AUTH... : a cluster under $DIR/NAME; AUTH is
# --insecure or --tls-certificates (each process then gets its own).
start_cluster() {
    local name=$1 port=$2 tls=$3 d=$DIR/$1
    mkdir -p "$d"
    auth() { if [ "$tls" = tls ]; then echo "--tls-certificates $DIR/ca/$1"; else echo --insecure; fi; }
    # shellcheck disable=SC2046 # auth is two words or one
    "$BIN" meta --listen "127.0.0.1:$port" --replication 3 --init-tractservers 4 $(auth meta) \
        > "$d/meta.log" 2>&1 &
    PIDS+=($!)
    echo "$!" > "$d/pids"
    for i in 0 1 2 3; do
        # shellcheck disable=SC2046
        "$BIN" tractserver --disk "$d/ts$i.disk" --create-size 1536MiB --meta "127.0.0.1:$port" \
            --listen "127.0.0.1:$((port + 1 + i))" $(auth "ts$i") > "$d/ts$i.log" 2>&1 &
        PIDS+=($!)
        echo "$!" >> "$d/pids"
    done
    local deadline=$((SECONDS + 120))
    until [ "$(cat "$d"/ts*.log | grep -c 'zero-fill done')" -ge 4 ] && [ "$(cat "$d"/ts*.log | grep -c ' listening on ')" -ge 4 ]; do
        [ $SECONDS -lt $deadline ] || { echo "cluster $name not up; logs:" >&2; tail -5 "$d"/*.log >&2; exit 1; }
        sleep 0.5
    done
    sleep 2
    # shellcheck disable=SC2046
    "$BIN" volume create disk --size 1GiB --replication 3 --meta "127.0.0.1:$port" $(auth admin) > /dev/null
    # shellcheck disable=SC2046
    "$BIN" nbd --meta "127.0.0.1:$port" --socket "$d/nbd.sock" --default-export disk --tls off \
        $( [ "$tls" = tls ] && echo "--tls-certificates $DIR/ca/nbd" ) > "$d/nbd.log" 2>&1 &
    PIDS+=($!)
    echo "$!" >> "$d/pids"
    until grep -qs 'NBD export' "$d/nbd.log"; do
        [ $SECONDS -lt $deadline ] || { echo "nbd of $name not up" >&2; tail -5 "$d/nbd.log" >&2; exit 1; }
        sleep 0.2
    done
    fio --name=prefill --ioengine=nbd --uri="nbd+unix:///disk?socket=$d/nbd.sock" --rw=write --bs=1M \
        --iodepth=8 --size=1G > /dev/null
}
start_cluster plain "$PORT" plain
start_cluster tls "$((PORT + 10))" tls

# CPU ticks of every process of cluster NAME.
cpu() { local t=0 p; for p in $(cat "$DIR/$1/pids"); do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $t; }
row() { # CLUSTER RW BS QD NAME
    local c0 c1 out
    sync
    c0=$(cpu "$1")
    out=$(fio --name=row --ioengine=nbd --uri="nbd+unix:///disk?socket=$DIR/$1/nbd.sock" --rw="$2" --bs="$3" \
        --iodepth="$4" --size=1G --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 --output-format=json)
    sleep 1
    c1=$(cpu "$1")
    python3 - "$out" "$((c1 - c0))" "$(getconf CLK_TCK)" "$5-$1" >> "$RESULTS" <<'PY'
import json, sys
j = json.loads(sys.argv[1][sys.argv[1].index("{"):])["jobs"][0]
ops = j["read"]["total_ios"] + j["write"]["total_ios"]
iops = j["read"]["iops"] + j["write"]["iops"]
mbps = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6
cpu = int(sys.argv[2]) / int(sys.argv[3]) * 1e6 / max(ops, 1)
print(f"{sys.argv[4]} {iops:.0f} {mbps:.0f} {cpu:.1f}")
PY
}
ROWS=${ROWS:-w4k r4k w1m}
for round in $(seq "$REPEAT"); do
    for spec in "w4k randwrite 4k 32" "r4k randread 4k 32" "w1m write 1M 8"; do
        set -- $spec
        case " $ROWS " in *" $1 "*) ;; *) continue ;; esac
        row plain "$2" "$3" "$4" "$1"
        row tls "$2" "$3" "$4" "$1"
        echo "bench/cluster-tls.sh: $1 round $round done" >&2
    done
done
python3 - "$RESULTS" <<'PY'
import sys, statistics
runs = {}
for line in open(sys.argv[1]):
    name, *figures = line.split()
    runs.setdefault(name, []).append([float(x) for x in figures])
rows = {k: [statistics.median(r[i] for r in v) for i in range(3)] for k, v in runs.items()}
print(f"medians of {len(next(iter(runs.values())))} alternating rounds")
print()
label = {"w4k": "4 KiB random write QD32", "r4k": "4 KiB random read QD32", "w1m": "1 MiB sequential write QD8"}
print("| row (3-way write-through, separate processes) | --insecure IOPS | TLS IOPS | TLS/plain | --insecure CPU µs/op | TLS CPU µs/op | TLS/plain |")
print("|---|---|---|---|---|---|---|")
ratio = {}
for k, name in label.items():
    if f"{k}-plain" not in rows:
        continue
    p, t = rows[f"{k}-plain"], rows[f"{k}-tls"]
    ratio[k] = (t[0] / p[0], t[2] / p[2])
    print(f"| {name} | {p[0]:,.0f} ({p[1]:,.0f} MB/s) | {t[0]:,.0f} ({t[1]:,.0f} MB/s) | {ratio[k][0]:.2f} | {p[2]:.1f} | {t[2]:.1f} | {ratio[k][1]:.2f} |")
print()
if len(ratio) < 3:
    sys.exit(0)
print(f"cluster-tls: write_iops={ratio['w4k'][0]:.2f} write_cpu={ratio['w4k'][1]:.2f} read_iops={ratio['r4k'][0]:.2f} "
      f"read_cpu={ratio['r4k'][1]:.2f} seqwrite={ratio['w1m'][0]:.2f}")
PY
