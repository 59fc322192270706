#!/usr/bin/env bash
# Replicated volumes and the write-intent log (design 0005), measured in one
# invocation against a build without it:
#
#   BEFORE=path/to/older/blizzard bench/replicated.sh
#
# 1. 3-way 4 KiB random writes at QD1 and QD32 (write-through, then
#    fast-ack), through NBD against a fresh `blizzard up` (bench/row.sh),
#    BEFORE and AFTER alternately in ABBA order, ROUNDS times each: the median IOPS and
#    server CPU per write of each, and AFTER/BEFORE.
# 2. Recovery after a crash with 256 writes in flight (AFTER only): fio
#    writes 4 KiB at random over 1 GiB at QD256 for CRASH_AFTER seconds,
#    `blizzard up` is SIGKILLed, then started again on the same data; its
#    log says how many tracts it reconciled, how many chunks it repaired
#    and how long that took. Once on a 1 GiB volume and once on a 64 GiB
#    one written over the same 1 GiB: the cost follows what was in flight,
#    not the volume's size.
#
# Environment (all optional):
#   BEFORE=/work/target-before/release/blizzard   the baseline binary
#   AFTER=target/release/blizzard                 the binary under test
#   ROUNDS=3 RUNTIME=5                            rows per binary, seconds per row
#   MODES="write-through fast-ack"                modes of part 1
#   CRASH_AFTER=3                                 seconds of writing before the kill
#   CRASH_RUNS=3                                  crashes per mode and size
#   PARTS="1 2"                                   which parts to run
# Needs fio with the nbd engine; run as root with the machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${BEFORE:-/work/target-before/release/blizzard}
AFTER=${AFTER:-target/release/blizzard}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-5}
MODES=${MODES:-write-through fast-ack}
CRASH_AFTER=${CRASH_AFTER:-3}
CRASH_RUNS=${CRASH_RUNS:-3}
PARTS=${PARTS:-1 2}
# Each tractserver's disk: a 1 GiB volume at 3-way is 3 GiB over 4 disks.
DISK_ARGS="--disk-size 1536MiB"

median() { sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

if [[ " $PARTS " == *" 1 "* ]]; then
    [ -x "$BEFORE" ] || { echo "bench/replicated.sh: BEFORE=$BEFORE is not a binary" >&2; exit 1; }
    echo "== 3-way 4 KiB random writes, $ROUNDS rounds of ${RUNTIME}s per binary, alternating"
    for mode in $MODES; do
        for qd in 1 32; do
            : > /tmp/replicated.before
            : > /tmp/replicated.after
            for round in $(seq "$ROUNDS"); do
                # ABBA: the second run of a pair starts while the first
                # one's files are still being written back and freed, so
                # the order turns every other round.
                order="before after"
                [ $((round % 2)) = 0 ] && order="after before"
                for which in $order; do
                    bin=$BEFORE
                    [ "$which" = after ] && bin=$AFTER
                    line=$(BIN=$bin MODE=$mode REPL=3 RW=randwrite BS=4k QD=$qd RUNTIME=$RUNTIME DROP=0 \
                        UP_ARGS="$DISK_ARGS" bench/row.sh)
                    echo "   $which: $line"
                    iops=$(sed -E 's/.*: ([0-9,]+) IOPS.*/\1/; s/,//g' <<< "$line")
                    cpu=$(sed -E 's/.*server CPU ([0-9.,]+) µs\/op.*/\1/; s/,//g' <<< "$line")
                    echo "$iops $cpu" >> "/tmp/replicated.$which"
                done
            done
            b=$(cut -d' ' -f1 /tmp/replicated.before | median)
            a=$(cut -d' ' -f1 /tmp/replicated.after | median)
            bc=$(cut -d' ' -f2 /tmp/replicated.before | median)
            ac=$(cut -d' ' -f2 /tmp/replicated.after | median)
            python3 -c "import sys; b,a,bc,ac=map(float,sys.argv[1:]); print(f'$mode r3 randwrite 4k QD$qd: before {b:,.0f} IOPS ({bc:.1f} µs CPU/op), after {a:,.0f} IOPS ({ac:.1f} µs CPU/op): after/before {a/b:.3f}x IOPS, {ac/bc:.3f}x CPU')" "$b" "$a" "$bc" "$ac"
        done
    done
    rm -f /tmp/replicated.before /tmp/replicated.after
fi

if [[ " $PARTS " == *" 2 "* ]]; then
    echo "== recovery after SIGKILL with 256 writes in flight (3-way)"
    PORT=10949
    DIR=/var/tmp/blizzard-replicated
    LOG=$(mktemp)
    PID=
    trap '[ -n "$PID" ] && kill -9 $PID 2>/dev/null; rm -rf "$DIR" "$LOG"' EXIT
    start() {
        # Emptied here: the child's own redirection truncates it only once
        # it runs, after the readiness check below may have read the old one.
        : > "$LOG"
        "$AFTER" up --data "$DIR" --listen "127.0.0.1:$PORT" --meta-listen "127.0.0.1:$((PORT + 1))" \
            --tractservers 4 --replication 3 --mode "$1" --size "$2" $DISK_ARGS > "$LOG" 2>&1 &
        PID=$!
        local deadline=$((SECONDS + 180))
        until grep -q 'stops it cleanly' "$LOG"; do
            kill -0 $PID 2>/dev/null || { cat "$LOG" >&2; exit 1; }
            [ $SECONDS -lt $deadline ] || { echo "not ready after 180 s" >&2; exit 1; }
            sleep 0.05
        done
    }
    for mode in write-through fast-ack; do
        for size in 1GiB 64GiB; do
          for _ in $(seq "$CRASH_RUNS"); do
            rm -rf "$DIR"
            start "$mode" "$size"
            until [ "$(grep -c 'zero-fill done' "$LOG")" -ge "$(grep -c 'zero-filling the disk' "$LOG")" ]; do sleep 0.5; done
            fio --name=crash --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/disk" --rw=randwrite --bs=4k \
                --iodepth=256 --size=1G --time_based --runtime=60 --norandommap --randrepeat=0 \
                > /dev/null 2>&1 &
            FIO=$!
            sleep "$CRASH_AFTER"
            kill -9 $PID
            wait $PID 2>/dev/null || true
            kill -9 $FIO 2>/dev/null || true
            wait $FIO 2>/dev/null || true
            t0=$(date +%s.%N)
            start "$mode" "$size"
            t1=$(date +%s.%N)
            line=$(sed 's/\x1b\[[0-9;]*m//g' "$LOG" | grep 'replicas reconciled' | tail -1 || true)
            python3 - "$mode" "$size" "$t0" "$t1" "$line" <<'EOF'
import re, sys
mode, size, t0, t1, line = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
f = lambda k: (re.search(rf"{k}=(\d+)", line) or [None, "0"])[1]
print(f"{mode} r3 {size}: restart to ready {t1 - t0:.2f} s; reconciled {f('tracts')} tracts "
      f"({f('chunks_compared')} chunks compared, {f('chunk_repairs')} chunk repairs, "
      f"{f('bytes_copied')} bytes copied) in {f('took_ms')} ms")
EOF
            kill -TERM $PID
            wait $PID 2>/dev/null || true
            PID=
          done
        done
    done
fi
