"""The training side: recipes and their schema, the engine, optimizers, the training loop, its resumable state,
distributed launches, tracking and charts. Never imports inference, serving or release."""
