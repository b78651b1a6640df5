"""Serving: runs published ONNX graphs with onnxruntime (never torch)."""
