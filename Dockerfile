# Holdfast's image; the command picks the service:
#   docker run holdfast gateway | loop-worker | tool-runner | learning | migrate
#
# EXTRAS: the services the image carries (the root project's extras), by default
# all four. compose.yaml builds one image per service (EXTRAS=gateway, ...), so
# the gateway's carries no model SDK; a service missing from the image refuses
# to start, naming itself. `migrate` and `keys` need only the CLI, in every image.
# The gateway with HOLDFAST_EMBEDDER=openai|gemini: EXTRAS="gateway remote-embedders".
#
# BASE: any Debian bookworm image. The default has Python; on a base without it
# (docker/build-images.sh builds one from Debian's packages, for machines that
# cannot pull from a registry) the first step installs Debian's python3.
ARG BASE=python:3.11-slim
FROM ${BASE}

# bubblewrap and libseccomp: the tool-runner's sandbox; slirp4netns: the network of a
# sandbox allowed one (its own namespace; needs /dev/net/tun, see compose.yaml);
# e2fsprogs and mount: size-capped workspace images, used only when the runner may
# mount (root with CAP_SYS_ADMIN; as USER holdfast below, workspaces are uncapped).
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap libseccomp2 slirp4netns \
        e2fsprogs mount \
    && if ! command -v python3 >/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-venv ca-certificates; \
    fi \
    && rm -rf /var/lib/apt/lists/*

# uv from PyPI (not an image of its own, so no registry beyond PyPI is needed),
# in a venv of its own: Debian's python3 refuses system-wide pip installs.
ARG UV_VERSION=0.13.9
RUN python3 -m venv /opt/uv \
    && /opt/uv/bin/pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}" \
    && ln -s /opt/uv/bin/uv /opt/uv/bin/uvx /usr/local/bin/

ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    PYTHONUNBUFFERED=1

WORKDIR /app

# After the layers above, so that every service's image shares them.
ARG EXTRAS="gateway loop-worker tool-runner learning"

# Third-party dependencies first, in a layer that only a change of the lock
# (or of a pyproject) rebuilds.
COPY pyproject.toml uv.lock README.md ./
COPY shared/pyproject.toml shared/
COPY services/gateway/pyproject.toml services/gateway/
COPY services/loop-worker/pyproject.toml services/loop-worker/
COPY services/tool-runner/pyproject.toml services/tool-runner/
COPY services/learning/pyproject.toml services/learning/
COPY clients/python/pyproject.toml clients/python/
# --no-default-groups: neither the other services (the `engine` group) nor the
# test tools (`dev`), which `uv run` installs on a developer's machine.
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-default-groups $(printf -- '--extra %s ' $EXTRAS) --no-install-workspace

COPY . .
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-default-groups $(printf -- '--extra %s ' $EXTRAS)

ENV PATH="/app/.venv/bin:$PATH"

RUN useradd --system --create-home --uid 10001 holdfast \
    # The workspaces volume takes this directory's owner and mode when created.
    && install -d -m 0700 -o holdfast -g holdfast /home/holdfast/.holdfast /home/holdfast/.holdfast/workspaces
USER holdfast

ENTRYPOINT ["holdfast"]
CMD ["--help"]
