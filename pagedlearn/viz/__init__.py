"""Pictures of the paged KV cache, drawn from the real state (see ``state.py``)."""
