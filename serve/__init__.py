"""The HTTP front end (OpenAI-compatible Starlette app). No jax imports here."""
