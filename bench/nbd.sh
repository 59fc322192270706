#!/usr/bin/env bash
# NBD servers side by side through fio's nbd engine, in one run:
#
#   bench/nbd.sh [DIR]        (default: a temp dir under /var/tmp; with DIR,
#                              a temp dir inside DIR, removed at exit)
#
# Environment (all optional):
#   RUNTIME=10      seconds per row (fio --time_based --runtime)
#   SIZE=1GiB       working set: the first SIZE bytes of each export, written
#                   sequentially (and verified) before the rows run
#   SERVERS="qemu-nbd nbdkit bz-wt bz-fa bz-fa-ordered"   which servers, in order
#   FLUSH_ROW=1     add a row "4 KiB random write QD1, flush after each"
#                   (the only row where the flush policies differ)
#   PERF=1          after the measured rows of bz-wt, run the 4 KiB random
#                   write QD32 and random read QD32 rows again under
#                   `perf record -g -p PID` (and `perf stat`); reports go to
#                   $PERF_OUT/nbd-perf-*.txt (default /tmp)
#   RESULTS=DIR     where fio's JSON, the server logs and the table are kept
#                   (default: a new /tmp/nbd-bench.XXXXXX)
#   CARGO_TARGET_DIR  where the blizzard binary is built (default target)
#
# Servers, each serving a file or volume on the same disk (DIR):
#   qemu-nbd       raw file, -f raw --cache=writeback --aio=threads -t
#   nbdkit         file plugin on a raw file
#   bz-wt          blizzard up, write-through, durable flush
#   bz-fa          blizzard up, fast-ack, durable flush
#   bz-fa-ordered  blizzard up, fast-ack, ordered flush
# blizzard: 4 tractservers, 1-way, metadata server, tractservers and NBD
# server in one process.
#
# Rows (fio --ioengine=nbd, libnbd, one connection, SIZE working set):
# 4 KiB random read QD1 and QD32, 4 KiB random write QD1 and QD32, 1 MiB
# sequential read and write QD8. Each server's rows run back to back. For
# every row: IOPS (4 KiB) or MB/s (1 MiB), p99 completion latency, the
# server process's CPU time (utime+stime from /proc/PID/stat) per operation,
# and ratios to qemu-nbd. A row's CPU window runs from just before fio
# starts until the server is idle again after fio exits ("tail"), so work a
# server defers past the acknowledgment (fast-ack's destaging) is charged to
# the row that caused it. fio's own CPU per operation is shown too: at QD32
# client, server and kernel share the machine's 2 cores.
#
# Needs root (drop_caches, perf); installs fio, qemu-utils, nbdkit and
# libnbd-bin if missing. Prints a markdown table for docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RUNTIME=${RUNTIME:-10}
SIZE=${SIZE:-1GiB}
SERVERS=${SERVERS:-qemu-nbd nbdkit bz-wt bz-fa bz-fa-ordered}
FLUSH_ROW=${FLUSH_ROW:-0}
PERF=${PERF:-0}
PERF_OUT=${PERF_OUT:-/tmp}
TARGET=${CARGO_TARGET_DIR:-target}
BIN=$TARGET/release/blizzard
EXPORT=bench
CMDLINE="$(printf '%q ' "$0" "$@")"
ENVLINE="RUNTIME=$RUNTIME SIZE=$SIZE SERVERS=\"$SERVERS\" FLUSH_ROW=$FLUSH_ROW PERF=$PERF"

[ "$(id -u)" = 0 ] || { echo "bench/nbd.sh: needs root (drop_caches, perf)" >&2; exit 1; }

size_bytes() { # 1GiB, 512MiB, 1G, 4096 -> bytes
    python3 - "$1" <<'EOF'
import re, sys
m = re.fullmatch(r'\s*(\d+)\s*([KMGT]?)(i?B)?\s*', sys.argv[1], re.I)
if not m:
    sys.exit(f"bad size {sys.argv[1]!r}")
print(int(m.group(1)) << (10 * " KMGT".index((m.group(2) or " ").upper())))
EOF
}
SIZE_B=$(size_bytes "$SIZE")
# Each tractserver's disk file: room for twice its share of the volume.
DISK_B=$(( SIZE_B / 2 > 2 << 30 ? SIZE_B / 2 : 2 << 30 ))

need=()
command -v fio >/dev/null || need+=(fio)
command -v qemu-nbd >/dev/null || need+=(qemu-utils)
command -v nbdkit >/dev/null || need+=(nbdkit)
command -v nbdinfo >/dev/null || need+=(libnbd-bin)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "this fio has no nbd engine" >&2; exit 1; }
if [ "$PERF" = 1 ]; then command -v perf >/dev/null || { echo "PERF=1 needs perf" >&2; exit 1; }; fi

cargo build --release -q -p blizzard-cli
[ -x "$BIN" ] || { echo "no $BIN after the build" >&2; exit 1; }

if [ $# -ge 1 ]; then mkdir -p "$1"; DIR=$(mktemp -d "$1/nbd-bench.XXXXXX"); else DIR=$(mktemp -d /var/tmp/nbd-bench.XXXXXX); fi
RESULTS=${RESULTS:-$(mktemp -d /tmp/nbd-bench.XXXXXX)}
mkdir -p "$RESULTS"
TSV=$RESULTS/results.tsv
: > "$TSV"

SERVER_PID=
SERVER_LOG=
cleanup() {
    local rc=$?
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        if [ $rc -ne 0 ] && [ -n "$SERVER_LOG" ]; then
            echo "--- last lines of $SERVER_LOG" >&2; tail -20 "$SERVER_LOG" >&2 || true
        fi
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$DIR"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

HZ=$(getconf CLK_TCK)
cpu_ticks() { # utime + stime of a whole process (all its threads)
    local s
    s=$(cat "/proc/$1/stat")
    s=${s##*) }   # drop "pid (comm) ": comm may hold spaces
    awk '{print $12 + $13}' <<<"$s"
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits until the NBD server answers a real handshake (never a bare TCP
# probe: servers log those as failed negotiations).
wait_nbd() { # uri pid seconds
    local deadline=$((SECONDS + $3))
    while ! nbdinfo --size "$1" >/dev/null 2>&1; do
        kill -0 "$2" 2>/dev/null || { echo "server (pid $2) died while starting; log:" >&2; tail -30 "$SERVER_LOG" >&2; exit 1; }
        [ $SECONDS -lt "$deadline" ] || { echo "server at $1 not answering after $3 s" >&2; exit 1; }
        sleep 0.2
    done
    local got
    got=$(nbdinfo --size "$1")
    [ "$got" -ge "$SIZE_B" ] || { echo "export $1 is $got bytes, smaller than SIZE" >&2; exit 1; }
}

# Waits until the server's CPU use stays below one tick per 0.5 s; prints
# how long that took (s): deferred work still running after fio exited.
settle() { # pid
    local t0=$SECONDS a b start
    start=$(date +%s.%N)
    a=$(cpu_ticks "$1")
    while :; do
        sleep 0.5
        b=$(cpu_ticks "$1")
        [ $((b - a)) -le 1 ] && break
        a=$b
        if [ $((SECONDS - t0)) -gt 300 ]; then echo "server still busy 300 s after fio exited" >&2; break; fi
    done
    python3 -c "print(f'{max(0.0, $(date +%s.%N) - $start - 0.5):.1f}')"
}

start_server() { # name file-or-dir port
    local name=$1 path=$2 port=$3
    SERVER_LOG=$RESULTS/$name.log
    case $name in
    qemu-nbd)
        truncate -s "$SIZE_B" "$path"
        SERVER_CMD=(qemu-nbd -f raw --cache=writeback --aio=threads -t -x "$EXPORT" -b 127.0.0.1 -p "$port" "$path")
        ;;
    nbdkit)
        truncate -s "$SIZE_B" "$path"
        SERVER_CMD=(nbdkit -f -i 127.0.0.1 -p "$port" file "file=$path")
        ;;
    bz-*)
        local mode flush
        case $name in
        bz-wt) mode=write-through flush=durable ;;
        bz-fa) mode=fast-ack flush=durable ;;
        bz-fa-ordered) mode=fast-ack flush=ordered ;;
        *) echo "unknown server $name" >&2; exit 1 ;;
        esac
        SERVER_CMD=("$BIN" up --data "$path" --listen "127.0.0.1:$port" --meta-listen "127.0.0.1:$(free_port)"
            --tractservers 4 --replication 1 --mode "$mode" --flush "$flush" --size "$SIZE_B"
            --disk-size "$DISK_B" --volume "$EXPORT")
        ;;
    *) echo "unknown server $name (want qemu-nbd nbdkit bz-wt bz-fa bz-fa-ordered)" >&2; exit 1 ;;
    esac
    echo "${SERVER_CMD[*]}" > "$RESULTS/$name.cmd"
    "${SERVER_CMD[@]}" > "$SERVER_LOG" 2>&1 &
    SERVER_PID=$!
    if [[ $name == bz-* ]]; then
        local deadline=$((SECONDS + 180))
        until grep -q 'Ctrl-C (or SIGTERM) stops it cleanly' "$SERVER_LOG"; do
            kill -0 "$SERVER_PID" 2>/dev/null || { echo "blizzard up died while starting; log:" >&2; tail -30 "$SERVER_LOG" >&2; exit 1; }
            [ $SECONDS -lt "$deadline" ] || { echo "blizzard up not ready after 180 s" >&2; exit 1; }
            sleep 0.2
        done
    fi
    wait_nbd "nbd://127.0.0.1:$port/$EXPORT" "$SERVER_PID" 60
}

stop_server() {
    local rc=0
    kill -TERM "$SERVER_PID"
    local deadline=$((SECONDS + 120))
    while kill -0 "$SERVER_PID" 2>/dev/null; do
        if [ $SECONDS -ge "$deadline" ]; then
            echo "WARNING: server pid $SERVER_PID still running 120 s after SIGTERM; killing it" >&2
            kill -KILL "$SERVER_PID" 2>/dev/null || true
        fi
        sleep 0.1
    done
    wait "$SERVER_PID" || rc=$?
    # qemu-nbd exits 0 on SIGTERM, nbdkit too; blizzard flushes its volumes first.
    if [ $rc -ne 0 ]; then
        echo "WARNING: $1 exited with status $rc after SIGTERM; log tail:" >&2
        tail -5 "$SERVER_LOG" >&2
        echo "$1	stop-status	$rc" >> "$RESULTS/problems.tsv"
    fi
    SERVER_PID=
}

# Every row: name rw bs iodepth [extra fio options]
ROWS=(
    "4k-randread-qd1|randread|4k|1"
    "4k-randread-qd32|randread|4k|32"
    "4k-randwrite-qd1|randwrite|4k|1"
    "4k-randwrite-qd32|randwrite|4k|32"
    "1m-seqread-qd8|read|1m|8"
    "1m-seqwrite-qd8|write|1m|8"
)
[ "$FLUSH_ROW" = 1 ] && ROWS+=("4k-randwrite-qd1-flush-each|randwrite|4k|1|--fsync=1")

fio_cmd() { # uri rw bs qd [extra...]: the fio command for one row
    local uri=$1 rw=$2 bs=$3 qd=$4
    shift 4
    FIO_CMD=(fio --name=nbd --ioengine=nbd "--uri=$uri" "--rw=$rw" "--bs=$bs" "--iodepth=$qd"
        "--size=$SIZE_B" --time_based "--runtime=$RUNTIME" --norandommap --randrepeat=0
        --output-format=json "$@")
}

parse_fio() { # json -> ops iops MB/s p99_us fio_cpu_us_per_op
    python3 - "$1" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
if j.get("error"):
    sys.exit(f"fio job error {j['error']}")
k = "read" if j["read"]["total_ios"] else "write"
d = j[k]
ops = d["total_ios"]
if ops == 0:
    sys.exit("fio completed no I/O")
p99 = d["clat_ns"]["percentile"]["99.000000"] / 1000
cpu_us = (j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] * 1000
print(ops, d["iops"], d["bw_bytes"] / 1e6, p99, cpu_us / ops)
EOF
}

run_row() { # server-name uri row-spec
    local srv=$1 uri=$2 name rw bs qd extra
    IFS='|' read -r name rw bs qd extra <<<"$3"
    # shellcheck disable=SC2086
    fio_cmd "$uri" "$rw" "$bs" "$qd" $extra
    local json=$RESULTS/$srv.$name.json before after tail
    before=$(cpu_ticks "$SERVER_PID")
    "${FIO_CMD[@]}" > "$json"
    tail=$(settle "$SERVER_PID")
    after=$(cpu_ticks "$SERVER_PID")
    local vals ops iops mbps p99 fiocpu cpu_us
    vals=$(parse_fio "$json")
    read -r ops iops mbps p99 fiocpu <<<"$vals"
    cpu_us=$(python3 -c "print(($after - $before) * 1e6 / $HZ / $ops)")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$srv" "$ops" "$iops" "$mbps" "$p99" "$cpu_us" "$fiocpu" "$tail" >> "$TSV"
    printf '  %-28s %-14s %10.0f IOPS %8.0f MB/s  p99 %8.0f us  server %7.1f us/op  fio %5.1f us/op  tail %ss\n' \
        "$name" "$srv" "$iops" "$mbps" "$p99" "$cpu_us" "$fiocpu" "$tail" >&2
}

# The sequential fill every row reads or overwrites, read back and checked
# (fio's crc32c verify headers in every 1 MiB block).
prefill() { # server-name uri
    local json=$RESULTS/$1.prefill.json
    fio --name=prefill --ioengine=nbd "--uri=$2" --rw=write --bs=1m --iodepth=8 "--size=$SIZE_B" \
        --verify=crc32c --do_verify=1 --end_fsync=1 --output-format=json > "$json" || {
        echo "prefill/verify of $1 failed; see $json" >&2
        echo "$1	prefill-verify	failed" >> "$RESULTS/problems.tsv"
        return 1
    }
    python3 - "$json" <<'EOF' >&2
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
print(f"  prefill: {j['write']['bw_bytes']/1e6:.0f} MB/s write, {j['read']['bw_bytes']/1e6:.0f} MB/s verify read, error={j['error']}")
EOF
    settle "$SERVER_PID" > /dev/null
}

profile_rows() { # server-name uri: the QD32 4 KiB rows again, under perf
    local srv=$1 uri=$2 spec name rw bs qd
    for spec in "4k-randwrite-qd32|randwrite|4k|32" "4k-randread-qd32|randread|4k|32"; do
        IFS='|' read -r name rw bs qd _ <<<"$spec"
        local tag=${name#4k-}; tag=${tag%-qd32}-qd32-${srv#bz-}
        local data=$RESULTS/perf-$tag.data rpt=$PERF_OUT/nbd-perf-$tag.txt stat=$RESULTS/perf-$tag.stat
        fio_cmd "$uri" "$rw" "$bs" "$qd"
        perf record -g -o "$data" -p "$SERVER_PID" > "$RESULTS/perf-$tag.record.log" 2>&1 &
        local rec=$!
        perf stat -e task-clock,context-switches,cpu-migrations,page-faults -p "$SERVER_PID" -o "$stat" &
        local st=$!
        sleep 0.5
        "${FIO_CMD[@]}" > "$RESULTS/$srv.$name.perf.json"
        kill -INT "$rec" "$st"
        wait "$rec" || true
        wait "$st" || true
        settle "$SERVER_PID" > /dev/null
        local ops
        ops=$(parse_fio "$RESULTS/$srv.$name.perf.json" | cut -d' ' -f1)
        {
            echo "# $srv $name under perf: ${FIO_CMD[*]}"
            echo "# fio ops: $ops"
            echo "## perf stat (whole server process, while fio ran)"
            cat "$stat"
            echo "## perf report --no-children --sort sym"
            perf report -i "$data" --no-children --sort sym --stdio -g none 2>/dev/null | grep -v '^$' | head -80
            echo "## perf report --no-children --sort dso"
            perf report -i "$data" --no-children --sort dso --stdio -g none 2>/dev/null | grep -v '^$' | head -30
            echo "## perf report --no-children --sort comm"
            perf report -i "$data" --no-children --sort comm --stdio -g none 2>/dev/null | grep -v '^$' | head -30
            echo "## perf report --no-children --sort sym, with callers (-g caller)"
            perf report -i "$data" --no-children --sort sym --stdio -g caller,0.5,callee --percent-limit 1 2>/dev/null | head -600
        } > "$rpt"
        echo "  perf: $rpt ($srv $name, $ops ops)" >&2
    done
}

# This kind of machine is a VM whose memory is backed by the host only when
# first touched (see bench/blob.sh): touch most of the available memory once
# so no server pays the host's first-touch faults. MemAvailable rather than
# MemTotal, leaving 4 GiB: someone may be compiling beside us.
warm_mb=$(awk '/MemAvailable/ {print int($2/1024) - 4096}' /proc/meminfo)
if [ "$warm_mb" -gt 0 ]; then
    python3 -c "
import mmap
n = $warm_mb << 20
m = mmap.mmap(-1, n)
for i in range(0, n, 4096): m[i] = 1
"
fi
sync; echo 3 > /proc/sys/vm/drop_caches

START=$(date -u '+%Y-%m-%d %H:%M UTC')
for srv in $SERVERS; do
    port=$(free_port)
    case $srv in
    bz-*) path=$DIR/$srv ;;
    *) path=$DIR/$srv.img ;;
    esac
    uri="nbd://127.0.0.1:$port/$EXPORT"
    echo "== $srv: $uri" >&2
    start_server "$srv" "$path" "$port"
    prefill "$srv" "$uri"
    for spec in "${ROWS[@]}"; do
        run_row "$srv" "$uri" "$spec"
    done
    if [ "$PERF" = 1 ] && [ "$srv" = bz-wt ]; then
        profile_rows "$srv" "$uri"
    fi
    # A persistent server must survive all those connections.
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "$srv died during the rows" >&2; exit 1; }
    stop_server "$srv"
    rm -rf "$path"
done

fio_cmd "nbd://127.0.0.1:PORT/$EXPORT" RW BS QD
{
echo "Run $START, commit \`$(git -C "$ROOT" log -1 --format='%h %s' 2>/dev/null || echo unknown)\`$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (dirty tree)'), $(nproc) cores."
echo
echo "Command (as root): \`$ENVLINE $CMDLINE\`"
echo
echo "Each row: \`${FIO_CMD[*]}\` (RW/BS/QD per row; one connection)."
echo "Working set prefilled sequentially (1 MiB, QD 8) and verified with fio's crc32c before the rows."
echo "Servers:"
for srv in $SERVERS; do
    [ -f "$RESULTS/$srv.cmd" ] && echo "- $srv: \`$(sed "s|$DIR/||g; s|127.0.0.1:[0-9]*|127.0.0.1:PORT|g; s| -p [0-9]*| -p PORT|" "$RESULTS/$srv.cmd")\`"
done
echo
python3 - "$TSV" <<'EOF'
import sys, collections
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    name, srv, ops, iops, mbps, p99, cpu, fiocpu, tail = line.rstrip("\n").split("\t")
    rows.setdefault(name, {})[srv] = dict(iops=float(iops), mbps=float(mbps), p99=float(p99),
                                          cpu=float(cpu), fiocpu=float(fiocpu), tail=float(tail))
label = {
    "4k-randread-qd1": "4 KiB rand read QD1", "4k-randread-qd32": "4 KiB rand read QD32",
    "4k-randwrite-qd1": "4 KiB rand write QD1", "4k-randwrite-qd32": "4 KiB rand write QD32",
    "1m-seqread-qd8": "1 MiB seq read QD8", "1m-seqwrite-qd8": "1 MiB seq write QD8",
    "4k-randwrite-qd1-flush-each": "4 KiB rand write QD1 + flush each",
}
print("| workload | server | IOPS or MB/s | vs qemu-nbd | p99 µs | server CPU µs/op | CPU/op vs qemu-nbd | fio CPU µs/op | tail s |")
print("|---|---|---|---|---|---|---|---|---|")
for name, by in rows.items():
    mb = name.startswith("1m")
    base = by.get("qemu-nbd")
    for srv, r in by.items():
        v = r["mbps"] if mb else r["iops"]
        shown = f"{v:,.0f} MB/s" if mb else f"{v:,.0f}"
        if base:
            bv = base["mbps"] if mb else base["iops"]
            ratio, cratio = f"{v / bv:.2f}", f"{r['cpu'] / base['cpu']:.2f}"
        else:
            ratio = cratio = "–"
        print(f"| {label.get(name, name)} | {srv} | {shown} | {ratio} | {r['p99']:,.0f} | {r['cpu']:.1f} | {cratio} | {r['fiocpu']:.1f} | {r['tail']:.1f} |")
EOF
if [ -s "$RESULTS/problems.tsv" ]; then echo; echo "Problems:"; sed 's/^/- /' "$RESULTS/problems.tsv"; fi
} | tee "$RESULTS/table.md"
echo "(fio JSON, server logs and this table: $RESULTS)" >&2
