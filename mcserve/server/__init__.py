"""The HTTP server: FastAPI app, protocol, streaming and metrics (DESIGN.md §2)."""
