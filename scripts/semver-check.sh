#!/usr/bin/env bash
# Compares pgbox's public API with a baseline using cargo-semver-checks, and says which
# version bump the changes need. The baseline is the newest release tag (vX.Y.Z), else the
# commit in .semver-baseline (the API as it stood before the first release), else BASELINE=<rev>.
# cargo-semver-checks is built once per machine into ~/.cache/pgbox (several minutes), or
# found on PATH. Run before every release (RELEASING.md); not part of CI, which it would
# lengthen by the build.
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${HOME:-/tmp}/.cache/pgbox"
root="$cache/cargo-semver-checks"
if command -v cargo-semver-checks >/dev/null 2>&1; then
    tool=cargo-semver-checks
elif [ -x "$root/bin/cargo-semver-checks" ]; then
    tool="$root/bin/cargo-semver-checks"
else
    echo "building cargo-semver-checks once for this machine (several minutes)"
    env -u RUSTFLAGS CARGO_INCREMENTAL=0 cargo install cargo-semver-checks --locked \
        --root "$root" --target-dir "$cache/semver-target"
    rm -rf "$cache/semver-target"
    tool="$root/bin/cargo-semver-checks"
fi

baseline="${BASELINE:-}"
if [ -z "$baseline" ]; then
    baseline=$(git tag --list 'v[0-9]*' --sort=-v:refname | head -n 1)
fi
if [ -z "$baseline" ] && [ -f .semver-baseline ]; then
    baseline=$(grep -Eo '^[0-9a-f]{7,40}' .semver-baseline | head -n 1)
fi
if [ -z "$baseline" ]; then
    echo "no baseline: no vX.Y.Z tag, no .semver-baseline, no BASELINE" >&2
    exit 2
fi
if ! git rev-parse --quiet --verify "$baseline^{commit}" >/dev/null; then
    echo "baseline $baseline is not a commit in this clone (a shallow clone? git fetch --unshallow --tags)" >&2
    exit 2
fi
echo "comparing the working tree's public API with $baseline (all features)"
# cargo-semver-checks runs rustdoc's JSON output, which it enables on the stable toolchain.
"$tool" semver-checks check-release --package pgbox --baseline-rev "$baseline" --all-features
