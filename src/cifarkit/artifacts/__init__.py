"""What a training run leaves for use: weights files, the release folder format and lookup, and the standalone
preprocess copied into every release. Shared by both sides, so it imports only core and models."""
