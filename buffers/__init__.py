"""Data plane: replay queue, admission gate, balancing. Pure Python + anyio + msgspec."""
