#!/usr/bin/env bash
# Create TPU VMs that each run one renderfarm worker (infra/tpu/startup.sh installs it and
# starts infra/tpu/renderfarm-worker.service). Single-host slices only: every VM is its own
# worker over its own chips; add VMs to scale out.
#
#   GENERATION=v5e ZONE=us-west4-a COUNT=2 \
#   MODEL=stabilityai/stable-diffusion-2-1-base OUT=gs://my-bucket/renders \
#   BROKER_SECRET=renderfarm-broker-url \
#   PACKAGE='renderfarm[tpu] @ git+https://github.com/ORG/renderfarm@v0.1.0' \
#     infra/tpu/create-tpu-vms.sh
#
# Settings (environment):
#   GENERATION      v5e (v5litepod-*, runtime v2-alpha-tpuv5-lite) or v6e (v6e-*, v2-alpha-tpuv6e)
#   ZONE            a zone that has that generation (gcloud compute tpus accelerator-types list --zone Z)
#   CHIPS           chips per VM: 1, 4 or 8 (default 8; single-host slice sizes)
#   COUNT           how many VMs (default 1), named NAME_PREFIX-GENERATION-1..COUNT
#   NAME_PREFIX     default renderfarm
#   MODEL, OUT      what the workers serve and where images go (required)
#   BROKER_SECRET   Secret Manager secret with the broker URL (recommended), or
#   BROKER_URL      the broker URL in plain metadata
#   PACKAGE         pip requirement or gs:// wheel of renderfarm (required)
#   CONSTRAINTS     optional gs:// or https URL of requirements.lock
#   PER_DEVICE_BATCH, MAX_WAIT, VISIBILITY_TIMEOUT, WORKER_ARGS   worker settings (optional)
#   PROJECT         default: gcloud's configured project
#   SERVICE_ACCOUNT default: the Compute Engine default account; it needs storage write on
#                   OUT's bucket, read on the model, and secretmanager.secretAccessor
#   SPOT=1          spot VMs (cheap, preemptible; jobs of a preempted VM come back after the
#                   visibility timeout)
#   INTERNAL_IPS=1  no external IPs (the broker must be reachable privately)
#   DRY_RUN=1       print the gcloud commands instead of running them
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { echo "create-tpu-vms: $*" >&2; exit 2; }

GENERATION=${GENERATION:-v5e}
CHIPS=${CHIPS:-8}
COUNT=${COUNT:-1}
NAME_PREFIX=${NAME_PREFIX:-renderfarm}
ZONE=${ZONE:?set ZONE to a zone that has $GENERATION TPUs}
MODEL=${MODEL:?set MODEL to the model reference the workers serve}
OUT=${OUT:?set OUT to gs://BUCKET/PREFIX}
PACKAGE=${PACKAGE:?set PACKAGE to a pip requirement or gs:// wheel of renderfarm}

case $GENERATION in
  v5e) accelerator="v5litepod-$CHIPS"; runtime=v2-alpha-tpuv5-lite ;;
  v6e) accelerator="v6e-$CHIPS"; runtime=v2-alpha-tpuv6e ;;
  *) die "GENERATION must be v5e or v6e, not '$GENERATION'" ;;
esac
case $CHIPS in
  1 | 4 | 8) ;;
  *) die "CHIPS must be 1, 4 or 8 (single-host slices), not '$CHIPS'" ;;
esac
[[ $COUNT =~ ^[1-9][0-9]*$ ]] || die "COUNT must be a positive integer, not '$COUNT'"

if [[ -n ${BROKER_SECRET:-} ]]; then
  broker="renderfarm-broker-secret=$BROKER_SECRET"
elif [[ -n ${BROKER_URL:-} ]]; then
  broker="renderfarm-broker-url=$BROKER_URL"
else
  die "set BROKER_SECRET (a Secret Manager secret holding the broker URL) or BROKER_URL"
fi

# '^|^' makes '|' the separator between metadata entries (values hold ':', ',' and '@').
metadata="^|^renderfarm-package=$PACKAGE|renderfarm-model=$MODEL|renderfarm-out=$OUT|$broker"
metadata+="|renderfarm-per-device-batch=${PER_DEVICE_BATCH:-1}|renderfarm-max-wait=${MAX_WAIT:-2}"
metadata+="|renderfarm-visibility-timeout=${VISIBILITY_TIMEOUT:-3600}"
[[ -n ${CONSTRAINTS:-} ]] && metadata+="|renderfarm-constraints=$CONSTRAINTS"
[[ -n ${WORKER_ARGS:-} ]] && metadata+="|renderfarm-worker-args=$WORKER_ARGS"
[[ $metadata == *$'\n'* ]] && die "settings must not contain newlines"

flags=(--zone="$ZONE" --accelerator-type="$accelerator" --version="$runtime"
  --metadata="$metadata"
  --metadata-from-file="startup-script=$here/startup.sh,renderfarm-worker-unit=$here/renderfarm-worker.service"
  --scopes=https://www.googleapis.com/auth/cloud-platform
  --labels="app=renderfarm,generation=$GENERATION")
[[ -n ${PROJECT:-} ]] && flags+=(--project="$PROJECT")
[[ -n ${SERVICE_ACCOUNT:-} ]] && flags+=(--service-account="$SERVICE_ACCOUNT")
[[ ${SPOT:-0} == 1 ]] && flags+=(--spot)
[[ ${INTERNAL_IPS:-0} == 1 ]] && flags+=(--internal-ips)

for i in $(seq 1 "$COUNT"); do
  cmd=(gcloud compute tpus tpu-vm create "$NAME_PREFIX-$GENERATION-$i" "${flags[@]}")
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
  else
    "${cmd[@]}"
  fi
done
