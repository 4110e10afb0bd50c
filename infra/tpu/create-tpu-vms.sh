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
#   PROJECT         default: gcloud's configured project (required with DRY_RUN=1)
#   SERVICE_ACCOUNT the workers' own service account, created if missing (default
#                   renderfarm-worker@PROJECT.iam.gserviceaccount.com). It is granted only:
#                   roles/storage.objectUser on OUT's bucket; roles/storage.objectViewer on the
#                   buckets of a gs:// MODEL, PACKAGE or CONSTRAINTS (startup.sh fetches them
#                   as the VM); roles/secretmanager.secretAccessor on BROKER_SECRET alone.
#                   Never the Compute Engine default account (often Editor on the whole project).
#   SPOT=1          spot VMs (cheap, preemptible): on the preemption notice the VM's
#                   preemption watcher drains the worker, whose unfinished jobs go back on the
#                   queue at once (infra/tpu/preemption-watch.sh)
#   INTERNAL_IPS=1  no external IPs (the broker must be reachable privately)
#   DRY_RUN=1       print the gcloud commands instead of running them (the account's creation
#                   included, which a real run skips when the account exists)
#
# Scopes: devstorage.read_write, plus cloud-platform only with BROKER_SECRET, because Secret
# Manager accepts no narrower scope; the account's grants above are then what limit the VMs.
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
dry_run=${DRY_RUN:-0}

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
[[ $OUT == gs://?* ]] || die "OUT must be gs://BUCKET/PREFIX, not '$OUT'"
if [[ -z ${PROJECT:-} ]]; then
  [[ $dry_run == 1 ]] && die "set PROJECT: DRY_RUN=1 does not ask gcloud for its configured project"
  PROJECT=$(gcloud config get-value project 2>/dev/null) || true
  [[ -n $PROJECT ]] || die "set PROJECT: gcloud has no configured project"
fi

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
metadata+="|renderfarm-visibility-timeout=${VISIBILITY_TIMEOUT:-300}"
[[ -n ${CONSTRAINTS:-} ]] && metadata+="|renderfarm-constraints=$CONSTRAINTS"
[[ -n ${WORKER_ARGS:-} ]] && metadata+="|renderfarm-worker-args=$WORKER_ARGS"
[[ $metadata == *$'\n'* ]] && die "settings must not contain newlines"

# run COMMAND...: run it, or with DRY_RUN=1 print it (shell-quoted, one line).
run() {
  if [[ $dry_run == 1 ]]; then
    printf '%q ' "$@"
    echo
  else
    "$@"
  fi
}

# grant COMMAND...: an IAM binding. An account just created can take a minute to be seen by
# IAM, so a refused binding is tried again (5 times, 10 s apart); gcloud's policy dump is dropped.
grant() {
  if [[ $dry_run == 1 ]]; then
    run "$@"
    return
  fi
  local attempt
  for attempt in 1 2 3 4 5; do
    "$@" >/dev/null && return
    [[ $attempt == 5 ]] || sleep 10
  done
  die "could not grant: $*"
}

# bucket_of gs://BUCKET/PATH -> gs://BUCKET
bucket_of() {
  local rest=${1#gs://}
  printf 'gs://%s' "${rest%%/*}"
}

# 1. The workers' own service account: what a VM (its worker and startup.sh) may do is what
#    this account is granted below, and nothing else.
account=${SERVICE_ACCOUNT:-renderfarm-worker@$PROJECT.iam.gserviceaccount.com}
[[ $account == *@*.iam.gserviceaccount.com ]] ||
  die "SERVICE_ACCOUNT must be a user-managed account NAME@PROJECT.iam.gserviceaccount.com, not '$account'"
if [[ $dry_run == 1 ]] || ! gcloud iam service-accounts describe "$account" --project="$PROJECT" >/dev/null 2>&1; then
  run gcloud iam service-accounts create "${account%%@*}" --project="$PROJECT" \
    --display-name="renderfarm TPU workers" --description="renderfarm workers: objects of their buckets only"
fi
member="serviceAccount:$account"

# 2. Its grants, each on one resource (never on the project): objects of the output bucket...
out_bucket=$(bucket_of "$OUT")
grant gcloud storage buckets add-iam-policy-binding "$out_bucket" --member="$member" --role=roles/storage.objectUser
# ...read on each bucket it fetches from (the output bucket's objectUser covers that one)...
granted=" $out_bucket "
for source in "$MODEL" "$PACKAGE" "${CONSTRAINTS:-}"; do
  [[ $source == gs://?* ]] || continue
  bucket=$(bucket_of "$source")
  [[ $granted == *" $bucket "* ]] && continue
  granted+="$bucket "
  grant gcloud storage buckets add-iam-policy-binding "$bucket" --member="$member" --role=roles/storage.objectViewer
done
# ...and the broker URL's secret, when there is one.
scopes=https://www.googleapis.com/auth/devstorage.read_write
if [[ -n ${BROKER_SECRET:-} ]]; then
  grant gcloud secrets add-iam-policy-binding "$BROKER_SECRET" --project="$PROJECT" --member="$member" \
    --role=roles/secretmanager.secretAccessor
  scopes+=,https://www.googleapis.com/auth/cloud-platform
fi

# 3. The VMs, as that account.
flags=(--zone="$ZONE" --project="$PROJECT" --accelerator-type="$accelerator" --version="$runtime"
  --metadata="$metadata"
  --metadata-from-file="startup-script=$here/startup.sh,renderfarm-worker-unit=$here/renderfarm-worker.service,renderfarm-preemption-watch=$here/preemption-watch.sh,renderfarm-preemption-unit=$here/renderfarm-preemption.service"
  --service-account="$account" --scopes="$scopes"
  --labels="app=renderfarm,generation=$GENERATION")
[[ ${SPOT:-0} == 1 ]] && flags+=(--spot)
[[ ${INTERNAL_IPS:-0} == 1 ]] && flags+=(--internal-ips)

for i in $(seq 1 "$COUNT"); do
  run gcloud compute tpus tpu-vm create "$NAME_PREFIX-$GENERATION-$i" "${flags[@]}"
done
