# CPU image of Tandem (target, draft and gateway all run from it).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md Makefile ./
COPY proto proto
COPY tandem tandem
COPY models models
COPY kernels kernels
COPY services services
COPY gateway gateway
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch>=2.4" \
 && pip install --no-cache-dir -e . \
 && python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/tandem/v1/*.proto
EXPOSE 50051 50052 50053 29650
CMD ["tandem", "serve", "--model", "/model", "--host", "0.0.0.0"]
