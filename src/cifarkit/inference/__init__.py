"""The inference side: `Classifier` and its backends (PyTorch fp32, bf16 and fp16, ONNX Runtime), on a CPU or a GPU.

Never imports training, data, release or tools: `from cifarkit import Classifier` stays light."""
