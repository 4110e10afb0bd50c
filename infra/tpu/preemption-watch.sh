#!/usr/bin/env bash
# Spot/preemptible TPU VM: drain the worker the moment the VM is told it will be preempted.
#
# GCE gives a spot VM about 30 s: the metadata server's `instance/preempted` turns TRUE and an
# ACPI shutdown follows. systemd's shutdown already stops renderfarm-worker with SIGTERM (its
# warm shutdown drains within --drain-seconds, default 25); this watcher starts the drain on the
# metadata signal itself, the earliest notice, so the worker's unfinished jobs go back on the
# queue at once and other workers take them while this VM is still going down.
#
# Installed by infra/tpu/startup.sh as /opt/renderfarm/preemption-watch.sh, run by
# renderfarm-preemption.service. Long-polls the metadata server (wait_for_change), so it costs
# nothing while it waits. Overridable for tests: METADATA_URL, ON_PREEMPT (a command).
set -euo pipefail

readonly URL=${METADATA_URL:-http://metadata.google.internal/computeMetadata/v1/instance/preempted}
readonly ON_PREEMPT=${ON_PREEMPT:-systemctl stop --no-block renderfarm-worker.service}

log() { echo "renderfarm preemption-watch: $*" >&2; }

etag=NONE
while true; do
  # -D -: the headers come first, then the body (TRUE or FALSE); the ETag makes the next
  # request wait until the value changes.
  if ! reply=$(curl -sS -D - -H 'Metadata-Flavor: Google' "$URL?wait_for_change=true&last_etag=$etag&timeout_sec=3600"); then
    sleep 5  # the metadata server restarts with the VM's agent: try again
    continue
  fi
  etag=$(printf '%s' "$reply" | tr -d '\r' | sed -n 's/^[Ee][Tt][Aa][Gg]: *//p' | tail -n 1)
  etag=${etag:-NONE}
  if [[ $(printf '%s' "$reply" | tr -d '\r' | tail -n 1) == TRUE ]]; then
    log "this VM is being preempted: draining the worker ($ON_PREEMPT)"
    eval "$ON_PREEMPT"
    exit 0
  fi
done
