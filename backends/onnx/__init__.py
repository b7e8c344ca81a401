"""ONNX: the export of a rewritten step, its manifest, and the ONNX Runtime program that runs an export."""
