#!/usr/bin/env bash
# TPU VM start-up script: installs renderfarm and starts ONE worker on this host under systemd.
# Passed by infra/tpu/create-tpu-vms.sh as the `startup-script` metadata; runs as root at
# every boot, so every step is idempotent. Output: journalctl -u google-startup-scripts
#
# Instance metadata it reads (gcloud ... --metadata KEY=VALUE):
#   renderfarm-package       required: what to pip-install, with the tpu extra, e.g.
#                              "renderfarm[tpu] @ git+https://github.com/ORG/renderfarm@v0.1.0"
#                              or a wheel: gs://BUCKET/wheels/renderfarm-0.1.0-py3-none-any.whl
#                              (the script installs it with [tpu])
#   renderfarm-constraints   optional: gs:// or https URL of requirements.lock (pip -c)
#   renderfarm-model         required: model reference the worker serves (hub id[@rev], gs://...)
#   renderfarm-out           required: where images go, gs://BUCKET/PREFIX
#   renderfarm-broker-secret Secret Manager secret holding the broker URL (recommended: it
#                              carries the Redis password), or
#   renderfarm-broker-url    the broker URL itself (readable by anyone who can read metadata)
#   renderfarm-per-device-batch, renderfarm-max-wait, renderfarm-visibility-timeout,
#   renderfarm-worker-args   optional worker settings (defaults below)
#   renderfarm-worker-unit   required: the systemd unit (infra/tpu/renderfarm-worker.service)
#   renderfarm-preemption-watch, renderfarm-preemption-unit
#                            optional (create-tpu-vms.sh passes both): the spot preemption
#                              watcher (infra/tpu/preemption-watch.sh) and its unit
set -euo pipefail

readonly METADATA=http://metadata.google.internal/computeMetadata/v1/instance/attributes
readonly PREFIX=/opt/renderfarm
readonly VENV=$PREFIX/venv
readonly CACHE=/var/cache/renderfarm
readonly ENV_FILE=/etc/renderfarm/worker.env
readonly UNIT=/etc/systemd/system/renderfarm-worker.service
readonly PYTHON_VERSION=3.12  # requirements.lock's (renderfarm-constraints)

log() { echo "renderfarm startup: $*" >&2; }

# meta KEY [DEFAULT]: an instance metadata attribute; without DEFAULT a missing one is fatal.
meta() {
  local value
  if value=$(curl -fsS --retry 5 -H 'Metadata-Flavor: Google' "$METADATA/$1" 2>/dev/null); then
    printf '%s' "$value"
  elif [[ $# -ge 2 ]]; then
    printf '%s' "$2"
  else
    log "instance metadata attribute '$1' is required"
    return 1
  fi
}

# fetch URL DEST: gs:// through gcloud, anything else through curl.
fetch() {
  if [[ $1 == gs://* ]]; then
    gcloud storage cp --quiet "$1" "$2"
  else
    curl -fsSL --retry 5 -o "$2" "$1"
  fi
}

# env_line NAME VALUE: a systemd EnvironmentFile line, value double-quoted and escaped.
env_line() {
  local value=$2
  if [[ $value == *$'\n'* ]]; then
    log "$1 must be one line"
    return 1
  fi
  value=${value//\\/\\\\}
  value=${value//\"/\\\"}
  printf '%s="%s"\n' "$1" "$value"
}

package=$(meta renderfarm-package)
constraints=$(meta renderfarm-constraints "")
model=$(meta renderfarm-model)
out=$(meta renderfarm-out)
unit=$(meta renderfarm-worker-unit)
watch=$(meta renderfarm-preemption-watch "")
watch_unit=$(meta renderfarm-preemption-unit "")
broker_secret=$(meta renderfarm-broker-secret "")
if [[ -n $broker_secret ]]; then
  broker_url=$(gcloud secrets versions access latest --secret="$broker_secret")
else
  broker_url=$(meta renderfarm-broker-url)
fi

# 1. A system user owns the worker and nothing else.
if ! id renderfarm >/dev/null 2>&1; then
  useradd --system --home-dir /var/lib/renderfarm --create-home --shell /usr/sbin/nologin renderfarm
fi

# 2. Private caches: JAX's persistent compilation cache is code the worker will load and
#    run, so it must be writable by the worker alone (mode 700), as must the model cache.
install -d -o root -g root -m 755 "$PREFIX" /etc/renderfarm
install -d -o renderfarm -g renderfarm -m 700 "$CACHE" "$CACHE/jax" "$CACHE/models" "$CACHE/hf"
chown renderfarm:renderfarm "$CACHE" "$CACHE/jax" "$CACHE/models" "$CACHE/hf"
chmod 700 "$CACHE" "$CACHE/jax" "$CACHE/models" "$CACHE/hf"

# 3. Python 3.12 and the package, in a venv owned by root. The TPU VM images ship an older
#    Python; uv installs a standalone 3.12 under $PREFIX (readable by the worker user).
if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install --quiet "uv>=0.5"
fi
export UV_PYTHON_INSTALL_DIR=$PREFIX/python UV_CACHE_DIR=$PREFIX/uv-cache
wanted="$package|$constraints"
if [[ ! -x $VENV/bin/renderfarm || $(cat "$PREFIX/installed" 2>/dev/null || true) != "$wanted" ]]; then
  log "installing $package"
  rm -rf "$VENV"
  uv venv --python "$PYTHON_VERSION" "$VENV"
  spec=$package
  if [[ $package == gs://* ]]; then
    install -d -m 755 "$PREFIX/wheels"
    wheel="$PREFIX/wheels/$(basename "$package")"
    fetch "$package" "$wheel"
    spec="$wheel[tpu]"
  fi
  args=()
  if [[ -n $constraints ]]; then
    fetch "$constraints" "$PREFIX/constraints.txt"
    args=(--constraint "$PREFIX/constraints.txt")
  fi
  uv pip install --python "$VENV/bin/python" "${args[@]}" "$spec"
  printf '%s' "$wanted" >"$PREFIX/installed"
fi

# 4. The worker's environment: root-only (the broker URL is a secret), read by systemd.
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
{
  env_line RENDERFARM_BROKER_URL "$broker_url"
  env_line RENDERFARM_MODEL "$model"
  env_line RENDERFARM_OUT "$out"
  env_line RENDERFARM_PER_DEVICE_BATCH "$(meta renderfarm-per-device-batch 1)"
  env_line RENDERFARM_MAX_WAIT "$(meta renderfarm-max-wait 2)"
  env_line RENDERFARM_VISIBILITY_TIMEOUT "$(meta renderfarm-visibility-timeout 300)"
  env_line RENDERFARM_WORKER_ARGS "$(meta renderfarm-worker-args "")"
  env_line RENDERFARM_COMPILE_CACHE "$CACHE/jax"
  env_line RENDERFARM_MODEL_CACHE "$CACHE/models"
  env_line HF_HOME "$CACHE/hf"
  env_line HOME /var/lib/renderfarm
} >"$tmp"
install -o root -g root -m 600 "$tmp" "$ENV_FILE"

# 5. The unit, then (re)start: a boot starts it, a re-run picks up new settings.
printf '%s\n' "$unit" >"$tmp"
install -o root -g root -m 644 "$tmp" "$UNIT"
systemctl daemon-reload
systemctl enable renderfarm-worker.service
systemctl restart renderfarm-worker.service
log "worker started: journalctl -u renderfarm-worker -f"

# 6. On a spot VM, drain the worker on the preemption notice (instance/preempted), not only
#    on the ACPI shutdown that follows it.
if [[ -n $watch && -n $watch_unit ]]; then
  printf '%s\n' "$watch" >"$tmp"
  install -o root -g root -m 755 "$tmp" "$PREFIX/preemption-watch.sh"
  printf '%s\n' "$watch_unit" >"$tmp"
  install -o root -g root -m 644 "$tmp" /etc/systemd/system/renderfarm-preemption.service
  systemctl daemon-reload
  systemctl enable renderfarm-preemption.service
  systemctl restart renderfarm-preemption.service
  log "preemption watcher started: journalctl -u renderfarm-preemption -f"
fi
