# pdserve image: router, prefill and decode nodes, with the default model baked in.
#
#   docker build -t pdserve .                                   # CPU (python:3.11-slim)
#   docker build -t pdserve --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 .
#
# The container's command is a pdserve subcommand (router, prefill, decode) whose flags come from
# PDSERVE_* environment variables (see launcher/env_flags.py), e.g. PDSERVE_REDIS -> --redis.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Where pip finds torch (pinned in pyproject.toml): the CPU wheels unless a CUDA index is given.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PDSERVE_CACHE=/models \
    PYTHONPATH=/app \
    PATH=/opt/venv/bin:$PATH

# CUDA bases come without Python; python:3.11-slim has it. A venv either way (PEP 668 bases).
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY kv_transfer kv_transfer
COPY protocol protocol
COPY node node
COPY prefill_node prefill_node
COPY decode_node decode_node
COPY router router
COPY launcher launcher
COPY pdserve_cli pdserve_cli
RUN pip install --extra-index-url "${TORCH_INDEX}" -e .

# Convert the default model once, at build time: containers start without fetching anything.
# A larger local model is mounted as a volume instead (see README, "docker compose").
RUN pdserve model fetch --no-progress

EXPOSE 8000
ENTRYPOINT ["python", "-m", "launcher.env_flags"]
CMD ["router"]
