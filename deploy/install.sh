#!/usr/bin/env bash
# Set a Debian 12 machine up as an aenv node, or upgrade one in place.
#
#   sudo deploy/install.sh                         # a single node on 127.0.0.1:8000
#   sudo deploy/install.sh --new-cluster --listen 0.0.0.0:8000 \
#        --advertise-url http://10.0.0.1:8000 --store-url s3://bucket/aenv
#   sudo deploy/install.sh --listen 0.0.0.0:8000 --advertise-url http://10.0.0.2:8000 \
#        --peers http://10.0.0.1:8000 --store-url s3://bucket/aenv \
#        --cluster-secret-file /root/aenv-secret --api-key-file /root/aenv-key
#
# What it does, each step idempotent:
#   1. Debian packages a node needs (scripts/install-deps --node; runsc from
#      trixie, pinned so nothing else comes from it).
#   2. A new virtualenv under PREFIX/releases/ with the project from SOURCE,
#      then PREFIX/venv switched to it in one rename (the running node keeps
#      the files it was started from; two older releases are kept).
#   3. The envd bundle in AENV_HOME, as `make serve` builds it (skipped when
#      present and unchanged).
#   4. /etc/aenv/aenv.env (root only, 0600): created with a new API key, or
#      updated with the settings given as flags. An existing API key is never
#      replaced. Then the default templates in AENV_HOME, if missing: with
#      AENV_STORE_URL set, the builds other nodes shared there are fetched
#      (with the store credentials of the env file), else built as `make
#      serve` builds them.
#   5. The systemd unit, then `systemctl enable --now` the first time, or
#      `systemctl restart` on an upgrade: the node stops accepting, drains,
#      writes paused sandboxes to disk and exits; with AENV_ON_STOP=keep (the
#      default) and KillMode=process its running sandboxes run on and the new
#      process takes them back. The script refuses to restart a node set to
#      AENV_ON_STOP=stop unless given --allow-stop.
# No system user: the node needs root (network namespaces, nftables, mounts,
# runsc), and the unit runs it as root.
#
# --root DIR writes every file under DIR instead of / and prints, instead of
# running, the commands that change the system (apt, pip, building, systemctl):
# a dry run to read or to test.
set -euo pipefail

SOURCE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=/opt/aenv
AENV_HOME_DIR=/var/lib/aenv
ROOT=""
TEMPLATES=1
ALLOW_STOP=0
NEW_CLUSTER=0
API_KEY=""
SECRET=""
declare -A SET=()   # settings to write into the env file

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed 's/^# \{0,1\}//; /^set -euo/d'
  cat <<'EOF'
Options:
  --source DIR              the aenv checkout to install (default: this script's)
  --prefix DIR              where the virtualenvs go (default /opt/aenv)
  --home DIR                AENV_HOME (default /var/lib/aenv)
  --listen HOST:PORT        AENV_LISTEN (a new env file: 127.0.0.1:8000)
  --node-id ID              AENV_NODE_ID (default: the host name)
  --advertise-url URL       AENV_ADVERTISE_URL, how other nodes reach this one
  --peers URL[,URL...]      AENV_CLUSTER_PEERS, nodes already in the cluster
  --store-url URL           AENV_STORE_URL, the store every node shares (s3://...)
  --cluster-secret-file F   AENV_CLUSTER_SECRET read from F
  --new-cluster             generate a cluster secret (printed at the end)
  --api-key-file F          the cluster's API key read from F (the same on every node)
  --domain DOMAIN           AENV_DOMAIN, for {port}-{id}.DOMAIN host routing
  --tls-cert F --tls-key F  AENV_TLS_CERT, AENV_TLS_KEY (PEM; both)
  --tls-ca F                AENV_TLS_CA, the CA bundle peers' certificates chain to
  --set NAME=VALUE          any other AENV_* setting
  --no-templates            do not install the default templates (fetched from the
                            store, else built with debootstrap); the node fetches
                            them at start if the store has them
  --allow-stop              restart even if AENV_ON_STOP=stop (stops the sandboxes)
  --root DIR                write under DIR, print system-changing commands
EOF
}

die() { echo "install.sh: $*" >&2; exit 1; }
need_value() { if [ $# -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value"; fi; }
read_file() { [ -r "$1" ] || die "cannot read $1"; tr -d '\n' <"$1"; }

while [ $# -gt 0 ]; do
  case "$1" in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac  # --opt=value
  case "$1" in
    --source) need_value "$@"; SOURCE=$2; shift 2 ;;
    --prefix) need_value "$@"; PREFIX=$2; shift 2 ;;
    --home) need_value "$@"; AENV_HOME_DIR=$2; shift 2 ;;
    --listen) need_value "$@"; SET[AENV_LISTEN]=$2; shift 2 ;;
    --node-id) need_value "$@"; SET[AENV_NODE_ID]=$2; shift 2 ;;
    --advertise-url) need_value "$@"; SET[AENV_ADVERTISE_URL]=$2; shift 2 ;;
    --peers) need_value "$@"; SET[AENV_CLUSTER_PEERS]=$2; shift 2 ;;
    --store-url) need_value "$@"; SET[AENV_STORE_URL]=$2; shift 2 ;;
    --cluster-secret-file) need_value "$@"; SECRET=$(read_file "$2"); shift 2 ;;
    --new-cluster) NEW_CLUSTER=1; shift ;;
    --api-key-file) need_value "$@"; API_KEY=$(read_file "$2"); shift 2 ;;
    --domain) need_value "$@"; SET[AENV_DOMAIN]=$2; shift 2 ;;
    --tls-cert) need_value "$@"; SET[AENV_TLS_CERT]=$2; shift 2 ;;
    --tls-key) need_value "$@"; SET[AENV_TLS_KEY]=$2; shift 2 ;;
    --tls-ca) need_value "$@"; SET[AENV_TLS_CA]=$2; shift 2 ;;
    --set)
      need_value "$@"
      [[ $2 =~ ^AENV_[A-Z0-9_]+=.*$ ]] || die "--set wants AENV_NAME=VALUE, not $2"
      SET[${2%%=*}]=${2#*=}; shift 2 ;;
    --no-templates) TEMPLATES=0; shift ;;
    --allow-stop) ALLOW_STOP=1; shift ;;
    --root) need_value "$@"; ROOT=$(realpath -m "$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
done

ETC=$ROOT/etc/aenv
ENV_FILE=$ETC/aenv.env
UNIT=$ROOT/etc/systemd/system/aenv.service
VENVS=$ROOT$PREFIX

# Commands that change the system: run them, or print them under --root.
run() {
  if [ -n "$ROOT" ]; then
    echo "would run: $*"
  else
    echo "==> $*"
    "$@"
  fi
}

if [ ! -f "$SOURCE/pyproject.toml" ] || [ ! -f "$SOURCE/deploy/systemd/aenv.service" ]; then
  die "$SOURCE is not an aenv checkout (use --source)"
fi
if [ -z "$ROOT" ]; then
  [ "$(id -u)" = 0 ] || die "run as root (or with --root DIR for a dry run)"
  if ! grep -qs '^VERSION_CODENAME=bookworm' /etc/os-release; then
    echo "install.sh: this is not Debian 12 (bookworm); carrying on, but only bookworm is tested" >&2
  fi
fi
if [ $NEW_CLUSTER = 1 ]; then
  [ -z "$SECRET" ] || die "--new-cluster and --cluster-secret-file exclude each other"
  [ -z "${SET[AENV_CLUSTER_PEERS]:-}" ] || die "--new-cluster starts a cluster: no --peers"
  SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
fi
if [ -n "${SET[AENV_TLS_CERT]:-}${SET[AENV_TLS_KEY]:-}" ] \
   && { [ -z "${SET[AENV_TLS_CERT]:-}" ] || [ -z "${SET[AENV_TLS_KEY]:-}" ]; }; then
  die "--tls-cert and --tls-key go together"
fi
[ -z "$SECRET" ] || SET[AENV_CLUSTER_SECRET]=$SECRET

# -- 1. packages ------------------------------------------------------------------
run "$SOURCE/scripts/install-deps" --node

# -- 2. the virtualenv --------------------------------------------------------------
release=$(date -u +%Y%m%dT%H%M%SZ)
if rev=$(git -C "$SOURCE" rev-parse --short HEAD 2>/dev/null); then release="$release-$rev"; fi
mkdir -p "$VENVS/releases"
run python3 -m venv "$PREFIX/releases/$release"
run "$PREFIX/releases/$release/bin/pip" install --quiet --disable-pip-version-check "$SOURCE"
# switch in one rename: a half-installed release is never the one that runs
run ln -sfn "releases/$release" "$PREFIX/venv.new"
run mv -T "$PREFIX/venv.new" "$PREFIX/venv"
if [ -z "$ROOT" ]; then
  current=$(readlink "$PREFIX/venv")
  # keep the new release and the two before it
  find "$PREFIX/releases" -mindepth 1 -maxdepth 1 -type d | sort | head -n -3 | while read -r old; do
    [ "releases/$(basename "$old")" = "$current" ] || rm -rf -- "$old"
  done
fi

# -- 3. node artefacts ----------------------------------------------------------------
run "$PREFIX/venv/bin/python" -m aenv.storage.bundle "$AENV_HOME_DIR/bundle"

# -- 4. the settings -------------------------------------------------------------------
mkdir -p "$ETC" "$ROOT$AENV_HOME_DIR"
chmod 0700 "$ETC"

get_setting() { sed -n "s/^$1=//p" "$ENV_FILE" 2>/dev/null | tail -n 1; }
put_setting() {  # replace NAME=... or append it; values are written verbatim
  local name=$1 value=$2 tmp
  case "$value" in *$'\n'*) die "$name: a value cannot hold a newline" ;; esac
  tmp=$(mktemp "$ETC/.aenv.env.XXXXXX")
  if grep -q "^$name=" "$ENV_FILE"; then
    awk -v n="$name" -v v="$value" 'index($0, n "=") == 1 { print n "=" v; next } { print }' \
      "$ENV_FILE" >"$tmp"
  else
    cat "$ENV_FILE" >"$tmp"
    printf '%s=%s\n' "$name" "$value" >>"$tmp"
  fi
  chmod 0600 "$tmp"
  mv -f "$tmp" "$ENV_FILE"
}

created_key=""
if [ ! -f "$ENV_FILE" ]; then
  umask 077
  cat >"$ENV_FILE" <<EOF
# aenv node settings, read by aenv.service (systemd EnvironmentFile syntax:
# NAME=value, no quotes needed). Every setting: docs/configuration.md and
# docs/cluster.md; commented examples: deploy/systemd/aenv.env.example.
# Written by deploy/install.sh; it updates settings given as flags and never
# replaces AENV_API_KEY.
AENV_LISTEN=127.0.0.1:8000
EOF
  umask 022
fi
chmod 0600 "$ENV_FILE"
existing_key=$(get_setting AENV_API_KEY)
if [ -z "$existing_key" ] && [ -s "$ROOT$AENV_HOME_DIR/secrets/api-key" ]; then
  # a node that ran before generated its key there: keep using that one
  existing_key=$(tr -d '\n' <"$ROOT$AENV_HOME_DIR/secrets/api-key")
  put_setting AENV_API_KEY "$existing_key"
fi
if [ -n "$existing_key" ]; then
  if [ -n "$API_KEY" ] && [ "$API_KEY" != "$existing_key" ]; then
    die "$ENV_FILE already has another AENV_API_KEY; an existing key is never replaced (edit the file to change it)"
  fi
else
  if [ -z "$API_KEY" ]; then
    API_KEY="aenv_$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    created_key=$API_KEY
  fi
  put_setting AENV_API_KEY "$API_KEY"
fi
for name in "${!SET[@]}"; do
  put_setting "$name" "${SET[$name]}"
done
if [ -n "$(get_setting AENV_CLUSTER_SECRET)" ] && [ -z "$(get_setting AENV_STORE_URL)" ]; then
  die "a cluster needs a store every node shares: pass --store-url (s3://..., gs://..., az://..., file:///shared/dir)"
fi

# -- 4b. the default templates: from the store when it has them, else built -------------
if [ $TEMPLATES = 1 ]; then
  store_url=$(get_setting AENV_STORE_URL)
  from_store=()
  [ -z "$store_url" ] || from_store=(--from-store "$store_url")
  (
    # the store's credentials, as the node reads them from the env file (exported,
    # never on a command line: `run` prints its arguments)
    while IFS= read -r line; do
      case "$line" in AWS_*=*|GOOGLE_*=*|AZURE_*=*) export "${line?}" ;; esac
    done <"$ENV_FILE"
    run "$PREFIX/venv/bin/python" -m aenv.storage.rootfs --home "$AENV_HOME_DIR" "${from_store[@]}"
  )
fi

# -- 5. the unit, and (re)start ----------------------------------------------------------
mkdir -p "$(dirname "$UNIT")"
new_unit=$(sed -e "s|/opt/aenv/venv/|$PREFIX/venv/|g" \
               -e "s|^Environment=AENV_HOME=.*|Environment=AENV_HOME=$AENV_HOME_DIR|" \
               "$SOURCE/deploy/systemd/aenv.service")
upgrade=0
[ -f "$UNIT" ] && upgrade=1
if [ "$upgrade" = 0 ] || [ "$new_unit" != "$(cat "$UNIT")" ]; then
  printf '%s\n' "$new_unit" >"$UNIT"
  run systemctl daemon-reload
fi
if [ -z "$ROOT" ] && ! systemctl is-active --quiet aenv; then
  upgrade=0  # installed but not running: nothing to keep
fi
if [ "$upgrade" = 1 ]; then
  if [ "$(get_setting AENV_ON_STOP)" = stop ] && [ $ALLOW_STOP = 0 ]; then
    die "$ENV_FILE sets AENV_ON_STOP=stop: a restart would stop every sandbox. Remove it (keep is the default) or pass --allow-stop"
  fi
  # stop (SIGTERM to the node process only) then start: sandboxes run on
  run systemctl restart aenv
else
  run systemctl enable --now aenv
fi

listen=$(get_setting AENV_LISTEN)
scheme=http
[ -z "$(get_setting AENV_TLS_CERT)" ] || scheme=https
if [ -z "$ROOT" ]; then
  for _ in $(seq 60); do
    systemctl is-active --quiet aenv && break
    sleep 1
  done
  systemctl is-active --quiet aenv || die "aenv did not start; see journalctl -u aenv"
fi
echo
echo "aenv node installed: $scheme://${listen:-127.0.0.1:8000} (release $release)"
echo "  settings: $ENV_FILE    state: $AENV_HOME_DIR    logs: journalctl -u aenv"
if [ -n "$created_key" ]; then
  echo "  API key (new; also in $ENV_FILE): $created_key"
else
  echo "  API key: unchanged (AENV_API_KEY in $ENV_FILE)"
fi
if [ $NEW_CLUSTER = 1 ]; then
  echo "  cluster secret (new; give it to every node with --cluster-secret-file): $SECRET"
fi
