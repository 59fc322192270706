#!/usr/bin/env bash
# The hybrid tier (Ursa, design 0009, issue 25) on this one machine, in one
# run: three 3-way volumes on the same cluster, reached through NBD.
#
#   bench/hybrid.sh            (as root: drop_caches)
#
# The cluster is one `blizzard up --replication 3 --tractservers 9
# --hdd-tractservers 6`: 3 tractservers of class ssd (this machine's disk as
# it is) and 6 of class hdd, whose disks are modelled as spinning disks
# (`--hdd-model hdd`: 8 ms per seek, 150 MB/s, one arm; the machines here
# have no HDD) and which each have a JOURNAL backup journal on this
# machine's disk. The table is built over both classes, so it has a section
# per placement, and the three volumes are
#   ssd     `--placement ssd`: every replica on an ssd tractserver;
#   hybrid  `--placement hybrid`: the primary on ssd, reads go there; the
#           two backups on hdd, whose small writes are acknowledged once in
#           their journal and destaged to the modelled disk in disk order;
#   hdd     `--placement hdd`: every replica on hdd, no journals (the model
#           biting: what the hybrid tier saves its backups from).
# All write-through (a write is acknowledged once durable on all 3).
#
# Rows, RUNTIME seconds each (fio --time_based, fio's nbd engine, one job,
# over the first SIZE bytes): 4 KiB random write QD32, 4 KiB random read
# QD32, 1 MiB sequential write QD8. Each volume is prefilled first (1 MiB
# sequential writes, QD8, all SIZE bytes), so reads hit written data. After
# each row the script waits until every backup journal is destaged (the
# seconds that took are reported): the journals absorb a burst at fast-disk
# speed, the slow disks catch up afterwards, and a row that found them
# still catching up would measure that instead. Before each row the page
# cache is dropped. CPU
# per I/O is the `blizzard up` process's (all its threads; it holds every
# server) from /proc over the row's window, as bench/vs-ceph.sh charges it.
#
# The last line is exactly
#   hybrid: write_vs_ssd=X read_vs_ssd=Y hdd_write_vs_ssd=Z
# IOPS ratios of 4 KiB random writes (hybrid ÷ ssd), random reads (hybrid ÷
# ssd) and random writes of the hdd volume ÷ ssd.
#
# Environment: RUNTIME (15), SIZE (512MiB), JOURNAL (512MiB), OVERFLOW (each
# journal's second area, beside its disk file, taking writes while the
# journal is full: JOURNAL; 0 for none), DIR (/var/tmp),
# RESULTS (a new /tmp dir), BUILD=1 rebuilds the release binary first.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/up.sh
ROOT=$PWD
RUNTIME=${RUNTIME:-15}
SIZE=${SIZE:-512MiB}
JOURNAL=${JOURNAL:-512MiB}
OVERFLOW=${OVERFLOW:-$JOURNAL}
BUILD=${BUILD:-0}
TARGET=${CARGO_TARGET_DIR:-target}
BIN=$TARGET/release/blizzard
CMDLINE="$(printf '%q ' "$0" "$@")"
VOLUMES=(ssd hybrid hdd)

[ "$(id -u)" = 0 ] || { echo "bench/hybrid.sh: needs root (drop_caches)" >&2; exit 1; }

size_bytes() { # 4GiB, 512MiB, 1G, 4096 -> bytes (binary units)
    python3 - "$1" <<'EOF'
import re, sys
m = re.fullmatch(r'\s*(\d+)\s*([KMGT]?)(i?B)?\s*', sys.argv[1], re.I)
if not m:
    sys.exit(f"bad size {sys.argv[1]!r}")
print(int(m.group(1)) << (10 * " KMGT".index((m.group(2) or " ").upper())))
EOF
}
SIZE_B=$(size_bytes "$SIZE")
# A volume's 1 MiB blocks are striped over up to 128 tracts of 8 MiB (its
# segment), each taking a whole slot: an ssd tractserver holds a replica of
# each of the ssd volume's tracts and a third of the hybrid volume's
# primaries, an hdd one less. Room for twice a volume's tracts.
TRACTS=$(( (SIZE_B + (1 << 20) - 1) >> 20 )); [ "$TRACTS" -gt 128 ] && TRACTS=128
DISK_B=$((TRACTS * (16 << 20) + (512 << 20)))

need=()
for c in fio:fio nbdinfo:libnbd-bin; do
    command -v "${c%%:*}" >/dev/null || need+=("${c#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "installing ${need[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "this fio has no nbd engine" >&2; exit 1; }

if [ "$BUILD" = 1 ] || [ ! -x "$BIN" ]; then cargo build --release -q -p blizzard-cli; fi
[ -x "$BIN" ] || { echo "no $BIN" >&2; exit 1; }
BIN=$(realpath "$BIN")

WORK=$(mktemp -d "${DIR:-/var/tmp}/hybrid.XXXXXX")
RESULTS=${RESULTS:-$(mktemp -d /tmp/hybrid.XXXXXX)}
mkdir -p "$RESULTS"
RESULTS=$(realpath "$RESULTS")
TSV=$RESULTS/results.tsv
: > "$TSV"
HZ=$(getconf CLK_TCK)
SERVER_PID=
SERVER_LOG=$RESULTS/blizzard.log
META=

cleanup() {
    local rc=$?
    if [ -n "$SERVER_PID" ]; then
        [ $rc -ne 0 ] && { echo "--- last lines of $SERVER_LOG" >&2; tail -20 "$SERVER_LOG" >&2 || true; }
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 600); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

ticks() { # pid: utime+stime of the whole process
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || { echo 0; return; }
    s=${s##*) }
    awk '{print $12 + $13 + $14 + $15}' <<<"$s"
}

iowait() { # machine-wide CPU ticks in I/O wait, and all CPU ticks, from /proc/stat
    awk '/^cpu / { t = 0; for (i = 2; i <= NF; i++) t += $i; print $6, t }' /proc/stat
}

settle() { # wait (up to 60 s) until the server uses under a tenth of a core
    local a b
    a=$(ticks "$SERVER_PID")
    for _ in $(seq 60); do
        sleep 1
        b=$(ticks "$SERVER_PID")
        [ $((b - a)) -le $((HZ / 10 + 1)) ] && break
        a=$b
    done
}

drain() { # wait until every backup journal is destaged (status: hdd+j 0%); prints the seconds
    local t0=$SECONDS used
    while :; do
        used=$("$BIN" status --meta "$META" 2>/dev/null | grep -o 'hdd+j [0-9]*%' | grep -vc 'hdd+j 0%' || true)
        [ "$used" = 0 ] && break
        [ $((SECONDS - t0)) -lt 1800 ] || { echo "journals not destaged after 1800 s" >&2; exit 1; }
        sleep 2
    done
    echo $((SECONDS - t0))
}

parse_fio() { # json -> ops iops MB/s p99_us
    python3 - "$1" <<'EOF'
import json, sys
t = open(sys.argv[1]).read(); j = json.loads(t[t.index("{"):])["jobs"][0]
if j.get("error"):
    sys.exit(f"fio job error {j['error']}")
k = "read" if j["read"]["total_ios"] else "write"
d = j[k]
if d["total_ios"] == 0:
    sys.exit("fio completed no I/O")
print(d["total_ios"], d["iops"], d["bw_bytes"] / 1e6, d["clat_ns"]["percentile"]["99.000000"] / 1000)
EOF
}

ROWS=(
    "4k-randwrite-qd32|randwrite|4k|32"
    "4k-randread-qd32|randread|4k|32"
    "1m-seqwrite-qd8|write|1m|8"
)

engine() { # volume
    ENGINE=(--ioengine=nbd "--uri=nbd+unix:///$1?socket=$WORK/nbd.sock")
}

T0=$SECONDS
START=$(date -u '+%Y-%m-%d %H:%M UTC')
META=127.0.0.1:$(free_port)
UP=("$BIN" up --data "$WORK/data" --listen "unix:$WORK/nbd.sock" --meta-listen "$META"
    --replication 3 --tractservers 9 --hdd-tractservers 6 --hdd-model hdd --journal-size "$JOURNAL"
    --journal-overflow-size "$OVERFLOW"
    --volume ssd --placement ssd --size "$SIZE_B" --disk-size "$DISK_B")
echo "${UP[*]}" > "$RESULTS/blizzard.cmd"
"${UP[@]}" > "$SERVER_LOG" 2>&1 &
SERVER_PID=$!
wait_up "$SERVER_LOG" "$SERVER_PID" 600
for v in hybrid hdd; do
    "$BIN" volume create "$v" --size "$SIZE_B" --replication 3 --placement "$v" --block-size 1MiB \
        --meta "$META" >> "$RESULTS/volume-create.log" 2>&1 || {
        echo "creating volume $v failed:" >&2; tail -5 "$RESULTS/volume-create.log" >&2; exit 1; }
done
"$BIN" status --meta "$META" > "$RESULTS/status.txt" 2>&1 || true
grep -q 'placements:' "$RESULTS/status.txt" || { echo "the table has no placements; see $RESULTS/status.txt" >&2; exit 1; }
echo "cluster up in $((SECONDS - T0)) s: $(grep placements: "$RESULTS/status.txt")" >&2

for v in "${VOLUMES[@]}"; do
    engine "$v"
    got=$(nbdinfo --size "nbd+unix:///$v?socket=$WORK/nbd.sock")
    [ "$got" -ge "$SIZE_B" ] || { echo "export $v is $got bytes, smaller than SIZE" >&2; exit 1; }
    t=$SECONDS
    timeout -k 10 1800 fio --name=prefill "${ENGINE[@]}" --rw=write --bs=1m --iodepth=8 "--size=$SIZE_B" \
        --output-format=json > "$RESULTS/$v.prefill.json" || {
        echo "prefill of $v failed; see $RESULTS/$v.prefill.json" >&2; exit 1; }
    printf '  %-7s prefill: %.0f MB/s, %d s; journals destaged in %s s\n' \
        "$v" "$(parse_fio "$RESULTS/$v.prefill.json" | cut -d' ' -f3)" $((SECONDS - t)) "$(drain)" >&2
    settle
    for spec in "${ROWS[@]}"; do
        IFS='|' read -r name rw bs qd <<<"$spec"
        json=$RESULTS/$v.$name.json
        sync; echo 3 > /proc/sys/vm/drop_caches
        s0=$(ticks "$SERVER_PID")
        read -r w0 t0 <<<"$(iowait)"
        timeout -k 10 $((RUNTIME + 600)) fio "--name=$name" "${ENGINE[@]}" "--rw=$rw" "--bs=$bs" \
            "--iodepth=$qd" "--size=$SIZE_B" --time_based "--runtime=$RUNTIME" --norandommap \
            --randrepeat=0 --output-format=json > "$json" || {
            echo "fio failed or timed out ($v $name); see $json" >&2; exit 1; }
        s1=$(ticks "$SERVER_PID")
        read -r w1 t1 <<<"$(iowait)"
        waiting=$(python3 -c "print(round(100 * ($w1 - $w0) / max(1, $t1 - $t0)))")
        read -r ops iops mbps p99 <<<"$(parse_fio "$json")"
        cpu=$(python3 -c "print(($s1 - $s0) * 1e6 / $HZ / $ops)")
        # The hdd disks destage what the journals took before the next
        # row, which would otherwise queue behind it on the one arm.
        drained=$(drain)
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$v" "$iops" "$mbps" "$p99" "$cpu" "$drained" "$waiting" >> "$TSV"
        printf '  %-7s %-18s %9.0f IOPS %7.0f MB/s  p99 %9.0f us  server %8.1f us/op  iowait %3s%%  journals destaged in %s s\n' \
            "$v" "$name" "$iops" "$mbps" "$p99" "$cpu" "$waiting" "$drained" >&2
        settle
    done
done
"$BIN" status --meta "$META" > "$RESULTS/status-after.txt" 2>&1 || true
echo "(run took $((SECONDS - T0)) s)" >&2

{
echo "Run $START, commit \`$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)\`$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (dirty tree)'), $(nproc) cores."
echo
echo "Command (as root): \`RUNTIME=$RUNTIME SIZE=$SIZE JOURNAL=$JOURNAL $CMDLINE\`"
echo
echo "Cluster: \`$(sed "s|$WORK/||g; s|127.0.0.1:[0-9]*|127.0.0.1:PORT|g" "$RESULTS/blizzard.cmd")\`; $(grep placements: "$RESULTS/status.txt")."
echo
python3 - "$TSV" <<'EOF'
import sys, collections
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    name, vol, iops, mbps, p99, cpu, drained, waiting = line.rstrip("\n").split("\t")
    rows.setdefault(name, {})[vol] = dict(iops=float(iops), mbps=float(mbps), p99=float(p99), cpu=float(cpu),
                                          drained=int(drained), waiting=int(waiting))
label = {"4k-randwrite-qd32": "4 KiB random write QD32", "4k-randread-qd32": "4 KiB random read QD32",
         "1m-seqwrite-qd8": "1 MiB sequential write QD8"}
def shown(name, r):
    unit = f"{r['mbps']:,.0f} MB/s" if name.startswith("1m") else f"{r['iops']:,.0f} IOPS"
    per = "µs/MiB" if name.startswith("1m") else "µs/op"
    return f"{unit}, p99 {r['p99']:,.0f} µs, {r['cpu']:,.1f} {per}"
print("| workload | ssd (3 × ssd) | hybrid (ssd + 2 × hdd with journals) | hdd (3 × hdd, no journals) | hybrid ÷ ssd |")
print("|---|---|---|---|---|")
for name, by in rows.items():
    key = "mbps" if name.startswith("1m") else "iops"
    print(f"| {label[name]} | {shown(name, by['ssd'])} | {shown(name, by['hybrid'])} | {shown(name, by['hdd'])} "
          f"| {by['hybrid'][key] / by['ssd'][key]:.2f}× |")
print()
print("Seconds the hdd disks then took to destage what the backup journals took (modelled: 8 ms per range not")
print("continuing the previous one, ranges sorted and merged; the next row starts after):")
print()
print("| workload | ssd | hybrid | hdd |")
print("|---|---|---|---|")
for name, by in rows.items():
    print(f"| {label[name]} | {by['ssd']['drained']} | {by['hybrid']['drained']} | {by['hdd']['drained']} |")
print()
print("Share of the machine's CPU time spent waiting for the device during each row (/proc/stat iowait):")
print("high where a row waited on the device rather than on blizzard.")
print()
print("| workload | ssd | hybrid | hdd |")
print("|---|---|---|---|")
for name, by in rows.items():
    print(f"| {label[name]} | {by['ssd']['waiting']}% | {by['hybrid']['waiting']}% | {by['hdd']['waiting']}% |")
print()
w, r = rows["4k-randwrite-qd32"], rows["4k-randread-qd32"]
print(f"hybrid: write_vs_ssd={w['hybrid']['iops'] / w['ssd']['iops']:.2f} "
      f"read_vs_ssd={r['hybrid']['iops'] / r['ssd']['iops']:.2f} "
      f"hdd_write_vs_ssd={w['hdd']['iops'] / w['ssd']['iops']:.2f}")
EOF
} | tee "$RESULTS/table.md"
echo "(fio JSON, logs and this table: $RESULTS)" >&2
