#!/usr/bin/env bash
# Entrypoint of the aenv image: prepare AENV_HOME, find peers, then exec `aenv serve`.
#
# - The envd bundle and the default templates are built into AENV_HOME when
#   missing (as `make serve` does; a second start finds them and builds
#   nothing). AENV_TEMPLATES=busybox skips the Debian `base` template, which
#   debootstrap downloads (minutes, needs Debian's archive); none skips both.
#   With AENV_STORE_URL set, a template another node shared in that store is
#   fetched from it instead (seconds), and only one the store lacks is built.
# - AENV_PEERS_DNS=name:port (a Kubernetes headless Service) is resolved to
#   every address behind it, this node's own left out, and they become
#   AENV_CLUSTER_PEERS (with the scheme of AENV_ADVERTISE_URL). It waits up
#   to AENV_PEERS_WAIT seconds (30) for another address to appear, so nodes
#   started together find each other; alone after that, it starts a cluster.
# Arguments are passed to `aenv serve`.
set -euo pipefail

VENV=${AENV_VENV:-/opt/aenv/venv}
: "${AENV_HOME:=/var/lib/aenv}"
export AENV_HOME

if [ -n "${AENV_PEERS_DNS:-}" ]; then
  name=${AENV_PEERS_DNS%:*}
  port=${AENV_PEERS_DNS##*:}
  advertise=${AENV_ADVERTISE_URL:-http://}
  scheme=${advertise%%://*}
  self=${advertise#*://}
  self=${self%%/*}
  self=${self%:*}
  deadline=$((SECONDS + ${AENV_PEERS_WAIT:-30}))
  peers=""
  while :; do
    peers=$(getent ahostsv4 "$name" | awk '{ print $1 }' | sort -u | grep -vxF "$self" || true)
    if [ -n "$peers" ] || [ "$SECONDS" -ge "$deadline" ]; then break; fi
    sleep 1
  done
  urls=""
  for ip in $peers; do urls="${urls:+$urls,}$scheme://$ip:$port"; done
  if [ -n "${AENV_CLUSTER_PEERS:-}" ]; then urls="${AENV_CLUSTER_PEERS}${urls:+,$urls}"; fi
  export AENV_CLUSTER_PEERS=$urls
  echo "aenv-entrypoint: peers from $AENV_PEERS_DNS: ${urls:-none (a new cluster)}" >&2
fi

case "${AENV_TEMPLATES:-all}" in
  all) templates=(--home "$AENV_HOME") ;;
  busybox) templates=(--home "$AENV_HOME" --busybox-only) ;;
  none) templates=() ;;
  *) echo "aenv-entrypoint: AENV_TEMPLATES must be all, busybox or none" >&2; exit 2 ;;
esac
"$VENV/bin/python" -m aenv.storage.bundle "$AENV_HOME/bundle"
if [ ${#templates[@]} -gt 0 ]; then
  if [ -n "${AENV_STORE_URL:-}" ]; then templates+=(--from-store "$AENV_STORE_URL"); fi
  "$VENV/bin/python" -m aenv.storage.rootfs "${templates[@]}"
fi
exec "$VENV/bin/aenv" serve --json-logs "$@"
