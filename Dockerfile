# One image for every Holdfast service; the command picks the service:
#   docker run holdfast gateway | loop-worker | tool-runner | learning | migrate
FROM python:3.11-slim

# bubblewrap and libseccomp: the tool-runner's sandbox; slirp4netns: the network of a
# sandbox allowed one (its own namespace; needs /dev/net/tun, see compose.yaml);
# e2fsprogs and mount: size-capped workspace images, used only when the runner may
# mount (root with CAP_SYS_ADMIN; as USER holdfast below, workspaces are uncapped).
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap libseccomp2 slirp4netns \
        e2fsprogs mount \
    && rm -rf /var/lib/apt/lists/*

COPY --from=ghcr.io/astral-sh/uv:0.13.9 /uv /uvx /bin/

ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    PYTHONUNBUFFERED=1

WORKDIR /app

# Third-party dependencies first, in a layer that only a change of the lock
# (or of a pyproject) rebuilds.
COPY pyproject.toml uv.lock README.md ./
COPY shared/pyproject.toml shared/
COPY services/gateway/pyproject.toml services/gateway/
COPY services/loop-worker/pyproject.toml services/loop-worker/
COPY services/tool-runner/pyproject.toml services/tool-runner/
COPY services/learning/pyproject.toml services/learning/
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-workspace

COPY . .
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev

ENV PATH="/app/.venv/bin:$PATH"

RUN useradd --system --create-home --uid 10001 holdfast \
    # The workspaces volume takes this directory's owner and mode when created.
    && install -d -m 0700 -o holdfast -g holdfast /home/holdfast/.holdfast /home/holdfast/.holdfast/workspaces
USER holdfast

ENTRYPOINT ["holdfast"]
CMD ["--help"]
