#!/usr/bin/env bash
# Builds the Kafka-protocol broker the Kafka suites run against (tansu, pure Rust) once per
# machine, into ~/.cache/pgbox/tansu-<version>/bin/tansu, with cargo's progress on the terminal.
# `cargo test --all-features` needs it; the tests never build it themselves (they say to run
# this). PGBOX_TANSU=/path/to/tansu uses a binary of your own instead.
set -euo pipefail
version=0.6.0 # keep in step with TANSU_VERSION in tests/support/brokers.rs
cache="${HOME:-/tmp}/.cache/pgbox"
root="$cache/tansu-$version"
if [ -x "$root/bin/tansu" ]; then
    echo "tansu $version is already built: $root/bin/tansu"
    exit 0
fi
mkdir -p "$cache"
echo "building tansu $version (the Kafka tests' broker) once for this machine; several minutes"
# --locked: tansu 0.6.0 does not compile against its dependencies' newest versions. Its
# default features have no storage engine; the tests' in-memory storage comes with dynostore.
exec 9>"$cache/tansu-build.lock"
flock 9
if [ -x "$root/bin/tansu" ]; then
    exit 0
fi
env -u RUSTFLAGS CARGO_INCREMENTAL=0 cargo install tansu --version "$version" --locked \
    --features postgres,dynostore --root "$root" --target-dir "$cache/tansu-target"
rm -rf "$cache/tansu-target"
echo "built: $root/bin/tansu"
