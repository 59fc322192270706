#!/usr/bin/env bash
# blizzard against Ceph RBD on this one machine, in one run, both 3-way:
#
#   bench/vs-ceph.sh            (as root)
#
# Measures the same fio rows against
#   ceph      Ceph 16.2 (Debian's packages): 1 mon, 1 mgr, 3 BlueStore OSDs on
#             loop devices (direct-io) backed by files, no cephx, CRUSH failure
#             domain osd; one replicated pool of size 3 (min_size 2) holding
#             one SIZE image, read and written by fio's rbd engine (librbd in
#             fio's process; rbd_cache=false, so every I/O goes to the OSDs).
#   blizzard  `blizzard up --replication 3 --tractservers 4`: metadata server,
#             4 tractservers and the NBD server in one process, its data dir
#             under DIR, a SIZE volume in write-through mode (the default: a
#             write is acknowledged once durable on all 3 replicas), served
#             on a unix socket and reached by fio's nbd engine (libnbd).
# Both are set up and prefilled, then their rows are interleaved: each row
# runs on one target, then at once on the other, the first of the pair
# alternating from row to row and round to round. This VM's speed drifts by
# 2-3x within minutes (the host's other guests): run one target after the
# other, the ratios measured the two stretches of time as much as the two
# systems. Each idles beside the other's rows (both idle rates are shown;
# neither is charged the other's CPU). With ROUNDS=N every row pair runs N
# times; the tables show each figure's median, and each ratio (the last
# line's too) is the median of the N pairs' own ratios.
#
# Rows, RUNTIME seconds each (fio --time_based), one job, over the first
# SIZE bytes: 4 KiB random write QD32, 4 KiB random write QD1, 4 KiB random
# read QD32, 1 MiB sequential write QD8. Each target is prefilled first
# (1 MiB sequential writes, QD8, all SIZE bytes), so writes overwrite and
# reads hit written data.
#
# CPU is charged the same way to both, from /proc deltas over each row's
# window: utime+stime (+ cutime+cstime of reaped children) of the server's
# processes, all threads: for Ceph the mon, the mgr and the 3 OSD processes,
# for blizzard its one `blizzard up` process. The window opens just before
# fio starts and closes once the server is idle again after fio exits
# (its CPU back near what it used idle, measured before the rows), so work
# deferred past the acknowledgment is charged to the row that caused it.
# Shown per I/O (µs; per MiB for the 1 MiB row). Not charged to either:
# fio (for Ceph that includes librbd and librados, which do the client's
# share of the work), and kernel threads such as the loop devices' workers,
# which submit the OSDs' disk I/O (blizzard's tractservers make their disk
# syscalls themselves, so theirs is charged). Both are shown in a second
# table: fio's CPU per I/O (fio's processes, all threads, from getrusage of
# its reaped children), and the rest of the machine's (all busy CPU in
# /proc/stat over the window minus server and fio).
#
# The disk both write to is measured too, since on one machine it bounds
# what a 3-way store can do: every replica's block is a random write to
# the same device. Before the targets, fio alone writes 4 KiB at random,
# direct, QD32 in 4 jobs for RUNTIME seconds over a file under DIR (the
# device's random-write rate as this VM gives it); each row then counts
# the device's completed writes (/proc/diskstats of the disk under DIR)
# per I/O. The table's last paragraph says how many writes a second that
# rate allows at blizzard's device writes per 4 KiB write.
#
# And what any server could do here, with no store at all (the floors),
# since on one VM the kernel's share of a write is most of its cost:
#   bare writes  fio alone does a 3-way store's least disk work: three
#                files of 1 GiB (written first in 64 KiB blocks, as the
#                targets are prefilled), 4 KiB random writes to each and an
#                fdatasync every 16 (about what blizzard's group commits
#                batch per replica in the QD32 row), RUNTIME seconds; the
#                jobs' CPU per 3-way write. Twice: through the page cache (psync)
#                and direct (io_uring, QD16 per file).
#   NBD alone    nbdkit's null plugin on a unix socket behind the same fio
#                nbd engine: its CPU per 4 KiB random write and read, QD32.
# A 3-way store served over NBD spends at least the cheaper bare write
# plus NBD's write; the paragraph before the last line says what that
# leaves of the write_cpu goal, and what the read goal asks of the cores.
#
# Environment (all optional):
#   RUNTIME=15     seconds per row
#   ROUNDS=3       times each pair of rows runs (the tables show medians)
#   SIZE=4GiB      the RBD image, the blizzard volume and fio's working set
#   OSD_SIZE=10GiB each OSD's backing file (loop device)
#   DIR=/var/tmp   where blizzard's data and Ceph's files go (a new temp dir
#                  inside it, removed at exit)
#   RESULTS=DIR    where fio's JSON, the logs and the table are kept
#                  (default: a new /tmp/vs-ceph.XXXXXX)
#   BUILD=0        1: `cargo build --release -p blizzard-cli` first (by
#                  default the binary is built only if it is missing)
#   CARGO_TARGET_DIR  where the blizzard binary is (default target)
#
# Needs root (loop devices, drop_caches). Installs Debian's ceph-mon,
# ceph-mgr, ceph-osd, ceph-common, fio, libnbd-bin, nbdkit and uuid-runtime if
# missing. Ceph is stopped by PID and its loop devices detached at the end,
# also on error or Ctrl-C (trap). Prints the table, then ends with one line:
#   vs-ceph: write_iops=X write_cpu=Y read_iops=Z seqwrite=W
# each blizzard ÷ Ceph: 4 KiB random write QD32 IOPS, the Ceph ÷ blizzard
# CPU per I/O of that row (higher: blizzard cheaper), 4 KiB random read
# QD32 IOPS, 1 MiB sequential write MB/s.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/up.sh
ROOT=$PWD
RUNTIME=${RUNTIME:-15}
ROUNDS=${ROUNDS:-3}
SIZE=${SIZE:-4GiB}
OSD_SIZE=${OSD_SIZE:-10GiB}
BUILD=${BUILD:-0}
TARGET=${CARGO_TARGET_DIR:-target}
BIN=$TARGET/release/blizzard
EXPORT=bench
POOL=bench
NOSD=3
CMDLINE="$(printf '%q ' "$0" "$@")"

[ "$(id -u)" = 0 ] || { echo "bench/vs-ceph.sh: needs root (loop devices, drop_caches)" >&2; exit 1; }

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
OSD_B=$(size_bytes "$OSD_SIZE")
# A tractserver holds at most one replica of each tract: SIZE, plus room.
DISK_B=$((SIZE_B + (512 << 20)))

need=()
for c in ceph-mon:ceph-mon ceph-mgr:ceph-mgr ceph-osd:ceph-osd ceph:ceph-common rbd:ceph-common \
    monmaptool:ceph-common ceph-authtool:ceph-common fio:fio nbdinfo:libnbd-bin nbdkit:nbdkit \
    uuidgen:uuid-runtime; do
    command -v "${c%%:*}" >/dev/null || need+=("${c#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "installing ${need[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
for e in rbd nbd io_uring; do
    fio --enghelp 2>/dev/null | grep -qw "$e" || { echo "this fio has no $e engine" >&2; exit 1; }
done

if [ "$BUILD" = 1 ] || [ ! -x "$BIN" ]; then cargo build --release -q -p blizzard-cli; fi
[ -x "$BIN" ] || { echo "no $BIN" >&2; exit 1; }
BIN=$(realpath "$BIN")

WORK=$(mktemp -d "${DIR:-/var/tmp}/vs-ceph.XXXXXX")
RESULTS=${RESULTS:-$(mktemp -d /tmp/vs-ceph.XXXXXX)}
mkdir -p "$RESULTS"
RESULTS=$(realpath "$RESULTS")
TSV=$RESULTS/results.tsv
: > "$TSV"
# fio drops files in its working directory: not in the source tree.
cd "$WORK"

HZ=$(getconf CLK_TCK)
SERVER_PID=     # blizzard up
NULL_PID=       # nbdkit null, for the NBD floor
SERVER_LOG=
CEPH=$WORK/ceph
CEPH_PIDS=()    # mon, mgr, OSDs: started in the foreground (-f), ours by PID
LOOPS=()        # loop devices we attached

stop_pids() { # pid...: SIGTERM, up to 60 s, then SIGKILL
    local pid left
    for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 600); do
        left=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && left=1; done
        [ $left = 0 ] && break
        sleep 0.1
    done
    for pid in "$@"; do
        if kill -0 "$pid" 2>/dev/null; then
            echo "WARNING: pid $pid still running 60 s after SIGTERM; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
}

ceph_down() {
    [ ${#CEPH_PIDS[@]} -gt 0 ] && stop_pids "${CEPH_PIDS[@]}"
    CEPH_PIDS=()
    local dev
    for dev in "${LOOPS[@]}"; do
        losetup -d "$dev" 2>/dev/null || echo "WARNING: could not detach $dev" >&2
    done
    LOOPS=()
    rm -rf "$CEPH"
}

null_down() {
    [ -n "$NULL_PID" ] && stop_pids "$NULL_PID"
    NULL_PID=
}

blizzard_down() {
    [ -n "$SERVER_PID" ] && stop_pids "$SERVER_PID"
    SERVER_PID=
    rm -rf "$WORK/blizzard"
}

cleanup() {
    local rc=$?
    if [ $rc -ne 0 ]; then
        if [ -n "$SERVER_PID" ] && [ -n "$SERVER_LOG" ]; then
            echo "--- last lines of $SERVER_LOG" >&2; tail -20 "$SERVER_LOG" >&2 || true
        fi
        if [ -d "$CEPH/log" ]; then
            mkdir -p "$RESULTS/ceph-log"; cp "$CEPH"/log/*.log "$RESULTS/ceph-log/" 2>/dev/null || true
            echo "(Ceph's logs: $RESULTS/ceph-log)" >&2
        fi
    fi
    null_down
    blizzard_down
    ceph_down
    rm -rf "$WORK"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

ticks() { # pid...: utime+stime+cutime+cstime of whole processes, summed
    local pid s sum=0
    for pid in "$@"; do
        s=$(cat "/proc/$pid/stat" 2>/dev/null) || continue
        s=${s##*) }   # drop "pid (comm) ": comm may hold spaces
        sum=$((sum + $(awk '{print $12 + $13 + $14 + $15}' <<<"$s")))
    done
    echo "$sum"
}

busy_ticks() { # the whole machine: user nice system irq softirq
    awk '/^cpu / {print $2 + $3 + $4 + $7 + $8; exit}' /proc/stat
}

# The block device holding DIR (its whole disk, where partitions and loop
# devices above it send their writes), by name as in /proc/diskstats;
# empty if there is none (tmpfs).
disk_of() { # path
    local src name parent
    src=$(findmnt -no SOURCE -T "$1" 2>/dev/null) || return 0
    name=${src#/dev/}
    [ -e "/sys/class/block/$name" ] || return 0
    parent=$(lsblk -no PKNAME "/dev/$name" 2>/dev/null | head -1)
    echo "${parent:-$name}"
}

disk_writes() { # completed writes of DISK so far (0 if unknown)
    if [ -n "$DISK" ]; then
        awk -v d="$DISK" '$3 == d {print $8; found = 1} END {if (!found) print 0}' /proc/diskstats
    else
        echo 0
    fi
}

# fio alone against the disk: 4 KiB random direct writes, QD32, 4 jobs
# over one file of 1 GiB (laid out first by fio), RUNTIME seconds. Sets
# DISK_IOPS (0 if it could not run direct here).
disk_rate() {
    local json=$RESULTS/disk.json
    if fio --name=disk --filename="$WORK/disk.fio" --size=1g --rw=randwrite --bs=4k --direct=1 \
        --ioengine=libaio --iodepth=32 --numjobs=4 --group_reporting --time_based "--runtime=$RUNTIME" \
        --norandommap --randrepeat=0 --output-format=json > "$json" 2>/dev/null; then
        DISK_IOPS=$(python3 -c "
import json; t = open('$json').read(); print(int(json.loads(t[t.index('{'):])['jobs'][0]['write']['iops']))")
    else
        DISK_IOPS=0
    fi
    rm -f "$WORK/disk.fio"
}

# The servers' idle CPU, ticks per second over 5 s: settle's yardstick.
idle_rate() { # pid...
    local a b
    a=$(ticks "$@"); sleep 5; b=$(ticks "$@")
    python3 -c "print(($b - $a) / 5)"
}

# Waits until the servers use no more CPU than idle (IDLE ticks/s, the
# rate of the target being measured, plus 2
# ticks) over a whole second; prints how long that took (s), at most 60.
settle() { # pid...
    local start a b limit
    start=$(date +%s.%N)
    limit=$(python3 -c "print(int($IDLE * 1.5) + 2)")
    a=$(ticks "$@")
    for _ in $(seq 60); do
        sleep 1
        b=$(ticks "$@")
        [ $((b - a)) -le "$limit" ] && break
        a=$b
    done
    python3 -c "print(f'{max(0.0, $(date +%s.%N) - $start - 1):.1f}')"
}

quiesce() {
    sync
    echo 3 > /proc/sys/vm/drop_caches
}

# Every row: name|rw|bs|iodepth
ROWS=(
    "4k-randwrite-qd32|randwrite|4k|32"
    "4k-randwrite-qd1|randwrite|4k|1"
    "4k-randread-qd32|randread|4k|32"
    "1m-seqwrite-qd8|write|1m|8"
)

# The engine's options for one target; the rest of each fio command is the
# same for both.
engine_opts() { # target
    case $1 in
    ceph) ENGINE=(--ioengine=rbd --clientname=admin "--pool=$POOL" --rbdname=img) ;;
    blizzard) ENGINE=(--ioengine=nbd "--uri=nbd+unix:///$EXPORT?socket=$WORK/nbd.sock") ;;
    esac
}

# Runs a command, then writes the CPU seconds (user + system) it and all its
# descendants used to a file: fio's main process and its job process with
# every thread (fio's own usr_cpu/sys_cpu count the job thread only, not
# librbd's and librados's threads).
cpu_of() { # file command...
    python3 - "$@" <<'EOF'
import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write(f"{ru.ru_utime + ru.ru_stime}\n")
sys.exit(rc)
EOF
}

# fio alone doing a 3-way store's least disk work (module docs); prints
# its jobs' CPU µs per 3-way write and the 3-way writes a second.
bare_writes() { # buffered|direct
    local json=$RESULTS/bare-$1.json opts i files=()
    case $1 in
    buffered) opts=(--ioengine=psync) ;;
    direct) opts=(--ioengine=io_uring --iodepth=16 --direct=1) ;;
    esac
    for i in 0 1 2; do
        files+=("--name=replica$i" "--filename=$WORK/bare$i")
        [ -f "$WORK/bare$i" ] || fio --name=layout "--filename=$WORK/bare$i" --size=1g --rw=write --bs=64k \
            --end_fsync=1 --output-format=json > /dev/null
    done
    fio --size=1g --rw=randwrite --bs=4k --fdatasync=16 --time_based "--runtime=$RUNTIME" \
        --norandommap --randrepeat=0 "${opts[@]}" --output-format=json "${files[@]}" > "$json" || {
        echo "bare $1 writes failed; see $json" >&2; exit 1; }
    # The jobs' own CPU (fio's usr_cpu and sys_cpu: the threads that made
    # the system calls), not fio's main process, which polls and reports
    # at a rate that has nothing to do with the writes.
    python3 - "$json" <<'EOF'
import json, sys
t = open(sys.argv[1]).read(); jobs = json.loads(t[t.index("{"):])["jobs"]
ops = sum(j["write"]["total_ios"] for j in jobs) / 3
cpu = sum((j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] / 1000 for j in jobs)
secs = max(j["job_runtime"] for j in jobs) / 1000
print(cpu * 1e6 / ops, ops / secs)
EOF
}

# nbdkit's null plugin behind fio's nbd engine (module docs); prints the
# server's and fio's CPU µs per 4 KiB I/O, and I/Os a second, for RW.
nbd_alone() { # randwrite|randread
    local json=$RESULTS/nbd-alone-$1.json a b ops iops
    a=$(ticks "$NULL_PID")
    cpu_of "$json.cpu" fio --name=nbd-alone --ioengine=nbd "--uri=nbd+unix:///?socket=$WORK/null.sock" \
        "--rw=$1" --bs=4k --iodepth=32 "--size=$SIZE_B" --time_based "--runtime=$RUNTIME" \
        --norandommap --randrepeat=0 --output-format=json > "$json" || {
        echo "fio against nbdkit null failed; see $json" >&2; exit 1; }
    b=$(ticks "$NULL_PID")
    read -r ops iops _ <<<"$(parse_fio "$json")"
    python3 -c "print(($b - $a) * 1e6 / $HZ / $ops, $(cat "$json.cpu") * 1e6 / $ops, $iops)"
}

floors() {
    read -r BARE_BUF_US BARE_BUF_RATE <<<"$(bare_writes buffered)"
    read -r BARE_DIRECT_US BARE_DIRECT_RATE <<<"$(bare_writes direct)"
    rm -f "$WORK"/bare[0-2]
    nbdkit -f -U "$WORK/null.sock" null "size=$SIZE_B" > "$RESULTS/nbdkit-null.log" 2>&1 &
    NULL_PID=$!
    for _ in $(seq 100); do [ -S "$WORK/null.sock" ] && break; sleep 0.1; done
    [ -S "$WORK/null.sock" ] || { echo "nbdkit null did not start; see $RESULTS/nbdkit-null.log" >&2; exit 1; }
    read -r NULL_W_US NULL_W_FIO_US NULL_W_IOPS <<<"$(nbd_alone randwrite)"
    read -r NULL_R_US NULL_R_FIO_US NULL_R_IOPS <<<"$(nbd_alone randread)"
    null_down
    for v in BARE_BUF_US BARE_DIRECT_US NULL_W_US NULL_R_US NULL_R_FIO_US; do
        [ -n "${!v}" ] || { echo "a floor was not measured ($v); see $RESULTS" >&2; exit 1; }
    done
    printf '  floors: bare 3-way writes %.1f us (buffered, %.0f/s), %.1f us (direct, %.0f/s); NBD alone %.1f us/write (%.0f/s), %.1f us/read (fio %.1f, %.1f)\n' \
        "$BARE_BUF_US" "$BARE_BUF_RATE" "$BARE_DIRECT_US" "$BARE_DIRECT_RATE" "$NULL_W_US" "$NULL_W_IOPS" "$NULL_R_US" \
        "$NULL_W_FIO_US" "$NULL_R_FIO_US" >&2
}

parse_fio() { # json -> ops iops MB/s p99_us
    python3 - "$1" <<'EOF'
import json, sys
t = open(sys.argv[1]).read(); j = json.loads(t[t.index("{"):])["jobs"][0]
if j.get("error"):
    sys.exit(f"fio job error {j['error']}")
k = "read" if j["read"]["total_ios"] else "write"
d = j[k]
ops = d["total_ios"]
if ops == 0:
    sys.exit("fio completed no I/O")
p99 = d["clat_ns"]["percentile"]["99.000000"] / 1000
print(ops, d["iops"], d["bw_bytes"] / 1e6, p99)
EOF
}

prefill() { # target
    engine_opts "$1"
    local t0=$SECONDS
    timeout -k 10 900 fio --name=prefill "${ENGINE[@]}" --rw=write --bs=1m --iodepth=8 "--size=$SIZE_B" \
        --output-format=json > "$RESULTS/$1.prefill.json" || {
        echo "prefill of $1 failed; see $RESULTS/$1.prefill.json" >&2; exit 1; }
    local vals
    vals=$(parse_fio "$RESULTS/$1.prefill.json")
    printf '  %-9s prefill %s bytes: %.0f MB/s, %d s\n' "$1" "$SIZE_B" "$(cut -d' ' -f3 <<<"$vals")" $((SECONDS - t0)) >&2
}

# One row on one target; appends its figures to the TSV with its round.
run_row() { # target round spec pid...
    local tgt=$1 round=$2 spec=$3 name rw bs qd json s0 s1 m0 m1 d0 d1 dw tailsec vals ops iops mbps p99 fiocpu srv rest
    shift 3
    engine_opts "$tgt"
    IFS='|' read -r name rw bs qd <<<"$spec"
    json=$RESULTS/$tgt.$name.r$round.json
    FIO_CMD=(fio "--name=$name" "${ENGINE[@]}" "--rw=$rw" "--bs=$bs" "--iodepth=$qd" "--size=$SIZE_B"
        --time_based "--runtime=$RUNTIME" --norandommap --randrepeat=0 --output-format=json)
    echo "${FIO_CMD[*]}" > "$RESULTS/$tgt.$name.cmd"
    # The other target's rows may have left work behind (Ceph's compaction):
    # it settles first, so this row starts on a quiet machine.
    settle_all > /dev/null
    s0=$(ticks "$@"); m0=$(busy_ticks); d0=$(disk_writes)
    # A hung server must not hang the benchmark.
    cpu_of "$json.cpu" timeout -k 10 $((RUNTIME + 120)) "${FIO_CMD[@]}" > "$json" || {
        echo "fio failed or timed out ($tgt $name); see $json" >&2; exit 1; }
    tailsec=$(IDLE=$(idle_of "$tgt") settle "$@")
    s1=$(ticks "$@"); m1=$(busy_ticks); d1=$(disk_writes)
    vals=$(parse_fio "$json")
    read -r ops iops mbps p99 <<<"$vals"
    # µs per I/O: the server, fio (with librbd), and the rest of the
    # machine (all busy CPU minus server minus fio)
    read -r srv fiocpu rest <<<"$(python3 -c "
s = ($s1 - $s0) * 1e6 / $HZ / $ops
f = $(cat "$json.cpu") * 1e6 / $ops
m = ($m1 - $m0) * 1e6 / $HZ / $ops
print(s, f, max(0.0, m - s - f))")"
    # device writes per I/O, over the same window
    dw=$(python3 -c "print(($d1 - $d0) / $ops)")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$tgt" "$ops" "$iops" "$mbps" "$p99" \
        "$srv" "$fiocpu" "$rest" "$tailsec" "$dw" "$round" >> "$TSV"
    printf '  %-9s %-18s %9.0f IOPS %7.0f MB/s  p99 %8.0f us  server %8.1f us/op  fio %6.1f  rest %6.1f  disk writes %5.2f/op  tail %ss\n' \
        "$tgt" "$name" "$iops" "$mbps" "$p99" "$srv" "$fiocpu" "$rest" "$dw" "$tailsec" >&2
}

idle_of() { # target: its servers' idle ticks a second
    case $1 in
    ceph) echo "$CEPH_IDLE" ;;
    blizzard) echo "$BZ_IDLE" ;;
    esac
}

pids_of() { # target
    case $1 in
    ceph) echo "${CEPH_PIDS[@]}" ;;
    blizzard) echo "$SERVER_PID" ;;
    esac
}

# Both targets' servers back to idle (each against its own idle rate).
settle_all() {
    local tgt
    for tgt in blizzard ceph; do
        # shellcheck disable=SC2046 # pids, split on purpose
        IDLE=$(idle_of "$tgt") settle $(pids_of "$tgt")
    done
}

# ---- blizzard ---------------------------------------------------------------
blizzard_up() {
    SERVER_LOG=$RESULTS/blizzard.log
    local cmd=("$BIN" up --data "$WORK/blizzard" --listen "unix:$WORK/nbd.sock"
        --meta-listen "127.0.0.1:$(free_port)" --replication 3 --tractservers 4
        --volume "$EXPORT" --size "$SIZE_B" --disk-size "$DISK_B")
    echo "${cmd[*]}" > "$RESULTS/blizzard.cmd"
    "${cmd[@]}" > "$SERVER_LOG" 2>&1 &
    SERVER_PID=$!
    wait_up "$SERVER_LOG" "$SERVER_PID" 300
    local got
    got=$(nbdinfo --size "nbd+unix:///$EXPORT?socket=$WORK/nbd.sock")
    [ "$got" -ge "$SIZE_B" ] || { echo "export is $got bytes, smaller than SIZE" >&2; exit 1; }
}

# ---- Ceph -------------------------------------------------------------------
cephq() { # ceph CLI, its chatter to a log (shown if it fails)
    ceph "$@" >> "$RESULTS/ceph-cli.log" 2>&1 || {
        echo "ceph $* failed:" >&2; tail -5 "$RESULTS/ceph-cli.log" >&2; return 1; }
}

ceph_up() {
    mkdir -p "$CEPH"/{run,log,crash,mon.a,mgr.x}
    local conf=$CEPH/ceph.conf fsid mon
    export CEPH_CONF=$conf
    fsid=$(uuidgen)
    mon="[v2:127.0.0.1:$(free_port),v1:127.0.0.1:$(free_port)]"
    cat > "$conf" <<EOF
[global]
fsid = $fsid
mon_host = $mon
public_network = 127.0.0.0/8
ms_bind_ipv4 = true
ms_bind_ipv6 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
run_dir = $CEPH/run
admin_socket = \$run_dir/\$cluster-\$name.asok
pid_file = \$run_dir/\$cluster-\$name.pid
log_file = $CEPH/log/\$cluster-\$name.log
crash_dir = $CEPH/crash
osd_pool_default_size = 3
osd_pool_default_min_size = 2
# failure domain osd: the 3 replicas on 3 OSDs of this one host
osd_crush_chooseleaf_type = 0
osd_pool_default_pg_autoscale_mode = off
mon_allow_pool_delete = true
mon_data_avail_warn = 2
mon_data_avail_crit = 1
mon_warn_on_insecure_global_id_reclaim_allowed = false

[mon]
mon_data = $CEPH/mon.\$id

[mgr]
mgr_data = $CEPH/mgr.\$id

[osd]
osd_data = $CEPH/osd.\$id
osd_objectstore = bluestore
osd_memory_target = 1610612736

[client]
# librbd's cache would serve reads in fio's process and, after a flush,
# acknowledge writes before the OSDs: off, so every I/O reaches the OSDs.
rbd_cache = false
EOF
    monmaptool --create --fsid "$fsid" --addv a "$mon" "$CEPH/monmap" > /dev/null
    ceph-authtool --create-keyring "$CEPH/mon.keyring" --gen-key -n mon. --cap mon 'allow *' > /dev/null
    ceph-mon --mkfs -i a --monmap "$CEPH/monmap" --keyring "$CEPH/mon.keyring" > "$CEPH/log/mkfs-mon.out" 2>&1
    ceph-mon -f -i a > "$CEPH/log/mon.a.out" 2>&1 &
    CEPH_PIDS+=($!)
    local ok=0
    for _ in $(seq 60); do
        ceph --connect-timeout 5 mon stat > /dev/null 2>&1 && { ok=1; break; }
        sleep 1
    done
    [ $ok = 1 ] || { echo "the Ceph monitor is not answering after 60 s" >&2; exit 1; }
    ceph-mgr -f -i x > "$CEPH/log/mgr.x.out" 2>&1 &
    CEPH_PIDS+=($!)

    local n f dev uuid id
    for n in $(seq 0 $((NOSD - 1))); do
        f=$CEPH/osd$n.img
        fallocate -l "$OSD_B" "$f"
        dev=$(losetup -f --show --direct-io=on "$f")
        LOOPS+=("$dev")
        # The VM's disk says rotational (a VM default) but is fast: let
        # BlueStore pick its SSD defaults, as it would on real flash.
        echo 0 > "/sys/block/${dev#/dev/}/queue/rotational" || true
        uuid=$(uuidgen)
        id=$(ceph osd new "$uuid")
        mkdir -p "$CEPH/osd.$id"
        ceph-osd -i "$id" --mkfs --osd-uuid "$uuid" --bluestore-block-path "$dev" > "$CEPH/log/mkfs-osd.$id.out" 2>&1 || {
            tail -5 "$CEPH/log/mkfs-osd.$id.out" >&2; echo "mkfs of osd.$id failed" >&2; exit 1; }
        ceph-osd -f -i "$id" > "$CEPH/log/osd.$id.out" 2>&1 &
        CEPH_PIDS+=($!)
    done
    ok=0
    for _ in $(seq 120); do
        [ "$(ceph osd stat -f json | python3 -c 'import json,sys; print(json.load(sys.stdin)["num_up_osds"])' 2>/dev/null)" = $NOSD ] && { ok=1; break; }
        sleep 1
    done
    [ $ok = 1 ] || { ceph osd tree >&2; echo "not all $NOSD OSDs up after 120 s" >&2; exit 1; }

    cephq osd pool create "$POOL" 64 64 replicated
    cephq osd pool set "$POOL" size 3
    cephq osd pool set "$POOL" min_size 2
    cephq osd pool application enable "$POOL" rbd
    # No smartctl runs against the loop devices during the rows.
    cephq device monitoring off || true
    rbd pool init "$POOL"
    rbd create --size "$((SIZE_B >> 20))" "$POOL/img"
    ok=0
    for _ in $(seq 180); do
        ceph -s -f json > "$CEPH/status.json" 2>/dev/null && python3 - "$CEPH/status.json" <<'EOF' && { ok=1; break; }
import json, sys
pg = json.load(open(sys.argv[1]))["pgmap"]
clean = sum(s["count"] for s in pg.get("pgs_by_state", []) if s["state_name"] == "active+clean")
sys.exit(0 if pg.get("num_pgs") and clean == pg["num_pgs"] else 1)
EOF
        sleep 1
    done
    [ $ok = 1 ] || { ceph -s >&2; echo "PGs not all active+clean after 180 s" >&2; exit 1; }
    ceph osd pool ls detail | grep "'$POOL'" > "$RESULTS/ceph-pool.txt"
    ceph osd tree > "$RESULTS/ceph-osd-tree.txt"
    ceph versions -f json > "$RESULTS/ceph-versions.json" 2>/dev/null || true
    echo "  ceph      $(ceph -v | awk '{print $3}'): pids ${CEPH_PIDS[*]} (mon mgr osd.0-2), loops ${LOOPS[*]}; $(cut -c1-80 "$RESULTS/ceph-pool.txt")" >&2
}

# This kind of machine is a VM whose memory is backed by the host only when
# first touched (see bench/blob.sh): touch most of the available memory once
# so neither target pays the host's first-touch faults (leave 4 GiB).
warm_mb=$(awk '/MemAvailable/ {print int($2/1024) - 4096}' /proc/meminfo)
if [ "$warm_mb" -gt 0 ]; then
    python3 -c "
import mmap
n = $warm_mb << 20
m = mmap.mmap(-1, n)
for i in range(0, n, 4096): m[i] = 1
"
fi

START=$(date -u '+%Y-%m-%d %H:%M UTC')
T0=$SECONDS
DISK=$(disk_of "$WORK")
quiesce
disk_rate
echo "== the disk under $WORK (${DISK:-unknown}): $DISK_IOPS random 4 KiB direct writes a second, fio alone (QD32, 4 jobs)" >&2
echo "== floors: fio alone writing 3 files, nbdkit null" >&2
quiesce
floors
echo "== blizzard: $BIN up --replication 3 --tractservers 4 (write-through), $WORK" >&2
quiesce
blizzard_up
# Each target's idle rate is measured before the other is busy: blizzard's
# with Ceph not yet up, Ceph's beside an idle blizzard (its own ticks only
# either way).
BZ_IDLE=$(idle_rate "$SERVER_PID")
echo "== ceph: 1 mon, 1 mgr, $NOSD BlueStore OSDs on loop devices, pool $POOL size 3, $SIZE image" >&2
ceph_up
CEPH_IDLE=$(idle_rate "${CEPH_PIDS[@]}")
prefill blizzard
prefill ceph
echo "== the rows, interleaved ($ROUNDS round(s))" >&2
for round in $(seq "$ROUNDS"); do
    for i in "${!ROWS[@]}"; do
        if [ $(((i + round) % 2)) = 1 ]; then pair=(blizzard ceph); else pair=(ceph blizzard); fi
        for tgt in "${pair[@]}"; do
            # shellcheck disable=SC2046 # pids, split on purpose
            run_row "$tgt" "$round" "${ROWS[$i]}" $(pids_of "$tgt")
        done
    done
done
kill -0 "$SERVER_PID" 2>/dev/null || { echo "blizzard up died during the rows" >&2; exit 1; }
for pid in "${CEPH_PIDS[@]}"; do
    kill -0 "$pid" 2>/dev/null || { echo "a Ceph daemon (pid $pid) died during the rows" >&2; exit 1; }
done
CEPH_VERSION=$(ceph -v | awk '{print $3}')
blizzard_down
ceph_down
echo "(run took $((SECONDS - T0)) s; Ceph torn down, loop devices detached, blizzard stopped)" >&2

{
echo "Run $START, commit \`$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)\`$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (dirty tree)'), $(nproc) cores, Ceph $CEPH_VERSION."
echo
echo "Command (as root): \`RUNTIME=$RUNTIME ROUNDS=$ROUNDS SIZE=$SIZE $CMDLINE\`"
echo
engine_opts blizzard
echo "Each row: \`fio --name=ROW ENGINE --rw=RW --bs=BS --iodepth=QD --size=$SIZE_B --time_based --runtime=$RUNTIME --norandommap --randrepeat=0\`,"
echo "ENGINE \`${ENGINE[*]}\` (blizzard) or"
engine_opts ceph
echo "\`${ENGINE[*]}\` (Ceph). Both prefilled (1 MiB sequential, QD8, $SIZE), then the rows interleaved, the first of each pair alternating; $ROUNDS round(s)$([ "$ROUNDS" -gt 1 ] && echo ', each figure the median of the rounds')."
echo "blizzard: \`$(sed "s|$WORK/||g; s|127.0.0.1:[0-9]*|127.0.0.1:PORT|g" "$RESULTS/blizzard.cmd")\`."
echo "The disk under DIR (${DISK:-unknown}), fio alone before the targets: $DISK_IOPS random 4 KiB direct writes a second (QD32, 4 jobs, $RUNTIME s)."
echo "Floors, before the targets: fio alone writing three 1 GiB files at random (4 KiB, an fdatasync every 16 writes per file, $RUNTIME s) used $(printf '%.1f' "$BARE_BUF_US") µs of CPU per 3-way write through the page cache ($(printf '%.0f' "$BARE_BUF_RATE") a second) and $(printf '%.1f' "$BARE_DIRECT_US") µs direct (io_uring, QD16 per file; $(printf '%.0f' "$BARE_DIRECT_RATE") a second); nbdkit's null plugin behind the same fio nbd engine (QD32) used $(printf '%.1f' "$NULL_W_US") µs per 4 KiB write and $(printf '%.1f' "$NULL_R_US") µs per read (fio $(printf '%.1f' "$NULL_W_FIO_US") and $(printf '%.1f' "$NULL_R_FIO_US") µs; $(printf '%.0f' "$NULL_R_IOPS") reads a second)."
echo "Servers' idle CPU before the rows (each idles beside the other's): blizzard $(python3 -c "print(f'{100 * $BZ_IDLE / $HZ:.1f}')")%, Ceph $(python3 -c "print(f'{100 * $CEPH_IDLE / $HZ:.1f}')")% of a core."
echo
python3 - "$TSV" "$DISK_IOPS" "$BARE_BUF_US" "$BARE_DIRECT_US" "$NULL_W_US" "$NULL_R_US" "$NULL_R_FIO_US" "$(nproc)" <<'EOF'
import sys, collections, statistics
runs = collections.OrderedDict()
disk_iops = float(sys.argv[2])
bare_buf, bare_direct, null_w, null_r, null_r_fio, cores = map(float, sys.argv[3:9])
keys = ("iops", "mbps", "p99", "srv", "fio", "rest", "tail", "dw")
for line in open(sys.argv[1]):
    name, tgt, ops, iops, mbps, p99, srv, fio, rest, tail, dw, rnd = line.rstrip("\n").split("\t")
    runs.setdefault(name, {}).setdefault(tgt, {})[int(rnd)] = dict(
        zip(keys, map(float, (iops, mbps, p99, srv, fio, rest, tail, dw))))
# Each figure: its median over the rounds (the one figure with one round).
rows = collections.OrderedDict(
    (name, {tgt: {k: statistics.median(r[k] for r in rs.values()) for k in keys} for tgt, rs in by.items()})
    for name, by in runs.items())
label = {"4k-randwrite-qd32": "4 KiB random write QD32", "4k-randwrite-qd1": "4 KiB random write QD1",
         "4k-randread-qd32": "4 KiB random read QD32", "1m-seqwrite-qd8": "1 MiB sequential write QD8"}
def rate(name, r):
    return r["mbps"] if name.startswith("1m") else r["iops"]
def shown(name, r):
    return f"{r['mbps']:,.0f} MB/s" if name.startswith("1m") else f"{r['iops']:,.0f}"
def cpu(name, v):
    return f"{v:,.0f} µs/MiB" if name.startswith("1m") else f"{v:,.1f} µs"
if len(runs["4k-randwrite-qd32"]["blizzard"]) > 1:
    print("Figures are the medians of the rounds; each ratio is the median of the rounds' ratios.")
    print()
print("| workload | Ceph IOPS or MB/s | Ceph CPU per I/O | blizzard IOPS or MB/s | blizzard CPU per I/O | ratio blizzard ÷ Ceph | CPU ratio Ceph ÷ blizzard |")
print("|---|---|---|---|---|---|---|")
# Each ratio is the median of the rounds' own ratios: a round's two rows ran
# within the same minute or two, on the same machine weather.
ratio = {}
for name, by in rows.items():
    c, b = by["ceph"], by["blizzard"]
    pairs = [(rb, runs[name]["ceph"][rnd]) for rnd, rb in runs[name]["blizzard"].items()]
    ratio[name] = (statistics.median(rate(name, rb) / rate(name, rc) for rb, rc in pairs),
                   statistics.median(rc["srv"] / rb["srv"] for rb, rc in pairs))
    print(f"| {label[name]} | {shown(name, c)} | {cpu(name, c['srv'])} | {shown(name, b)} | {cpu(name, b['srv'])} "
          f"| {ratio[name][0]:.2f}× | {ratio[name][1]:.2f}× |")
print()
print("Not charged to the servers, per I/O (per MiB for 1 MiB): fio's CPU, all its processes and threads (for Ceph: with librbd and librados),")
print("and the rest of the machine (kernel threads such as the loop devices' workers, interrupts, anything else running).")
print()
print("| workload | target | p99 µs | fio CPU µs | rest of machine µs | disk writes per I/O | tail s |")
print("|---|---|---|---|---|---|---|")
for name, by in rows.items():
    for tgt in ("ceph", "blizzard"):
        r = by[tgt]
        print(f"| {label[name]} | {tgt} | {r['p99']:,.0f} | {r['fio']:,.1f} | {r['rest']:,.1f} | {r['dw']:.2f} | {r['tail']:.1f} |")
print()
w = ratio["4k-randwrite-qd32"]
b = rows["4k-randwrite-qd32"]["blizzard"]
c = rows["4k-randwrite-qd32"]["ceph"]
if disk_iops > 0 and b["dw"] > 0:
    print(f"The disk: fio alone made {disk_iops:,.0f} random 4 KiB writes a second. At blizzard's {b['dw']:.2f} disk "
          f"writes per 4 KiB random write (3 replicas on this one disk), that allows about {disk_iops / b['dw']:,.0f} "
          f"writes a second; blizzard made {b['iops']:,.0f} ({b['iops'] * b['dw']:,.0f} disk writes a second), "
          f"and write_iops=15 would ask for {15 * c['iops']:,.0f}.")
    print()
floor_w = min(bare_buf, bare_direct) + null_w
r = rows["4k-randread-qd32"]
cr = r["ceph"]
max_reads = cores * 1e6 / (null_r + null_r_fio)
print(f"The floors: a 3-way write served over NBD costs at least {floor_w:.1f} µs of CPU here (the cheaper bare write, "
      f"{min(bare_buf, bare_direct):.1f}, plus NBD's {null_w:.1f}), so no server could show more than "
      f"write_cpu={c['srv'] / floor_w:.2f} against this run's Ceph ({c['srv']:,.1f} µs per write); the goal of 20 asks for "
      f"{c['srv'] / 20:.1f} µs, and blizzard used {b['srv']:.1f}. A read costs nbdkit null {null_r:.1f} µs and "
      f"fio {null_r_fio:.1f}: with all {cores:.0f} cores busy and nothing else, at most {max_reads:,.0f} "
      f"reads a second, {max_reads / cr['iops']:.2f}× Ceph's; read_iops=10 asks for "
      f"{10 * cr['iops']:,.0f}, and blizzard made {r['blizzard']['iops']:,.0f} at {r['blizzard']['srv']:.1f} µs "
      f"(fio {r['blizzard']['fio']:.1f}).")
print()
print(f"vs-ceph: write_iops={w[0]:.2f} write_cpu={w[1]:.2f} read_iops={ratio['4k-randread-qd32'][0]:.2f} "
      f"seqwrite={ratio['1m-seqwrite-qd8'][0]:.2f}")
EOF
} | tee "$RESULTS/table.md"
echo "(fio JSON, logs and this table: $RESULTS)" >&2
