#!/usr/bin/env bash
# CPU time per message of one bench arm: the bench process (client) and every PostgreSQL
# backend (server), read from /proc/<pid>/stat over a window in the middle of a run. On a
# machine where the client and the server share a few cores, rate follows this total.
#
#   cargo build --release -p pgbox-bench
#   examples/cpu_per_message.sh "I1c" 16        # arm name prefix (as --only takes), clients
#
# Needs a local server (the PostgreSQL backends are found as processes of the `postgres`
# user) and uses DATABASE_URL like the bench does; pass asynchronous commit through it to make
# CPU the limit, e.g.
#   DATABASE_URL='postgres://postgres@127.0.0.1:5432/postgres?options=-c%20synchronous_commit%3Doff'
set -euo pipefail
arm="${1:?arm name prefix}"
clients="${2:-16}"
bench="$(dirname "$0")/../target/release/pgbox-bench"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT

"$bench" --only "$arm" --clients "$clients" --duration 12 >"$out" 2>&1 &
pid=$!
sleep 6
ticks() {
    local client server=0 t p
    client=$(awk '{print $14 + $15}' "/proc/$pid/stat")
    for p in $(pgrep -u postgres postgres); do
        t=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)
        server=$((server + t))
    done
    echo "$client $server"
}
read -r c1 s1 < <(ticks)
sleep 4
read -r c2 s2 < <(ticks)
wait "$pid"
rate=$(grep '^| ' "$out" | grep -v '^| workload' | head -1 | awk -F'|' '{print $4 + 0}')
if [ -z "$rate" ] || [ "$rate" = 0 ]; then
    cat "$out" >&2
    echo "no rate for $arm" >&2
    exit 1
fi
awk -v c=$((c2 - c1)) -v s=$((s2 - s1)) -v r="$rate" -v hz="$(getconf CLK_TCK)" -v arm="$arm" 'BEGIN {
    m = r * 4
    printf "%-24s %7d msgs/s  client %6.1f us/msg  server %6.1f us/msg  total %6.1f\n",
        arm, r, c / hz * 1e6 / m, s / hz * 1e6 / m, (c + s) / hz * 1e6 / m
}'
