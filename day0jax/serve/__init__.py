"""The OpenAI-compatible server: `python -m day0jax.serve [--model PATH] [--host 127.0.0.1] [--port 8000]`."""
