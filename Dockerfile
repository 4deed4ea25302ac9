# attnserve: the service image. docs/deploy.md says how to build and run it.
#
#   docker build -t attnserve .                 podman build --format docker -t attnserve .
#   docker run --gpus 'all,"capabilities=compute,utility,graphics"' -p 8421:8421 attnserve
#   docker run -p 8421:8421 -e ATTNSERVE_ADAPTER= attnserve     # no GPU: Mesa's lavapipe
#
# Two stages, both FROM debian:bookworm-slim with Python from Debian's packages (so
# the image also builds from a locally imported base, without a registry):
#   builder  builds the attnserve wheel (the server with its one C extension,
#            compiled here with gcc, the client package it imports,
#            client/attnserve_client, and the load test, loadtest/) and a wheel
#            of every dependency;
#   runtime  installs those wheels (not the checkout) offline into a venv, with
#            only the run-time libraries: the Vulkan loader, Mesa's lavapipe as
#            the fallback without a GPU, and what NVIDIA's Vulkan driver links.
# RUN --mount needs BuildKit (docker's default builder) or buildah/podman.

FROM debian:bookworm-slim AS builder

# Version pins of Debian packages would break on every point release; the base
# image decides them.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
        gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY shaders/ shaders/
COPY service/ service/
COPY client/attnserve_client/ client/attnserve_client/
COPY loadtest/ loadtest/

# The server's wheel (with the client package), then every run-time dependency as
# a wheel, into /wheels.
RUN python3 -m pip wheel --no-cache-dir --wheel-dir /wheels . \
    && ls /wheels/attnserve-0*.whl


FROM debian:bookworm-slim AS runtime

# python3 + venv; libvulkan1 (the Vulkan loader); mesa-vulkan-drivers (lavapipe,
# software Vulkan, used when no GPU driver is there); libglvnd0, libegl1,
# libx11-6, libxext6: what libGLX_nvidia.so.0, NVIDIA's Vulkan driver mounted
# into the container by the NVIDIA Container Toolkit, links against.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv \
        libvulkan1 mesa-vulkan-drivers \
        libglvnd0 libegl1 libx11-6 libxext6 \
    && rm -rf /var/lib/apt/lists/*

# Install the wheels (mounted from the builder, so they take no layer) into a venv.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python3 -m venv /opt/attnserve \
    && /opt/attnserve/bin/python -m pip install --no-cache-dir --no-index --find-links /wheels attnserve \
    && /opt/attnserve/bin/python -m pip uninstall -y pip \
    && /opt/attnserve/bin/attnserve --help > /dev/null

# The NVIDIA Vulkan ICD, for when the container toolkit does not mount one; the
# loader skips it (and falls back to lavapipe) where libGLX_nvidia.so.0 is absent.
COPY deploy/vulkan/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json
COPY deploy/healthcheck.py /usr/local/bin/attnserve-healthcheck

RUN groupadd --system --gid 10001 attnserve \
    && useradd --system --uid 10001 --gid attnserve --no-log-init \
        --create-home --home-dir /home/attnserve --shell /usr/sbin/nologin attnserve \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/attnserve/snapshots \
    && chmod 0755 /usr/local/bin/attnserve-healthcheck

ENV PATH=/opt/attnserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XDG_RUNTIME_DIR=/tmp \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility,graphics \
    ATTNSERVE_HOST=0.0.0.0 \
    ATTNSERVE_PORT=8421

USER 10001:10001
WORKDIR /home/attnserve
EXPOSE 8421

HEALTHCHECK --interval=10s --timeout=5s --start-period=720s --retries=3 \
    CMD ["/opt/attnserve/bin/python", "/usr/local/bin/attnserve-healthcheck"]

STOPSIGNAL SIGTERM
# Host and port come from ATTNSERVE_HOST and ATTNSERVE_PORT above.
CMD ["attnserve", "serve"]
