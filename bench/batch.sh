#!/usr/bin/env bash
# Batched small writes across processes (issue 24, point 1): one cluster of
# separate processes on this machine (`blizzard meta`, 4 `blizzard
# tractserver`s, plain TCP between them) and two `blizzard nbd` servers on
# it, each serving its own 3-way write-through volume: one batches the small
# writes to a tractserver that are ready together (`WriteTracts`, the
# default), the other sends each alone (`--no-write-batching`). fio reaches
# both through NBD on a unix socket. Rows alternate between the two, REPEAT
# rounds (3), medians:
#
#   bench/batch.sh                         (RUNTIME=8 by default)
#
# Rows: 4 KiB random write at QD32 and QD1. Server CPU per write:
# utime+stime of every process (the idle NBD server costs next to nothing).
# Prints a markdown table; the last line is
#   batch: write_iops=A write_cpu=B qd1_iops=C
# A and C: IOPS batched ÷ alone; B: CPU per write alone ÷ batched (above 1:
# batching saves CPU).
# (`blizzard up` does not batch: its servers take requests as values.)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/blizzard}
RUNTIME=${RUNTIME:-8}
REPEAT=${REPEAT:-3}
DIR=${DIR:-/var/tmp/blizzard-batchbench}
PORT=${PORT:-10990}
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

"$BIN" meta --listen "127.0.0.1:$PORT" --replication 3 --init-tractservers 4 --insecure > "$DIR/meta.log" 2>&1 &
PIDS+=($!)
for i in 0 1 2 3; do
    "$BIN" tractserver --disk "$DIR/ts$i.disk" --create-size 3GiB --meta "127.0.0.1:$PORT" \
        --listen "127.0.0.1:$((PORT + 1 + i))" --insecure > "$DIR/ts$i.log" 2>&1 &
    PIDS+=($!)
done
deadline=$((SECONDS + 180))
until [ "$(cat "$DIR"/ts*.log | grep -c 'zero-fill done')" -ge 4 ]; do
    [ $SECONDS -lt $deadline ] || { echo "cluster not up; logs:" >&2; tail -5 "$DIR"/*.log >&2; exit 1; }
    sleep 0.5
done
sleep 2
for v in batched alone; do
    "$BIN" volume create "$v" --size 1GiB --replication 3 --meta "127.0.0.1:$PORT" --insecure > /dev/null
    # shellcheck disable=SC2046 # the flag or nothing
    "$BIN" nbd --meta "127.0.0.1:$PORT" --socket "$DIR/$v.sock" --default-export "$v" --tls off \
        $( [ "$v" = alone ] && echo --no-write-batching ) > "$DIR/nbd-$v.log" 2>&1 &
    PIDS+=($!)
    until grep -qs 'NBD export' "$DIR/nbd-$v.log"; do
        [ $SECONDS -lt $deadline ] || { echo "nbd $v not up" >&2; tail -5 "$DIR/nbd-$v.log" >&2; exit 1; }
        sleep 0.2
    done
    fio --name=prefill --ioengine=nbd --uri="nbd+unix:///$v?socket=$DIR/$v.sock" --rw=write --bs=1M \
        --iodepth=8 --size=1G > /dev/null
done

cpu() { local t=0 p; for p in "${PIDS[@]}"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $t; }
row() { # VOLUME QD NAME
    local c0 c1 out
    sync
    c0=$(cpu)
    out=$(fio --name=row --ioengine=nbd --uri="nbd+unix:///$1?socket=$DIR/$1.sock" --rw=randwrite --bs=4k \
        --iodepth="$2" --size=1G --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 --output-format=json)
    sleep 1
    c1=$(cpu)
    python3 - "$out" "$((c1 - c0))" "$(getconf CLK_TCK)" "$3-$1" >> "$RESULTS" <<'PY'
import json, sys
j = json.loads(sys.argv[1][sys.argv[1].index("{"):])["jobs"][0]
ops = j["write"]["total_ios"]
cpu = int(sys.argv[2]) / int(sys.argv[3]) * 1e6 / max(ops, 1)
print(f"{sys.argv[4]} {j['write']['iops']:.0f} {cpu:.1f}")
PY
}
for round in $(seq "$REPEAT"); do
    for qd in 32 1; do
        for v in batched alone; do
            row "$v" "$qd" "qd$qd"
            echo "  round $round qd$qd $v: $(tail -1 "$RESULTS" | cut -d' ' -f2-) (IOPS, CPU µs/write)" >&2
        done
    done
done

python3 - "$RESULTS" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, iops, cpu = line.split()
    rows.setdefault(name, []).append((float(iops), float(cpu)))
med = {k: (statistics.median(i for i, _ in v), statistics.median(c for _, c in v)) for k, v in rows.items()}
print("| row (3-way write-through, separate processes) | alone IOPS | batched IOPS | batched/alone | alone CPU µs/write | batched CPU µs/write | alone/batched |")
print("|---|---|---|---|---|---|---|")
for qd in ("qd32", "qd1"):
    a, b = med[f"{qd}-alone"], med[f"{qd}-batched"]
    print(f"| 4 KiB random write {qd.upper()} | {a[0]:,.0f} | {b[0]:,.0f} | {b[0] / a[0]:.2f} | {a[1]:.1f} | {b[1]:.1f} | {a[1] / b[1]:.2f} |")
a, b = med["qd32-alone"], med["qd32-batched"]
q1 = med["qd1-batched"][0] / med["qd1-alone"][0]
print(f"batch: write_iops={b[0] / a[0]:.2f} write_cpu={a[1] / b[1]:.2f} qd1_iops={q1:.2f}")
PY
