# One image for target, draft and gateway (docker-compose.yml runs it three times).
# CPU by default; the GPU variant (docker-compose.gpu.yml) builds it with a CUDA torch wheel:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t tandem:gpu .
FROM python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# torch first, from the chosen index, so the project's install keeps it
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.4"
COPY pyproject.toml README.md ./
COPY proto proto
COPY tandem tandem
COPY models models
COPY kernels kernels
COPY services services
COPY gateway gateway
COPY infra infra
RUN pip install -e . \
 && python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/tandem/v1/*.proto \
 && useradd --create-home --uid 1000 tandem
USER tandem
# 8000 REST (gateway), 50051 gRPC (gateway), 50052 target, 50053 draft, 29650 hidden-row bridge
EXPOSE 8000 50051 50052 50053 29650
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=30 \
  CMD ["python", "-m", "tandem.healthcheck", "http://127.0.0.1:8000/health"]
CMD ["tandem", "serve", "--model", "/model", "--host", "0.0.0.0"]
