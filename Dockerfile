# One image for every fusetune container: the API server, the Ray head and the GPU workers.
# TORCH_SPEC picks the PyTorch build: the default CUDA wheel for GPU workers, or e.g.
# "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" for CPU-only images.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
WORKDIR /opt/fusetune
COPY pyproject.toml README.md ./
COPY server server
COPY scheduler scheduler
COPY fusion fusion
COPY workers workers
COPY client client
COPY migrations migrations
RUN pip install --no-cache-dir ${TORCH_SPEC} && pip install --no-cache-dir .
EXPOSE 8000
CMD ["fusetune", "serve", "--host", "0.0.0.0", "--port", "8000"]
