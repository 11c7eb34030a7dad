#!/usr/bin/env bash
# Screenshot an HTML file with headless Chromium (Debian's `chromium`), for tests and for looking
# at `recsys-plan show --format html` reports:
#     tools/ci/chromium_screenshot.sh report.html report.png [WIDTH,HEIGHT]
# Uses the flags this machine needs (no sandbox as root, no GPU, no background networking) and a
# fresh temporary profile. Exits non-zero if Chromium is missing or no PNG was made.
# Env: CHROMIUM (default: /usr/bin/chromium, else `chromium` on PATH), SCREENSHOT_TIMEOUT (s, 90).
set -uo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 FILE.html OUT.png [WIDTH,HEIGHT]" >&2
    exit 2
fi
html=$1 png=$2 size=${3:-1280,2000}
if [ ! -f "$html" ]; then
    echo "error: $html: no such file" >&2
    exit 2
fi
browser=${CHROMIUM:-}
if [ -z "$browser" ]; then
    if [ -x /usr/bin/chromium ]; then browser=/usr/bin/chromium; else browser=$(command -v chromium || true); fi
fi
if [ -z "$browser" ]; then
    echo "error: chromium not found (apt-get install -y --no-install-recommends chromium)" >&2
    exit 3
fi
abs_html=$(realpath "$html")
mkdir -p "$(dirname "$png")"
abs_png=$(realpath -m "$png")
rm -f "$abs_png"
profile=$(mktemp -d "${TMPDIR:-/tmp}/chromium-profile.XXXXXX")
trap 'rm -rf "$profile"' EXIT
timeout --kill-after=10 "${SCREENSHOT_TIMEOUT:-90}" "$browser" \
    --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --disable-dev-shm-usage --hide-scrollbars --user-data-dir="$profile" \
    --window-size="$size" --screenshot="$abs_png" "file://$abs_html" >"$profile.log" 2>&1
rc=$?
if [ ! -s "$abs_png" ]; then
    echo "error: chromium (exit $rc) made no screenshot $png; its last output:" >&2
    tail -n 5 "$profile.log" >&2
    rm -f "$profile.log"
    exit 1
fi
rm -f "$profile.log"
echo "wrote $png"
