#!/usr/bin/env bash
# Run a probe script on the device machine without installing the repo: tritonchat's packages
# as symlinks on PYTHONPATH (as .ci/device_check does).
set -uo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/tc_shim/tritonchat
for d in engine kernels app resources; do ln -sfn "$PWD/$d" "/tmp/tc_shim/tritonchat/$d"; done
export PYTHONPATH=/tmp/tc_shim${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec python "$@"
