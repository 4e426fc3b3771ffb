"""The inference side: `Classifier` and its backends (PyTorch fp32, bf16, ONNX Runtime).

Never imports training, data, release or tools: `from cifarkit import Classifier` stays light."""
