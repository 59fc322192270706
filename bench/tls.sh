#!/usr/bin/env bash
# What TLS costs NBD clients (issue 26, point 4), in one run: one
# `blizzard up` (3-way write-through, TLS offered with the certificates
# it makes under its data directory), and each fio row twice against it,
# plain (nbd://) and over TLS (nbds://, libnbd with the client
# certificate), alternating, REPEAT rounds (3), medians reported, so both
# see the same cluster and cache and the noise of a 2-core machine
# running client and server shows in neither alone:
#
#   bench/tls.sh                        (RUNTIME=10 REPL=3 by default)
#
# Rows: 4 KiB random write and read at QD32, 1 MiB sequential write and
# read at QD8. Server CPU per operation from /proc (utime+stime of the
# `blizzard up` process, which runs the cluster, the NBD server and TLS).
# Prints a markdown table; the last line is
#   tls: write_iops=A write_cpu=B read_iops=C read_cpu=D seqwrite=E seqread=F
# each TLS ÷ plain (IOPS, and CPU per I/O: above 1 is TLS costing more).
# Goal: IOPS ratios ≥ 0.90 at QD32 and CPU ratios ≤ 1.15. ROWS="w4k r4k"
# runs only those rows (and prints no last line).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/blizzard}
REPL=${REPL:-3}
RUNTIME=${RUNTIME:-10}
DIR=${DIR:-/var/tmp/blizzard-tlsbench}
PORT=${PORT:-10949}
LOG=$(mktemp)
RESULTS=$(mktemp)
[ -x "$BIN" ] || cargo build --release -q -p blizzard-cli

rm -rf "$DIR"
"$BIN" up --data "$DIR" --listen "127.0.0.1:$PORT" --meta-listen "127.0.0.1:$((PORT + 1))" \
    --tractservers 4 --replication "$REPL" --size 1GiB --tls on > "$LOG" 2>&1 &
PID=$!
trap 'kill -TERM $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$DIR" "$LOG" "$RESULTS"' EXIT
. bench/lib/up.sh
wait_up "$LOG" "$PID" 180
# fio's nbd engine refuses a URI naming local files (tls-certificates=),
# so libnbd finds the client certificate where it looks by default:
# $HOME/.pki/libnbd.
mkdir -p "$DIR/home/.pki"
cp -r "$DIR/tls/client" "$DIR/home/.pki/libnbd"
PLAIN=nbd://127.0.0.1:$PORT/disk
TLS=nbds://127.0.0.1:$PORT/disk
fio --name=prefill --ioengine=nbd --uri="$PLAIN" --rw=write --bs=1M --iodepth=8 --size=1G > /dev/null

cpu() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
row() { # NAME URI RW BS QD
    local c0 c1 out
    sync
    c0=$(cpu)
    out=$(HOME="$DIR/home" fio --name=row --ioengine=nbd --uri="$2" --rw="$3" --bs="$4" --iodepth="$5" --size=1G \
        --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 --output-format=json)
    sleep 1
    c1=$(cpu)
    python3 - "$out" "$((c1 - c0))" "$(getconf CLK_TCK)" "$1" >> "$RESULTS" <<'PY'
import json, sys
j = json.loads(sys.argv[1][sys.argv[1].index("{"):])["jobs"][0]
ops = j["read"]["total_ios"] + j["write"]["total_ios"]
iops = j["read"]["iops"] + j["write"]["iops"]
mbps = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6
cpu = int(sys.argv[2]) / int(sys.argv[3]) * 1e6 / max(ops, 1)
# fio's own CPU (the client's libnbd, and GnuTLS over TLS): it shares the
# machine's cores with the server.
client = (j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] * 1e3 / max(ops, 1)
print(f"{sys.argv[4]} {iops:.0f} {mbps:.0f} {cpu:.1f} {client:.1f}")
PY
}
ROWS=${ROWS:-w4k r4k w1m r1m}
REPEAT=${REPEAT:-3}
for round in $(seq "$REPEAT"); do
for spec in "w4k randwrite 4k 32" "r4k randread 4k 32" "w1m write 1M 8" "r1m read 1M 8"; do
    set -- $spec
    case " $ROWS " in *" $1 "*) ;; *) continue ;; esac
    row "$1-plain" "$PLAIN" "$2" "$3" "$4"
    row "$1-tls" "$TLS" "$2" "$3" "$4"
    echo "bench/tls.sh: $1 round $round done" >&2
done
done
python3 - "$RESULTS" "$REPL" <<'PY'
import sys
import statistics
runs = {}
for line in open(sys.argv[1]):
    name, *figures = line.split()
    runs.setdefault(name, []).append([float(x) for x in figures])
# The median of the rounds, figure by figure.
rows = {k: [statistics.median(r[i] for r in v) for i in range(4)] for k, v in runs.items()}
print(f"medians of {len(next(iter(runs.values())))} alternating rounds")
print()
label = {"w4k": "4 KiB random write QD32", "r4k": "4 KiB random read QD32",
         "w1m": "1 MiB sequential write QD8", "r1m": "1 MiB sequential read QD8"}
print(f"| row ({sys.argv[2]}-way write-through) | plain IOPS | TLS IOPS | TLS/plain | plain CPU µs/op | TLS CPU µs/op | TLS/plain | fio CPU µs/op plain, TLS |")
print("|---|---|---|---|---|---|---|---|")
ratio = {}
for k, name in label.items():
    if f"{k}-plain" not in rows:
        continue
    p, t = rows[f"{k}-plain"], rows[f"{k}-tls"]
    ratio[k] = (t[0] / p[0], t[2] / p[2])
    print(f"| {name} | {p[0]:,.0f} ({p[1]:,.0f} MB/s) | {t[0]:,.0f} ({t[1]:,.0f} MB/s) | {ratio[k][0]:.2f} | {p[2]:.1f} | {t[2]:.1f} | {ratio[k][1]:.2f} | {p[3]:.1f}, {t[3]:.1f} |")
print()
if len(ratio) < 4:
    sys.exit(0)
print(f"tls: write_iops={ratio['w4k'][0]:.2f} write_cpu={ratio['w4k'][1]:.2f} read_iops={ratio['r4k'][0]:.2f} "
      f"read_cpu={ratio['r4k'][1]:.2f} seqwrite={ratio['w1m'][0]:.2f} seqread={ratio['r1m'][0]:.2f}")
PY
