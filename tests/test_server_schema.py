"""Property-based check of the HTTP API with schemathesis: requests generated from the app's own
OpenAPI schema (valid and invalid ones) never get a 5xx.

The app runs in-process over the real engine on a tiny random model with a short context
(``max_model_len=64``) so that the largest generated requests stay cheap; the number of examples
per operation is bounded and the run is derandomized (the same cases every run).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from mcserve.config import EngineConfig, ModelConfig  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.tokenizer import Tokenizer  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402
from mcserve.server.app import build_app  # noqa: E402

MAX_EXAMPLES = 30


def _app():  # noqa: ANN202 - a FastAPI app
    torch.manual_seed(0)
    model = MCForCausalLM(ModelConfig(d_model=32, n_layers=1, n_heads=2, head_dim=16,
                                      segment_len=8))
    engine = LLMEngine(EngineConfig(max_model_len=64, num_state_blocks=256, max_num_seqs=32),
                       model=model, tokenizer=Tokenizer.byte_level(), model_name="tiny")
    return build_app(engine, max_body_bytes=256 * 1024)


APP = _app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def _stop_engine() -> Iterator[None]:
    yield
    APP.state.async_engine.close()


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    response = case.call(timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
