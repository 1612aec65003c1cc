#!/usr/bin/env bash
# The armv7 board smoke for CI: an emulated Raspberry Pi Zero 2 W userland (Debian bookworm armhf
# under qemu-user) installs the edgeflow wheel with Debian's numpy, detects its profile, runs one
# inference (checked against the host's onnxruntime) and joins one federated round over TLS
# Mosquitto after a signed OTA install. Run it from .ci/run after `pip install -e '.[dev]'`:
#
#     bash tests/boards/ci_smoke.sh
#
# The userland is cached in $EDGEFLOW_BOARDS_CACHE (default /var/cache/edgeflow-boards) and reused
# on the next run; from scratch it is built first (debootstrap + apt under emulation). Needs root.
# BOARDS_BUILD_TIMEOUT (seconds, default 1800) bounds the userland build, BOARDS_TIMEOUT (default 900)
# the smoke itself.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
need=()
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
[ -e /usr/bin/qemu-arm-static ] || need+=(qemu-user-static)
command -v update-binfmts >/dev/null 2>&1 || need+=(binfmt-support)
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
if [ "${#need[@]}" -gt 0 ]; then
    echo "boards: installing ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -e /proc/sys/fs/binfmt_misc/status ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
update-binfmts --enable qemu-arm >/dev/null 2>&1 || true
export PATH="$PATH:/usr/sbin"
start=$(date +%s)
rc=0
# The userland build (debootstrap + apt under emulation: about 4-16 min from scratch, depending on
# the machine's load; nothing when cached) has its own limit, so a slow build on a loaded machine is
# not cut short by the smoke's limit and its downloaded packages are kept for a retry.
timeout "${BOARDS_BUILD_TIMEOUT:-1800}" "$PY" tests/boards/run.py --arch armv7 --userland-only || rc=$?
built=$(date +%s)
echo "boards: armv7 userland ready in $(( built - start )) s (exit $rc)"
if [ "$rc" -eq 0 ]; then
    timeout "${BOARDS_TIMEOUT:-900}" "$PY" tests/boards/run.py --arch armv7 --smoke || rc=$?
fi
echo "boards: armv7 smoke finished in $(( $(date +%s) - built )) s, $(( $(date +%s) - start )) s in all (exit $rc)"
exit "$rc"
