"""Integrations of flashcpp's attention with other libraries.

* :mod:`flashcpp.integrations.transformers`: ``register()`` makes flashcpp an
  ``attn_implementation`` of Hugging Face transformers models (docs/integrations.md).

Nothing here is imported by ``import flashcpp``; each integration imports its library only when
it is used.
"""
