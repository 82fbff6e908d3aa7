#!/usr/bin/env bash
# Entry point of the npuserve images: loads the Ascend environment where the image has one, then
# runs the command (`npuserve serve|executor|scheduler|gateway ...`).
#
# NPUSERVE_ASCEND_ENV=required (the Ascend image) makes a missing CANN toolkit or NNAL a start-up
# error that names the file; the CPU image leaves it unset and sources nothing.
set -euo pipefail

ascend_home="${ASCEND_HOME:-/usr/local/Ascend}"
if [[ "${NPUSERVE_ASCEND_ENV:-}" == "required" ]]; then
    # CANN 8.5 installs its environment script under cann/, older releases under ascend-toolkit/.
    toolkit=""
    for candidate in "$ascend_home/ascend-toolkit/set_env.sh" "$ascend_home/cann/set_env.sh"; do
        if [[ -f "$candidate" ]]; then
            toolkit="$candidate"
            break
        fi
    done
    nnal="$ascend_home/nnal/atb/set_env.sh"
    if [[ -z "$toolkit" ]]; then
        echo "npuserve: error: no CANN toolkit: neither $ascend_home/ascend-toolkit/set_env.sh nor" \
            "$ascend_home/cann/set_env.sh exists; build the image FROM a CANN base image" >&2
        exit 1
    fi
    if [[ ! -f "$nnal" ]]; then
        echo "npuserve: error: no NNAL: $nnal does not exist; use a CANN base image that includes NNAL" >&2
        exit 1
    fi
    # NOTE: Ascend's scripts read unset variables; they run without -u.
    set +u
    # shellcheck disable=SC1090
    source "$toolkit"
    # shellcheck disable=SC1090
    source "$nnal"
    set -u
fi

exec "$@"
