"""The OpenAI-compatible HTTP layer: protocol models, errors, SSE, routes."""
