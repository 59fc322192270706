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
#                   write QD32 and random read QD32 rows again, twice each:
#                   under `perf stat` (context switches, syscalls per op),
#                   then under `perf record -g -p PID`; reports go to
#                   $PERF_OUT/nbd-perf-*.txt (default /tmp), perf.data to
#                   RESULTS. PERF_CALLGRAPH=dwarf records DWARF call chains
#                   (user-space callers; the binary has no frame pointers).
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
# fio runs without --direct: the nbd engine has no client-side cache. On the
# server side every server serves 4 KiB reads from the page cache when the
# working set fits (blizzard's tractservers write through the page cache
# and read pieces up to 256 KiB through it, larger ones with O_DIRECT).
#
# Needs root (drop_caches, perf); installs fio, qemu-utils, nbdkit and
# libnbd-bin if missing. Prints a markdown table for docs/benchmarks.md,
# then the durable floors (measured first, next to qemu-nbd's rows) and the
# write-through QD1 bound they set.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib/up.sh
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
BIN=$(realpath "$BIN")

if [ $# -ge 1 ]; then mkdir -p "$1"; DIR=$(mktemp -d "$1/nbd-bench.XXXXXX"); else DIR=$(mktemp -d /var/tmp/nbd-bench.XXXXXX); fi
RESULTS=${RESULTS:-$(mktemp -d /tmp/nbd-bench.XXXXXX)}
mkdir -p "$RESULTS"
RESULTS=$(realpath "$RESULTS")
PERF_OUT=$(realpath "$PERF_OUT")
# fio and perf drop files in their working directory: not in the source tree.
cd "$DIR"
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
    : > "$SERVER_LOG"
    "${SERVER_CMD[@]}" > "$SERVER_LOG" 2>&1 &
    SERVER_PID=$!
    if [[ $name == bz-* ]]; then
        wait_up "$SERVER_LOG" "$SERVER_PID" 180
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
t = open(sys.argv[1]).read(); j = json.loads(t[t.index("{"):])["jobs"][0]
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
    # A hung server must not hang the benchmark.
    timeout -k 10 $((RUNTIME + 120)) "${FIO_CMD[@]}" > "$json" || {
        echo "fio failed or timed out ($srv $name); see $json and $SERVER_LOG" >&2
        exit 1
    }
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
    timeout -k 10 1800 fio --name=prefill --ioengine=nbd "--uri=$2" --rw=write --bs=1m --iodepth=8 "--size=$SIZE_B" \
        --verify=crc32c --do_verify=1 --verify_state_save=0 --end_fsync=1 --output-format=json > "$json" || {
        echo "prefill/verify of $1 failed; see $json" >&2
        echo "$1	prefill-verify	failed" >> "$RESULTS/problems.tsv"
        return 1
    }
    python3 - "$json" <<'EOF' >&2
import json, sys
t = open(sys.argv[1]).read(); j = json.loads(t[t.index("{"):])["jobs"][0]
print(f"  prefill: {j['write']['bw_bytes']/1e6:.0f} MB/s write, {j['read']['bw_bytes']/1e6:.0f} MB/s verify read, error={j['error']}")
EOF
    settle "$SERVER_PID" > /dev/null
}

# Syscalls counted per operation while profiling.
PERF_SYSCALLS="futex epoll_wait epoll_pwait epoll_pwait2 read write readv writev recvfrom sendto recvmsg sendmsg
    pread64 pwrite64 preadv pwritev preadv2 pwritev2 fdatasync fsync io_uring_enter sched_yield madvise mmap munmap
    mprotect clock_nanosleep"

# perf stat -x, output -> counts per fio operation.
perf_stat_per_op() { # stat-file ops
    python3 - "$1" "$2" <<'EOF'
import sys
ops = int(sys.argv[2])
rows, sc = [], []
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 3 or line.startswith("#") or not f[0] or f[0].startswith("<"):
        continue
    v, ev = float(f[0]), f[2]
    if ev.startswith("syscalls:sys_enter_"):
        if v:
            sc.append((v, ev[len("syscalls:sys_enter_"):]))
    elif ev == "task-clock":
        rows.append(f"server CPU (task-clock)    {v * 1000 / ops:9.1f} µs/op   ({v / 1000:.2f} s over {ops} ops)")
    elif ev == "raw_syscalls:sys_enter":
        rows.append(f"syscalls (all)             {v / ops:9.2f} /op")
    else:
        rows.append(f"{ev:26} {v / ops:9.2f} /op")
print("\n".join(rows))
print("syscalls by name (/op):    " + ", ".join(f"{n} {v / ops:.2f}" for v, n in sorted(sc, reverse=True)))
EOF
}

# Where the samples went, by kind: the syscall a kernel sample is under (from
# its kernel call chain), interrupts, or the user-space leaf's library or crate.
perf_categories() { # perf.data cpu_us_per_op
    perf script -i "$1" -F comm,tid,period,ip,sym,dso 2>/dev/null | python3 -c '
import collections, re, sys
cpu_per_op = float(sys.argv[1])
cats, frames, total = collections.Counter(), [], 0
IRQ = ("asm_common_interrupt", "asm_sysvec_", "__irq_exit_rcu", "irqentry_exit", "asm_exc_page_fault")
def classify(fr):
    if not fr:
        return "unknown"
    sym, dso = fr[0]
    if dso.startswith("[kernel"):
        for s, _ in fr:
            m = re.match(r"__(?:x64|ia32|do)_sys_(\w+)", s)
            if m:
                return "kernel: syscall " + m.group(1)
        for s, _ in fr:
            if s.startswith("asm_exc_page_fault"):
                return "kernel: page faults"
            if s.startswith(IRQ):
                return "kernel: interrupts, softirq, preemption (no syscall)"
        if any(s.startswith("entry_SYSCALL_64") for s, _ in fr):
            # Preempted or rescheduled on the way out of a syscall: the
            # sys_* frame is gone; name the user-space wrapper instead.
            user = next((s for s, d in fr if not d.startswith("[kernel")), "?")
            user = "syscall() (futex)" if user == "syscall" else user
            return "kernel: syscall return (reschedule) from " + user
        return "kernel: other"
    if re.search(r"(^|[^a-z])_?mi_|mimalloc", sym):
        return "user: mimalloc"
    if re.search(r"mem(move|cpy|set|cmp)", sym):
        return "user: libc mem* (copies, zeroing)"
    if "crc32c" in sym:
        return "user: CRC32C"
    if "libc" in dso:
        return "user: libc (syscall wrappers etc.)"
    m = re.search(r"blizzard_(\w+)", sym)
    if m:
        return "user: blizzard_" + m.group(1)
    for pre, name in (("tokio", "tokio runtime"), ("mio", "mio"), ("futures", "futures"), ("bytes", "bytes"),
                      ("std::", "std/core/alloc"), ("core::", "std/core/alloc"), ("alloc::", "std/core/alloc")):
        if re.match(r"<?" + re.escape(pre), sym):
            return "user: " + name
    return "user: other"
def flush():
    global frames, total
    if hdr is not None:
        cats[classify(frames)] += hdr
        total += hdr
    frames = []
hdr = None
for line in sys.stdin:
    if not line.strip():
        flush(); hdr = None
        continue
    if not line[0].isspace():
        flush()
        m = re.search(r"\s(\d+)\s*$", line.split(":")[-1]) or re.search(r"\s(\d+)\s", line)
        hdr = int(m.group(1)) if m else 1
        continue
    m = re.match(r"\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$", line)
    if m:
        frames.append((m.group(1), m.group(2)))
flush()
kernel = sum(v for k, v in cats.items() if k.startswith("kernel"))
print(f"samples: kernel {100 * kernel / total:.1f}%, user {100 * (total - kernel) / total:.1f}%")
print("  share   µs/op  category")
for k, v in cats.most_common():
    if v / total >= 0.002:
        print(f"{100 * v / total:6.1f}% {cpu_per_op * v / total:7.1f}  {k}")
' "$2" || true
}

PERF_CALLGRAPH=${PERF_CALLGRAPH:-fp}
profile_rows() { # server-name uri: the QD32 4 KiB rows again, under perf
    report() { perf report -i "$data" --no-children --stdio "$@" 2>/dev/null | grep -v '^$' || true; }
    local srv=$1 uri=$2 spec name rw bs qd events sc
    local cg=(-g)
    # shellcheck disable=SC2054  # "dwarf,16384" is one argument
    [ "$PERF_CALLGRAPH" = dwarf ] && cg=(--call-graph dwarf,16384 -F 1000)
    events=task-clock,context-switches,cpu-migrations,page-faults,raw_syscalls:sys_enter
    for sc in $PERF_SYSCALLS; do events+=",syscalls:sys_enter_$sc"; done
    for spec in "4k-randwrite-qd32|randwrite|4k|32" "4k-randread-qd32|randread|4k|32"; do
        IFS='|' read -r name rw bs qd _ <<<"$spec"
        local tag=${name#4k-}; tag=${tag%-qd32}-qd32-${srv#bz-}
        [ "$PERF_CALLGRAPH" = dwarf ] && tag+=-dwarf
        local data=$RESULTS/perf-$tag.data rpt=$PERF_OUT/nbd-perf-$tag.txt stat=$RESULTS/perf-$tag.stat
        fio_cmd "$uri" "$rw" "$bs" "$qd"
        # Counters first (cheap; their own pass, so the sampling below does
        # not inflate them), then the sampled profile, each a full row.
        perf stat -x, -e "$events" -p "$SERVER_PID" -o "$stat" &
        local st=$!
        sleep 0.3
        "${FIO_CMD[@]}" > "$RESULTS/$srv.$name.perfstat.json"
        kill -INT "$st"; wait "$st" || true
        settle "$SERVER_PID" > /dev/null
        perf record "${cg[@]}" -o "$data" -p "$SERVER_PID" > "$RESULTS/perf-$tag.record.log" 2>&1 &
        local rec=$!
        sleep 0.3
        "${FIO_CMD[@]}" > "$RESULTS/$srv.$name.perf.json"
        kill -INT "$rec"; wait "$rec" || true
        settle "$SERVER_PID" > /dev/null
        local sops rops vals cpu_per_op
        sops=$(parse_fio "$RESULTS/$srv.$name.perfstat.json" | cut -d' ' -f1)
        vals=$(parse_fio "$RESULTS/$srv.$name.perf.json")
        rops=${vals%% *}
        # CPU per op of the sampled pass, for the µs column of the categories.
        cpu_per_op=$(perf report -i "$data" --stdio --sort dso -g none 2>/dev/null |
            sed -n 's/^# Event count (approx.): \([0-9]*\).*/\1/p' | head -1)
        cpu_per_op=$(python3 -c "print(${cpu_per_op:-0} / 1e3 / $rops)")
        {
            echo "# $srv $name: ${FIO_CMD[*]}"
            echo "# pass 1 (perf stat): $sops ops; pass 2 (perf record ${cg[*]}): $rops ops, $(cut -d' ' -f2 <<<"$vals" | xargs printf '%.0f') IOPS"
            echo "# events are cpu-clock (no PMU in this VM): samples that fall while interrupts are"
            echo "# off land on the next irq-enable, so finish_task_switch and *_unlock_irqrestore"
            echo "# stand for context switches and wake-ups (incl. IPIs and virtio kicks that exit to the host)."
            echo
            echo "## per operation (perf stat, whole server process, pass 1)"
            perf_stat_per_op "$stat" "$sops"
            echo
            echo "## CPU by category (pass 2 samples; µs/op = share x sampled CPU per op)"
            perf_categories "$data" "$cpu_per_op"
            echo
            echo "## perf report --no-children --sort sym"
            report --sort sym -g none | sed -n '1,80p'
            echo "## perf report --no-children --sort dso"
            report --sort dso -g none | sed -n '1,30p'
            echo "## perf report --no-children --sort pid (threads)"
            report --sort pid -g none | sed -n '1,40p'
            echo "## perf report --no-children --sort sym, call chains (-g caller, 0.5%)"
            report --sort sym -g caller,0.5,callee --percent-limit 1 | sed -n '1,800p'
        } > "$rpt"
        echo "  perf: $rpt ($srv $name)" >&2
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
# The durable floor on this disk: a 4 KiB random write followed by an
# fdatasync, straight to a raw file (no NBD, no network). Write-through
# makes every write durable before replying, so its QD1 random write cannot
# beat this; qemu-nbd and nbdkit do not sync before replying. Measured just
# before the servers (qemu-nbd first), since the write-through QD1 bound
# printed below compares the two and this host's disk drifts over minutes.
FLOOR_FILE=$DIR/floor.raw
fio --name=floor --filename="$FLOOR_FILE" --rw=write --bs=1m --size="$SIZE_B" --end_fsync=1 --output-format=json > /dev/null
timeout -k 10 $((RUNTIME + 120)) fio --name=floor --filename="$FLOOR_FILE" --ioengine=psync --rw=randwrite --bs=4k \
    --fdatasync=1 --size="$SIZE_B" --time_based "--runtime=$RUNTIME" --norandommap --randrepeat=0 \
    --output-format=json > "$RESULTS/floor.json"
FLOOR_IOPS=$(python3 -c 'import json,sys; t=open(sys.argv[1]).read(); j=json.loads(t[t.index("{"):])["jobs"][0]; print(round(j["write"]["iops"]))' "$RESULTS/floor.json")
# The same for the 1 MiB sequential write row: O_DIRECT, QD 8, an
# fdatasync after every 8 writes (fio drains the queue before each one).
timeout -k 10 $((RUNTIME + 120)) fio --name=floor --filename="$FLOOR_FILE" --ioengine=libaio --direct=1 --rw=write \
    --bs=1m --iodepth=8 --fdatasync=8 --size="$SIZE_B" --time_based "--runtime=$RUNTIME" \
    --output-format=json > "$RESULTS/floor-seq.json"
FLOOR_SEQ_MBPS=$(python3 -c 'import json,sys; t=open(sys.argv[1]).read(); j=json.loads(t[t.index("{"):])["jobs"][0]; print(round(j["write"]["bw_bytes"] / 1e6))' "$RESULTS/floor-seq.json")
# The same write plus a 16-byte checksum entry elsewhere in the file, the
# shape of a tractserver's durable write (data + chunk entry), interleaved
# with the plain one so both see the same disk.
timeout -k 10 $((RUNTIME + 120)) python3 "$ROOT/bench/durable_floor.py" "$FLOOR_FILE" "$RUNTIME" > "$RESULTS/floor-entry.json"
rm -f "$FLOOR_FILE"

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
echo
echo "Durable floor (no NBD): raw file, 4 KiB random write + fdatasync each, QD1, fio psync: $FLOOR_IOPS IOPS;"
echo "1 MiB sequential write, O_DIRECT, QD 8, fdatasync every 8 writes, fio libaio: $FLOOR_SEQ_MBPS MB/s."
python3 - "$RESULTS/floor-entry.json" "$TSV" "$FLOOR_IOPS" <<'EOF'
import json, sys
e = json.load(open(sys.argv[1]))
one, entry = e["one_page"]["p50_us"], e["with_entry"]["p50_us"]
print(f"Measured interleaved by `bench/durable_floor.py` (medians): {one:,.0f} µs per durable 4 KiB write, "
      f"{entry:,.0f} µs when a 16-byte entry elsewhere in the file is written with it "
      "(a tractserver's chunk entry).")
# A server that makes each write durable before replying needs at least the
# disk's durable write plus a request path; the fastest request path
# measured here is the better of qemu-nbd's and nbdkit's, which never sync.
qd1 = {}
for line in open(sys.argv[2]):
    name, srv, ops, iops = line.split("\t")[:4]
    if name == "4k-randwrite-qd1":
        qd1[srv] = float(iops)
if "qemu-nbd" in qd1:
    floor = 1e6 / float(sys.argv[3])
    best = min(1e6 / v for s, v in qd1.items() if s in ("qemu-nbd", "nbdkit"))
    ceiling = 1e6 / (floor + best) / qd1["qemu-nbd"]
    print(f"Write-through QD1 ceiling: the fio floor ({floor:,.0f} µs) plus the fastest request path "
          f"measured here ({best:,.0f} µs per write) is {floor + best:,.0f} µs, {ceiling:.2f}× qemu-nbd; "
          f"0.5× would leave {2e6 / qd1['qemu-nbd']:,.0f} µs per write.")
EOF
if [ -s "$RESULTS/problems.tsv" ]; then echo; echo "Problems:"; sed 's/^/- /' "$RESULTS/problems.tsv"; fi
} | tee "$RESULTS/table.md"
echo "(fio JSON, server logs and this table: $RESULTS)" >&2
