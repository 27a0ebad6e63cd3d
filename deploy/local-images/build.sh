#!/usr/bin/env bash
# Build the local stand-ins for the public base images that the compose stack uses,
# for machines where no container registry can be reached (see docs/deployment.md,
# "Without a Docker engine: podman").
#
#   deploy/local-images/build.sh             # build what is missing or outdated
#   deploy/local-images/build.sh --rebuild   # build all three again
#   deploy/local-images/build.sh --remove    # remove them and every image built on them
#
# An image is built only when its tag is missing or was built by another version of this
# recipe: the label org.tokembed.local-images holds the sha256 of build.sh and the two
# Dockerfiles beside it. So a machine that keeps the images (CI) builds them once per
# recipe, and reuses them by their tags in every later run. Images built FROM them inherit
# the label, which is how --remove finds those too.
#
#   localhost/tokembed-local/debian:bookworm      debootstrap of Debian bookworm from the
#                                                 mirror apt on this machine already uses,
#                                                 plus this machine's local CA certificates
#   localhost/tokembed-local/python:3.11-bookworm stand-in for python:3.11-slim-bookworm
#   localhost/tokembed-local/prometheus:bookworm  stand-in for prom/prometheus (Debian's
#                                                 prometheus package)
#
# Building needs root (debootstrap, chroot) and podman. Honours CONTAINERS_CONF; when it
# is unset, writes and uses the podman settings this machine needs ($WORK/containers.conf).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WORK="${TOKEMBED_WORK:-$ROOT/.work}"
PREFIX="localhost/tokembed-local"
DEBIAN_IMAGE="$PREFIX/debian:bookworm"
PYTHON_IMAGE="$PREFIX/python:3.11-bookworm"
PROMETHEUS_IMAGE="$PREFIX/prometheus:bookworm"
# Debian's local CA directory (update-ca-certificates(8)): public certificates only.
LOCAL_CA_DIR="/usr/local/share/ca-certificates"

rebuild=0
case "${1:-}" in
    "") ;;
    --rebuild) rebuild=1 ;;
    --remove) ;;
    *) echo "usage: $0 [--rebuild | --remove]" >&2; exit 2 ;;
esac
RECIPE="$(cat "$HERE/build.sh" "$HERE/python.Dockerfile" "$HERE/prometheus.Dockerfile" \
    | sha256sum | cut -c1-16)"

mkdir -p "$WORK"
if [ -z "${CONTAINERS_CONF:-}" ]; then
    # runc, and no default ulimits: crun fails on this machine's cgroups and runc fails
    # setting the default rlimits (see the shared CONTAINERS.md).
    printf '[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\n' \
        >"$WORK/containers.conf"
    export CONTAINERS_CONF="$WORK/containers.conf"
fi

log() { printf '[local-images %s] %s\n' "$(date +%T)" "$*" >&2; }
# The image is there and was built by this recipe.
have() {
    [ "$rebuild" = 0 ] && podman image exists "$1" && [ "$(podman image inspect \
        --format '{{index .Labels "org.tokembed.local-images"}}' "$1")" = "$RECIPE" ]
}

if [ "${1:-}" = --remove ]; then
    # The three images and every image built on them (they inherit the label): server
    # images and their build cache. Images a container still uses stay (podman says which).
    mapfile -t ids < <(podman images -aq --filter label=org.tokembed.local-images | sort -u)
    [ ${#ids[@]} -eq 0 ] || podman rmi "${ids[@]}" >/dev/null
    log "removed ${#ids[@]} image(s) built on $PREFIX/*"
    exit 0
fi

# The first Debian mirror apt uses for bookworm main, and its security mirror.
mirror_for() {
    apt-get indextargets --format '$(SITE) $(RELEASE) $(COMPONENT)' 2>/dev/null \
        | awk -v rel="$1" '$2 == rel && $3 == "main" { print $1; exit }'
}

build_debian() {
    local mirror security rootfs
    command -v debootstrap >/dev/null || {
        echo "$0: debootstrap is not installed (apt-get install debootstrap)" >&2
        exit 2
    }
    mirror="$(mirror_for bookworm)"
    mirror="${mirror:-http://deb.debian.org/debian}"
    security="$(mirror_for bookworm-security)"
    rootfs="$WORK/rootfs-bookworm"
    log "debootstrap bookworm from $mirror (takes a few minutes)"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs" "$mirror" \
        >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
    {
        echo "deb $mirror bookworm main"
        echo "deb $mirror bookworm-updates main"
        [ -n "$security" ] && echo "deb $security bookworm-security main"
    } >"$rootfs/etc/apt/sources.list"
    # Like the official slim images: no caches, no docs, no apt recommends.
    printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
        >"$rootfs/etc/apt/apt.conf.d/90-no-recommends"
    shopt -s nullglob
    local certs=("$LOCAL_CA_DIR"/*.crt)
    shopt -u nullglob
    if [ ${#certs[@]} -gt 0 ]; then
        log "adding ${#certs[@]} local CA certificate(s) from $LOCAL_CA_DIR"
        cp "${certs[@]}" "$rootfs/usr/local/share/ca-certificates/"
    fi
    chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
    log "importing $DEBIAN_IMAGE"
    tar -C "$rootfs" -c . | podman import \
        --change 'CMD ["/bin/bash"]' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        --change "LABEL org.tokembed.local-images=$RECIPE" \
        - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$rootfs"
}

build_from() {
    local image="$1" dockerfile="$2"
    log "building $image"
    podman build --quiet --build-arg "BASE_IMAGE=$DEBIAN_IMAGE" -t "$image" \
        --label "org.tokembed.local-images=$RECIPE" \
        -f "$HERE/$dockerfile" "$HERE" >/dev/null
}

if ! { have "$DEBIAN_IMAGE" && have "$PYTHON_IMAGE" && have "$PROMETHEUS_IMAGE"; } &&
    [ "$(id -u)" != 0 ]; then
    echo "$0: building the local images needs root (debootstrap, chroot); run it with sudo" >&2
    exit 2
fi
have "$DEBIAN_IMAGE" || build_debian
have "$PYTHON_IMAGE" || build_from "$PYTHON_IMAGE" python.Dockerfile
have "$PROMETHEUS_IMAGE" || build_from "$PROMETHEUS_IMAGE" prometheus.Dockerfile
log "ready: $DEBIAN_IMAGE $PYTHON_IMAGE $PROMETHEUS_IMAGE"
