"""The HTTP server: FastAPI app, protocol, streaming and metrics."""
