"""The actors: the engine actor that owns the batch, and the per-request sessions around it."""
