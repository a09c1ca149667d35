"""Model pairs: the default pair (built or shipped), checkpoints, ONNX export, training and its corpus."""
