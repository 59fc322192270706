# Shared by the benchmarks that start `blizzard up` (source it):
#
#   wait_up LOG PID SECONDS
#
# waits until the `blizzard up` running as PID (output in LOG) is ready
# ("stops it cleanly") and its new disk files are zero-filled (rows
# measured while that runs would share the disk and the process's CPU with
# it; builds before the zero-fill log neither line); exits the script with
# the log's tail if the server dies or SECONDS pass.
wait_up() {
    local log=$1 pid=$2 deadline=$((SECONDS + $3))
    until grep -qs 'Ctrl-C (or SIGTERM) stops it cleanly' "$log"; do
        kill -0 "$pid" 2>/dev/null || { echo "blizzard up died while starting; its log:" >&2; tail -30 "$log" >&2; exit 1; }
        [ $SECONDS -lt $deadline ] || { echo "blizzard up not ready after $3 s" >&2; exit 1; }
        sleep 0.2
    done
    # Tractserver disks only: a small file of the metadata server's (its
    # scope store) starts a filler that ends with the file, unlogged.
    until [ "$(grep -c 'zero-fill done.*\.disk' "$log")" -ge "$(grep -c 'zero-filling the disk.*\.disk' "$log")" ]; do
        kill -0 "$pid" 2>/dev/null || { echo "blizzard up died while zero-filling; its log:" >&2; tail -30 "$log" >&2; exit 1; }
        [ $SECONDS -lt $deadline ] || { echo "zero-fill not done after $3 s" >&2; exit 1; }
        sleep 0.5
    done
}
