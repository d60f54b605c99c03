#!/usr/bin/env bash
# Build the CPU images of docker/Dockerfile (tools, drafter, verifier, router, gateway) with podman,
# or docker where podman is missing: `make images`.
#
# Where the Dockerfile's default base image (PYTHON_IMAGE) cannot be pulled (no registry reachable),
# a local base is made once: Debian bookworm by debootstrap (minbase + python3, python3-venv,
# ca-certificates: Python 3.11), imported as $LOCAL_BASE and reused by later builds.
#
# The build's pip reaches the same package index as this machine's pip: the index settings of
# `pip config list` (index-url, extra-index-url, find-links, trusted-host, cert, timeout) are written to a
# pip.conf passed in as a build secret (never a layer), and local directories they name are mounted
# read-only during the build only, under /run/pip-local/N. torch comes from wherever this pip
# resolves torch==$TORCH_VERSION to a CPU build (`+cpu`); if it resolves to another build, the
# Dockerfile's CPU wheel index is used.
#
# Settings (environment): ENGINE (podman|docker), TAG (0.1.0), TARGETS, PYTHON_IMAGE, LOCAL_BASE,
# SUITE, DEBIAN_MIRROR, PIP (the pip whose configuration is passed in), ENGINE_FLAGS (extra flags).
# `deploy/images.sh redis` builds only the local Redis image the compose check uses when the
# compose file's Redis image cannot be pulled; `deploy/images.sh cuda` the CUDA verifier image.
set -euo pipefail

cd "$(dirname "$0")/.."
TAG=${TAG:-0.1.0}
TARGETS=${TARGETS:-tools drafter verifier router gateway}
DEFAULT_BASE=$(sed -n 's/^ARG PYTHON_IMAGE=//p' docker/Dockerfile)
PYTHON_IMAGE=${PYTHON_IMAGE:-$DEFAULT_BASE}
LOCAL_BASE=${LOCAL_BASE:-localhost/cosine-base:bookworm-py311}
LOCAL_REDIS=${LOCAL_REDIS:-localhost/cosine-redis:bookworm}
SUITE=${SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_VERSION=$(sed -n 's/^torch==//p' constraints.txt)
PIP=${PIP:-}
if [ -z "$PIP" ]; then
  if [ -x .venv/bin/pip ]; then PIP=.venv/bin/pip; else PIP="python3 -m pip"; fi
fi

log() { echo "images: $*" >&2; }

# ---- the engine, and the flags this host needs (a runtime it can run, rlimits under its own)
if [ -z "${ENGINE:-}" ]; then
  if command -v podman >/dev/null 2>&1; then ENGINE=podman
  elif command -v docker >/dev/null 2>&1; then ENGINE=docker
  else log "neither podman nor docker found (Debian: apt-get install podman runc)"; exit 1; fi
fi
engine_flags() {
  # podman's default runtime (crun) may refuse a host's cgroup layout; runc then is tried. The
  # containers' rlimits must not exceed this process's hard limits (raising them is refused).
  local flags=()
  if [ "$ENGINE" = podman ]; then
    local nofile nproc
    nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
    [ "$nofile" = unlimited ] || flags+=(--ulimit "nofile=$((nofile < 4096 ? nofile : 4096)):$((nofile < 4096 ? nofile : 4096))")
    [ "$nproc" = unlimited ] || flags+=(--ulimit "nproc=$((nproc < 4096 ? nproc : 4096)):$((nproc < 4096 ? nproc : 4096))")
    if [ -n "${PODMAN_RUNTIME:-}" ]; then flags=(--runtime "$PODMAN_RUNTIME" "${flags[@]}")
    elif command -v runc >/dev/null 2>&1 && ! podman info --format '{{.Host.OCIRuntime.Name}}' 2>/dev/null | grep -qx runc \
      && [ -n "${PROBE_IMAGE:-}" ] && ! podman run --rm "${flags[@]}" "$PROBE_IMAGE" true >/dev/null 2>&1; then
      flags=(--runtime runc "${flags[@]}")
    fi
  fi
  # shellcheck disable=SC2206
  flags+=(${ENGINE_FLAGS:-})
  printf '%s\n' "${flags[@]}"
}

image_exists() {
  if [ "$ENGINE" = podman ]; then podman image exists "$1"; else docker image inspect "$1" >/dev/null 2>&1; fi
}

# ---- the base image: the default one if present or pullable, else the local Debian base
ensure_local_base() {
  if image_exists "$LOCAL_BASE"; then log "local base $LOCAL_BASE present"; return; fi
  command -v debootstrap >/dev/null 2>&1 || { log "debootstrap missing (apt-get install debootstrap)"; exit 1; }
  local root
  root=$(mktemp -d)
  log "building the local base $LOCAL_BASE with debootstrap ($SUITE, minbase + python3; a few minutes)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$root" "$DEBIAN_MIRROR" >&2
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | $ENGINE import --change 'CMD ["python3"]' - "$LOCAL_BASE" >/dev/null
  rm -rf "$root"
}

choose_base() {
  if image_exists "$PYTHON_IMAGE"; then echo "$PYTHON_IMAGE"; return; fi
  if [ "$PYTHON_IMAGE" != "$LOCAL_BASE" ] && timeout 60 $ENGINE pull -q "$PYTHON_IMAGE" >/dev/null 2>&1; then
    echo "$PYTHON_IMAGE"; return
  fi
  log "$PYTHON_IMAGE cannot be pulled; using the local base $LOCAL_BASE"
  ensure_local_base
  echo "$LOCAL_BASE"
}

# ---- pip's configuration for the build
PIP_DIR=$(mktemp -d)
trap 'rm -rf "$PIP_DIR"' EXIT
PIP_MOUNTS=()
pip_config() {
  local conf=$PIP_DIR/pip.conf n=0 key value out item
  declare -A seen=()
  echo "[global]" >"$conf"
  # `pip config list` prints  scope.key='value'  (PIP_* variables as :env:.key, which win: read last).
  while IFS= read -r line; do
    key=${line#*.}; key=${key%%=*}; value=${line#*=}; value=${value#\'}; value=${value%\'}
    case "$key" in index-url | extra-index-url | find-links | trusted-host | timeout | retries | cert) ;; default-timeout) key=timeout ;; *) continue ;; esac
    out=()
    for item in $value; do
      local path=${item#file://} mount sub=""
      if [ "${path#/}" != "$path" ] && [ -e "$path" ]; then
        path=${path%/}; mount=$path
        # A file (cert) is copied into a directory of its own: the build mounts directories only.
        if [ -f "$path" ]; then
          mount=$PIP_DIR/file-$n; mkdir -p "$mount"; cp "$path" "$mount/"; sub=/$(basename "$path")
        fi
        # A local index (DIR/simple) links to its files relatively (../../files/...): mount DIR.
        case "$key" in *index-url) mount=$(dirname "$path"); sub=/$(basename "$path") ;; esac
        if [ -z "${seen[$mount]:-}" ]; then seen[$mount]=/run/pip-local/$n; n=$((n + 1)); PIP_MOUNTS+=("$mount:${seen[$mount]}"); fi
        if [ "$item" != "${item#file://}" ]; then out+=("file://${seen[$mount]}$sub"); else out+=("${seen[$mount]}$sub"); fi
      else
        out+=("$item")
      fi
    done
    sed -i "/^$key = /d" "$conf"
    echo "$key = ${out[*]}" >>"$conf"
  done < <($PIP config list 2>/dev/null | sort -s -t. -k1,1 | { grep -v '^:env:' || true; }; $PIP config list 2>/dev/null | { grep '^:env:' || true; })
}

# Where this machine's pip finds torch==$TORCH_VERSION: a CPU build (+cpu) means the build can use
# the same configuration; anything else (PyPI's CUDA build) means the CPU wheel index.
torch_from_pip_config() {
  local report=$PIP_DIR/torch.json
  timeout 300 $PIP install --quiet --dry-run --ignore-installed --no-deps --report "$report" "torch==$TORCH_VERSION" >/dev/null 2>&1 || return 1
  grep -q '"version": *"[^"]*+cpu"' "$report"
}

build_targets() {
  local base flags build_flags=() mounts=()
  base=$(choose_base)
  mapfile -t flags < <(PROBE_IMAGE=$base engine_flags)
  pip_config
  if [ "$ENGINE" = podman ]; then
    for m in "${PIP_MOUNTS[@]}"; do mounts+=(-v "$m:ro"); done
  elif [ ${#PIP_MOUNTS[@]} -gt 0 ]; then
    log "docker builds cannot mount ${PIP_MOUNTS[*]}; pip's local sources are left out"
    sed -i 's#\(file://\)\?/run/pip-local/[0-9]*##g' "$PIP_DIR/pip.conf"
  fi
  if torch_from_pip_config; then
    log "torch==$TORCH_VERSION: this pip resolves a CPU build; the build uses the same configuration"
    build_flags+=(--build-arg TORCH_INDEX_URL=)
  fi
  log "engine $ENGINE ${flags[*]}; base $base; pip configuration: $(grep -v '^\[' "$PIP_DIR/pip.conf" | tr '\n' ';')"
  # podman writes OCI images by default, which have no HEALTHCHECK: docker's format keeps it.
  [ "$ENGINE" = podman ] && build_flags+=(--format docker)
  for t in $TARGETS; do
    local start=$SECONDS
    log "building cosine-$t:$TAG"
    $ENGINE build "${flags[@]}" "${mounts[@]}" "${build_flags[@]}" \
      --secret "id=pip.conf,src=$PIP_DIR/pip.conf" \
      --build-arg "PYTHON_IMAGE=$base" \
      -f docker/Dockerfile --target "$t" -t "cosine-$t:$TAG" . >&2
    log "cosine-$t:$TAG built ($((SECONDS - start)) s)"
  done
}

# The CUDA verifier (docker/Dockerfile.cuda): its base is NVIDIA's CUDA image, which must be present
# or pullable (no local stand-in: the build needs nvcc and the CUDA libraries); torch comes from the
# PyTorch CUDA index, everything else through the same pip configuration as the CPU images.
build_cuda() {
  local flags mounts=()
  mapfile -t flags < <(engine_flags)
  pip_config
  sed -i '/^find-links = /d' "$PIP_DIR/pip.conf"  # local wheels (a CPU torch) must not compete with the CUDA index
  if [ "$ENGINE" = podman ]; then for m in "${PIP_MOUNTS[@]}"; do mounts+=(-v "$m:ro"); done; fi
  log "building cosine-verifier-cuda:$TAG (docker/Dockerfile.cuda)"
  [ "$ENGINE" = podman ] && flags+=(--format docker)  # OCI images have no HEALTHCHECK
  $ENGINE build "${flags[@]}" "${mounts[@]}" --secret "id=pip.conf,src=$PIP_DIR/pip.conf" \
    -f docker/Dockerfile.cuda --target verifier -t "cosine-verifier-cuda:$TAG" . >&2
}

# A Redis image for the compose check when the compose file's (redis:*-alpine) cannot be pulled:
# Debian's redis-server on the local base, with redis-cli and sh as the compose file expects.
build_redis() {
  local compose_redis base flags
  compose_redis=$(sed -n 's/^ *image: *\([^ ]*redis:[^ ]*\)$/\1/p' docker-compose.yml | head -1)
  if image_exists "$compose_redis" || timeout 60 $ENGINE pull -q "$compose_redis" >/dev/null 2>&1; then
    echo "$compose_redis"; return
  fi
  if ! image_exists "$LOCAL_REDIS"; then
    base=$LOCAL_BASE
    ensure_local_base
    mapfile -t flags < <(PROBE_IMAGE=$base engine_flags)
    log "$compose_redis cannot be pulled; building $LOCAL_REDIS (Debian's redis-server)"
    printf '%s\n' "FROM $base" \
      "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/* && mkdir -p /data" \
      'CMD ["redis-server"]' | $ENGINE build "${flags[@]}" -t "$LOCAL_REDIS" -f - "$PIP_DIR" >&2
  fi
  echo "$LOCAL_REDIS"
}

case "${1:-build}" in
  build) build_targets ;;
  redis) build_redis ;;
  cuda) build_cuda ;;
  base) choose_base ;;
  flags)
    # probe with an image already here (no pull, no debootstrap just for the flags)
    for image in "$LOCAL_BASE" "$PYTHON_IMAGE" "cosine-tools:$TAG"; do
      if image_exists "$image"; then PROBE_IMAGE=$image; break; fi
    done
    PROBE_IMAGE=${PROBE_IMAGE:-} engine_flags ;;
  *) log "usage: $0 [build|cuda|redis|base|flags]"; exit 2 ;;
esac
