"""Run I/O: checkpoints, the run dir, metrics, TensorBoard / W&B, the executors' timeline,
compile seconds and the named host transfers."""
