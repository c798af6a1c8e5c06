# syntax=docker/dockerfile:1
# The vramctl job service (`vramctl serve`) on NVIDIA GPUs: docs/deploy.md.
#
#   docker compose up -d --build          # with compose.yaml beside this file
#
# PyTorch's default wheel on PyPI bundles its own CUDA libraries (CUDA 13.0 for torch 2.13),
# so the base image is the matching CUDA runtime and the host needs an NVIDIA driver that
# runs CUDA 13.0 (580 or later). For an older driver, see docs/deploy.md.
#
# BASE names another base image with apt and Python 3.10 or later (Debian or Ubuntu): the
# tests build on a Debian one, with the CPU build of PyTorch from a local folder of wheels
# (pip's own PIP_FIND_LINKS and PIP_NO_INDEX, passed as build arguments).
ARG BASE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${BASE}

ARG DEBIAN_FRONTEND=noninteractive
# Extras installed with vramctl: `serve` needs the command line and the server.
ARG VRAMCTL_EXTRAS=cli,server
# Where pip finds packages besides the index, and whether it uses the index at all: empty
# for PyPI (the default CUDA build of PyTorch).
ARG PIP_FIND_LINKS=
ARG PIP_NO_INDEX=

# Ubuntu's archive drops superseded versions, so pinned apt versions would break the build.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

# A user of its own: it owns the store and the token, and the jobs run as it.
RUN groupadd --gid 10001 vramctl \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin vramctl \
    && mkdir -p /data \
    && chown vramctl:vramctl /data

# vramctl in a virtual environment (Ubuntu's Python is marked externally managed). Its torch
# requirement takes PyTorch's default, CUDA build.
ENV VIRTUAL_ENV=/opt/vramctl \
    PATH=/opt/vramctl/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md /opt/vramctl-src/
COPY src /opt/vramctl-src/src
RUN python3 -m venv /opt/vramctl \
    && pip install --no-cache-dir "/opt/vramctl-src[${VRAMCTL_EXTRAS}]" \
    && rm -rf /opt/vramctl-src
COPY deploy/healthcheck.py /opt/vramctl/healthcheck.py

# The store (jobs.db), the token, settings.toml and the jobs' logs live under VRAMCTL_HOME.
# NVML (the `utility` capability) gives vramctl its device and per-process readings.
ENV VRAMCTL_HOME=/data \
    PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
VOLUME ["/data"]
WORKDIR /data
# The user vramctl, by number (a host or Kubernetes can check it is not root).
USER 10001:10001

EXPOSE 8765
# /health with the token ($VRAMCTL_TOKEN, else /data/token): on 0.0.0.0 every route needs it.
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["/opt/vramctl/bin/python", "/opt/vramctl/healthcheck.py"]

# On any address but loopback every route needs the token: the service writes a random one
# to $VRAMCTL_HOME/token (mode 0600) on first start, unless VRAMCTL_TOKEN gives one.
ENTRYPOINT ["vramctl"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8765"]
