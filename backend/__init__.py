"""The backend: scheduler, block manager, model runner, models and sampler (token ids only)."""
