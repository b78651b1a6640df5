"""attnzoo serving: the published ONNX models behind the Open Inference Protocol; never imports torch."""

__version__ = "0.1.0"
