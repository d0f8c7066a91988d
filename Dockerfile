# syntax=docker/dockerfile:1
# The kvsidecar daemon image: docker build --build-arg FLAVOUR=cuda -t kvsidecar:0.1.0-cuda .
#   FLAVOUR=cpu   CPU torch and mooncake-transfer-engine-non-cuda (CPU engines, POSIX shared memory; tests, demos)
#   FLAVOUR=cuda  CUDA 12 torch and mooncake-transfer-engine (GPU engines, CUDA IPC); run with --gpus all
# Both variants also carry mooncake_master, so the same image runs an external master. See deploy/README.md.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG FLAVOUR=cpu
ARG TORCH_VERSION=2.13.0
# Empty: the PyTorch index of the flavour. mooncake-transfer-engine links libcudart.so.12, so a CUDA torch must
# be a CUDA 12 build (PyPI's default torch 2.13.0 is CUDA 13).
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/kvsidecar
ENV PATH=/opt/kvsidecar/bin:$PATH
# torch first and alone: installed later as a dependency of kvsidecar, pip would take PyPI's default build.
RUN case "$FLAVOUR" in \
      cpu) index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}" ;; \
      *) echo "FLAVOUR must be cpu or cuda, not '$FLAVOUR'" >&2; exit 1 ;; \
    esac \
 && pip install --index-url "$index" "torch==${TORCH_VERSION}"
# The contract and the client before the daemon, which depends on both at the same version.
COPY contract/ /src/contract/
COPY client/ /src/client/
COPY pyproject.toml README.md /src/
COPY kvsidecar/ /src/kvsidecar/
RUN pip install /src/contract /src/client "/src[${FLAVOUR}]"

FROM ${PYTHON_IMAGE} AS runtime
ARG FLAVOUR=cpu
LABEL org.opencontainers.image.title="kvsidecar" \
      org.opencontainers.image.description="Node-local KV-cache store daemon for LLM inference (Mooncake)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.kvsidecar.flavour="${FLAVOUR}"
# Mooncake's native libraries need libibverbs (even over TCP), libnuma and libcurl, none of which its wheels
# bundle; ibverbs-providers holds the RDMA NIC drivers (libmlx5, ...). Versions float with Debian's security
# updates; the base image tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ibverbs-providers libcurl4 libibverbs1 libnuma1 \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 kvsidecar \
 && useradd --system --uid 10001 --gid kvsidecar --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvsidecar \
 && install -d -m 0750 -o kvsidecar -g kvsidecar /run/kvsidecar
COPY --from=build /opt/kvsidecar /opt/kvsidecar
# CUDA: Mooncake's libraries link libcudart.so.12, which torch's nvidia-cuda-runtime-cu12 wheel holds outside the
# loader's path; list it so they load whatever was imported first. They also need the driver's libcuda.so.1,
# which only exists at run time (--gpus). CPU: load Mooncake once, so a missing library fails the build instead
# of the first start.
RUN if [ "$FLAVOUR" = cuda ]; then \
      /opt/kvsidecar/bin/python -c "import nvidia.cuda_runtime as m; print(m.__path__[0] + '/lib')" \
        > /etc/ld.so.conf.d/kvsidecar-cudart.conf \
      && ldconfig; \
    else \
      /opt/kvsidecar/bin/python -c "import mooncake.store"; \
    fi
ENV PATH=/opt/kvsidecar/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/tmp/.cache \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    MC_LOG_LEVEL=ERROR
# A writable working directory also under a read-only root filesystem (Kubernetes mounts an emptyDir on /tmp).
WORKDIR /tmp
USER 10001:10001
# The gRPC Unix socket: mount this directory into the engine's container (or share the volume).
VOLUME ["/run/kvsidecar"]
# Prometheus metrics; the gRPC service is on the socket (add --listen HOST:PORT for TCP).
EXPOSE 9469
# Start-up includes the embedded mooncake_master and the Mooncake client setup.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
  CMD ["kvsidecar", "status", "--quiet", "--socket", "/run/kvsidecar/kvsidecar.sock"]
ENTRYPOINT ["kvsidecar"]
CMD ["serve", "--socket", "/run/kvsidecar/kvsidecar.sock", "--metrics-address", "0.0.0.0:9469"]
