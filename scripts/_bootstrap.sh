# Sourced by scripts/up and scripts/test: make the machine ready, idempotently.
#  - redis-server (Debian package) when missing and we may use apt-get;
#  - for scripts/test, prometheus too (Debian package, without the node exporter it
#    recommends; its service is stopped and disabled);
#  - .venv with torch==2.13.0 first (the local CPU build: never the CUDA one), then
#    redbatch and its dev tools, reinstalled only when pyproject.toml changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REDBATCH_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_SPEC="torch==2.13.0"

log() { printf '[redbatch] %s\n' "$*" >&2; }

ensure_redis() {
  command -v redis-server >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing redis-server (apt-get)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    log "redis-server not found and apt-get unavailable: tests need it; 'up' falls back to fakeredis"
  fi
}

ensure_prometheus() {  # for tests/test_prometheus.py (skipped without it)
  command -v prometheus >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing prometheus (apt-get)"
    if ! { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; then
      log "could not install prometheus: tests/test_prometheus.py is skipped"
      return 0
    fi
    # The package enables a service on :9090; the test runs its own on a free port.
    systemctl disable --now prometheus >/dev/null 2>&1 \
      || service prometheus stop >/dev/null 2>&1 || true
  else
    log "prometheus not found and apt-get unavailable: tests/test_prometheus.py is skipped"
  fi
}

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PY" -m venv "$VENV"
  fi
  local pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
    log "installing $TORCH_SPEC (CPU build)"
    "${pip[@]}" install "$TORCH_SPEC"
  fi
  local stamp="$VENV/.redbatch-deps" want
  want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    log "installing redbatch and its dependencies into $VENV"
    "${pip[@]}" install -e "$ROOT[all,dev]"
    echo "$want" > "$stamp"
  fi
}

bootstrap() {
  ensure_redis
  ensure_venv
  export PATH="$VENV/bin:$PATH"
}
