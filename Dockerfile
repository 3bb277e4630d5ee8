# mcserve serving the embedded default model on port 8000 (CPU).
#   docker build -t mcserve . && docker run --rm -p 8000:8000 mcserve
# Not built in CI (no Docker engine on the CI machines); the same steps are README's first command.
FROM python:3.11-slim
WORKDIR /app
# the CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY mcserve ./mcserve
RUN pip install --no-cache-dir .
EXPOSE 8000
CMD ["mcserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
